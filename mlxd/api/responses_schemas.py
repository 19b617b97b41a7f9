"""OpenAI Responses API bodies (``POST /v1/responses``): the request, the response object, its output items and the
named SSE events of a streamed response.

The request rejects unknown top-level fields, as :mod:`mlxd.api.schemas` does; the fields marked ``NO-OP`` are
accepted for compatibility (Codex and the ``openai`` SDK send them) and have no effect. ``input`` items and tools are
kept as plain objects here and checked one by one by :mod:`mlxd.api.responses_jobs`, which names the bad item
(``input[3]``) and drops the kinds the server cannot run instead of refusing them.

Output structs are tagged (``type`` comes first, as in OpenAI's bodies) and keep their ``null`` fields: the SDK's
models expect the keys.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from mlxd.api.schemas import Lenient, MaxTokens, PromptCacheKey, Strict, Temperature, TopLogprobs, TopP

# ---- request ----


class ReasoningParam(Lenient, kw_only=True):
    # "none"/"minimal" turn the template's thinking off; "low"/"medium"/"high" (and "xhigh", read as "high") on.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # NO-OP: the whole reasoning is the summary
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # NO-OP (deprecated name)


class TextFormat(Lenient, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextParam(Lenient, kw_only=True):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # NO-OP


class StreamOptionsParam(Lenient, kw_only=True):
    include_obfuscation: bool | None = None  # NO-OP: nothing is obfuscated


class ResponsesRequest(Strict, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningParam | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextParam | None = None
    stream: bool = False
    # Refused with a 400: mlxd keeps no state between requests.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None  # false (or absent) only
    # Accepted; "message.output_text.logprobs" is refused, the other values are NO-OPs.
    include: list[str] | None = None
    # Requests sharing a key snapshot their prompt where it parts from the key's previous one (as chat's).
    prompt_cache_key: PromptCacheKey | None = None
    # NO-OP fields: accepted, no effect.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    client_metadata: dict[str, Any] | None = None
    stream_options: StreamOptionsParam | None = None
    max_tool_calls: int | None = None  # a limit on built-in tools, which mlxd does not run
    top_logprobs: TopLogprobs | None = None  # only used with the refused include value


# The input items and tools that become part of the prompt, checked one by one.


class InputMessage(Lenient, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class InputFunctionCall(Lenient, kw_only=True):
    call_id: str
    name: str
    # A JSON string per the API; some clients send an object.
    arguments: str | dict[str, Any] = "{}"


class InputFunctionCallOutput(Lenient, kw_only=True):
    call_id: str
    output: str | list[dict[str, Any]]


class FunctionTool(Lenient, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# ---- response ----


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)


class SummaryText(msgspec.Struct, tag_field="type", tag="summary_text"):
    text: str


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning", kw_only=True):
    id: str
    summary: list[SummaryText]
    status: str = "completed"


class MessageItem(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = ReasoningItem | MessageItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    # Estimated: the completion's tokens times the reasoning's share of the generated characters.
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """A response, in OpenAI's field order: the settings it ran with are echoed back (the SDK requires them)."""

    id: str
    object: str = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool = False
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False  # nothing is stored, whatever the request asked
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


# ---- streaming events: each is sent as `event: <type>` with `type` in its data too ----


class LifecycleEvent(msgspec.Struct, kw_only=True):
    """response.created, response.in_progress, response.completed, response.incomplete, response.failed."""

    type: str
    sequence_number: int
    response: ResponseObject


class ItemEvent(msgspec.Struct, kw_only=True):
    """response.output_item.added and response.output_item.done."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(msgspec.Struct, kw_only=True):
    """response.content_part.added and response.content_part.done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class TextDoneEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ArgumentsDeltaEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class SummaryPartEvent(msgspec.Struct, kw_only=True):
    """response.reasoning_summary_part.added and response.reasoning_summary_part.done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    part: SummaryText


class SummaryDeltaEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    delta: str


class SummaryDoneEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    text: str


class ResponseSettings(msgspec.Struct, kw_only=True):
    """What a response echoes of its request: the settings it ran with (tools as honoured, sampling as applied)."""

    model: str
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_p: float | None = None
    user: str | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
