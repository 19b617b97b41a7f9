"""OpenAI-compatible request and response bodies (msgspec structs).

Requests reject unknown top-level fields (a typo is a 400, not a silent ignore); the fields listed as
``NO-OP`` are accepted for compatibility and have no effect (see README). Message objects accept extra keys,
because agents echo back whatever earlier responses contained.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class Lenient(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class ImageURL(Lenient, kw_only=True):
    url: str
    detail: str | None = None


class ContentPart(Lenient, kw_only=True):
    type: Literal["text", "image_url", "input_text", "image", "input_image"]
    text: str | None = None
    image_url: ImageURL | str | None = None


class FunctionCall(Lenient, kw_only=True):
    name: str
    # A JSON string per the OpenAI API; some clients send an object.
    arguments: str | dict[str, Any] = "{}"


class ToolCall(msgspec.Struct, kw_only=True):
    # Defaults are kept on output: templates render tool calls as given, `type` included.
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionSpec(Lenient, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(Lenient, kw_only=True):
    # Required (as in the OpenAI API) so that templates that render tools as JSON see it.
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(Strict, kw_only=True):
    include_usage: bool = False


class ResponseFormat(Lenient, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(Strict, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # NO-OP fields: accepted, no effect.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    # NO-OP fields.
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[int]
    echo: bool = False
    # NO-OP fields.
    best_of: int | None = None
    suffix: str | None = None


# ---- responses ----


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class AssistantMessage(msgspec.Struct):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str = "mlxd"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str = "mlxd"


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(msgspec.Struct, omit_defaults=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str = "mlxd"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "mlxd"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail
