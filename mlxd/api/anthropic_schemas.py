"""Anthropic Messages API request and response bodies (msgspec structs).

Requests reject unknown top-level fields, like the OpenAI ones (``mlxd.api.schemas``); the fields marked
``NO-OP`` are accepted because current clients (the ``anthropic`` SDKs, Claude Code) send them, and have no effect.
Content blocks, tools and the small option objects accept extra keys (``citations`` on any block, ``caller`` on
tool uses...): clients echo back whatever earlier responses held. Blocks are tagged unions on
``type``, so a block type mlxd does not know is a 400 naming where it is. ``cache_control`` marks a cache breakpoint
(:mod:`mlxd.api.anthropic_jobs`).

Responses and stream events carry their ``type`` as the struct's tag, so it is written first, as Anthropic does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from mlxd.api.schemas import Lenient, MaxTokens, Strict, TopK, TopP

# Anthropic's range (1 is its API's default; mlxd's is `[model.sampling] temperature`). The zero is repeated as a
# schema extra because Litestar leaves a bound of 0 out of the OpenAPI document.
Temperature = Annotated[float, Meta(description="0 is greedy", ge=0, le=1,
                                    extra_json_schema={"extra": {"minimum": 0}})]


# ---- request content blocks ----


class Block(Lenient, tag_field="type"):
    # A cache breakpoint: the prompt's state is snapshotted where this block ends (mlxd.api.anthropic_jobs).
    cache_control: Any = None


class TextBlock(Block, tag="text", kw_only=True):
    text: str
    citations: Any = None  # NO-OP


class Base64Source(Lenient, tag_field="type", tag="base64", kw_only=True):
    media_type: str
    data: str


class URLSource(Lenient, tag_field="type", tag="url", kw_only=True):
    url: str


class FileSource(Lenient, tag_field="type", tag="file", kw_only=True):
    # Refused when the request is turned into a job (mlxd has no Files API), naming the block.
    file_id: str


class ImageBlock(Block, tag="image", kw_only=True):
    source: Base64Source | URLSource | FileSource


class ToolUseBlock(Block, tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Block, tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False


class ThinkingBlock(Block, tag="thinking", kw_only=True):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Block, tag="redacted_thinking", kw_only=True):
    data: str = ""


ContentBlock = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class MessageParam(Lenient, kw_only=True):
    # `system`: a system message in mid-conversation (Claude Code sends them, beta `mid-conversation-system`).
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


# ---- tools and options ----


class Tool(Lenient, kw_only=True):
    """A custom tool (``type`` absent or ``custom``, with ``input_schema``), or a tool Anthropic defines or runs
    (``web_search_20250305``, ``bash_20250124``, ``text_editor_...``), which mlxd leaves out of the prompt."""

    name: str
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: Any = None  # the end of the tool definitions: snapshotted for every request


class ToolChoiceBase(Lenient, tag_field="type"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAuto(ToolChoiceBase, tag="auto", kw_only=True):
    pass


class ToolChoiceAny(ToolChoiceBase, tag="any", kw_only=True):
    pass


class ToolChoiceTool(ToolChoiceBase, tag="tool", kw_only=True):
    name: str


class ToolChoiceNone(ToolChoiceBase, tag="none", kw_only=True):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(Lenient, tag_field="type", tag="enabled", kw_only=True):
    # Accepted, not enforced: the template's thinking switch is on, the model decides how long it thinks.
    budget_tokens: Annotated[int, Meta(ge=0)] = 0


class ThinkingAdaptive(Lenient, tag_field="type", tag="adaptive", kw_only=True):
    pass


class ThinkingDisabled(Lenient, tag_field="type", tag="disabled", kw_only=True):
    pass


Thinking = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled


# ---- requests ----


class PromptFields(Strict, kw_only=True):
    """What shapes the prompt: shared by ``/v1/messages`` and ``/v1/messages/count_tokens``."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # Automatic caching: a breakpoint at the end of the last message, where every prompt is snapshotted anyway.
    cache_control: Any = None
    # NO-OP fields: accepted, no effect.
    context_management: Any = None
    mcp_servers: Any = None
    output_config: Any = None
    speed: Any = None


class MessagesRequest(PromptFields, kw_only=True):
    max_tokens: MaxTokens
    stop_sequences: list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False
    # NO-OP fields.
    metadata: Any = None
    service_tier: Any = None
    container: Any = None
    inference_geo: Any = None


class CountTokensRequest(PromptFields, kw_only=True):
    pass


# ---- responses ----


class OutBlock(msgspec.Struct, tag_field="type"):
    pass


class TextOut(OutBlock, tag="text", kw_only=True):
    text: str


class ThinkingOut(OutBlock, tag="thinking", kw_only=True):
    thinking: str
    # mlxd does not sign reasoning: always the empty string (clients send it back; mlxd never checks it).
    signature: str = ""


class ToolUseOut(OutBlock, tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class Usage(msgspec.Struct):
    # Prompt tokens that were computed; those served from the prefix cache are ``cache_read_input_tokens``.
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    role: str = "assistant"
    model: str
    content: list[TextOut | ThinkingOut | ToolUseOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


class ErrorObject(msgspec.Struct):
    type: str
    message: str


# ---- stream events (each sent as an SSE event named after its type) ----


class Event(msgspec.Struct, tag_field="type"):
    pass


class ErrorResponse(Event, tag="error", kw_only=True):
    """The error body of every failure on these routes, and the ``error`` event of a stream that fails."""

    error: ErrorObject


class MessageStart(Event, tag="message_start", kw_only=True):
    message: Message


class ContentBlockStart(Event, tag="content_block_start", kw_only=True):
    index: int
    content_block: TextOut | ThinkingOut | ToolUseOut


class Delta(msgspec.Struct, tag_field="type"):
    pass


class TextDelta(Delta, tag="text_delta", kw_only=True):
    text: str


class ThinkingDelta(Delta, tag="thinking_delta", kw_only=True):
    thinking: str


class SignatureDelta(Delta, tag="signature_delta", kw_only=True):
    signature: str


class InputJSONDelta(Delta, tag="input_json_delta", kw_only=True):
    partial_json: str


class ContentBlockDelta(Event, tag="content_block_delta", kw_only=True):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJSONDelta


class ContentBlockStop(Event, tag="content_block_stop", kw_only=True):
    index: int


class StopInfo(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(Event, tag="message_delta", kw_only=True):
    delta: StopInfo
    usage: Usage


class MessageStop(Event, tag="message_stop", kw_only=True):
    pass
