"""OpenAI-compatible request and response bodies (msgspec structs).

Requests reject unknown top-level fields (a typo is a 400, not a silent ignore); the fields listed as
``NO-OP`` are accepted for compatibility and have no effect (see README). Message objects accept extra keys,
because agents echo back whatever earlier responses contained.

The ranges of the sampling fields live here, as ``msgspec.Meta`` constraints: they are enforced when a body is
decoded (``mlxd.api.body``) and published in the OpenAPI document. What depends on the loaded model (token ids
below the vocabulary size) is checked by ``mlxd.api.validate``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# ---- ranges (a value outside is a 400 naming the field; nothing is clamped) ----


def _range(description: str | None = None, **bounds: float) -> Meta:
    # Litestar leaves a bound of 0 out of the OpenAPI document (it tests the value's truth), so zeros are repeated
    # as schema extras there; msgspec enforces the bounds themselves.
    names = {"ge": "minimum", "gt": "exclusive_minimum", "le": "maximum", "lt": "exclusive_maximum"}
    zeros = {names[key]: 0 for key, value in bounds.items() if value == 0}
    return Meta(description=description, extra_json_schema={"extra": zeros} if zeros else None, **bounds)


Temperature = Annotated[float, _range("0 is greedy", ge=0, le=2)]
TopP = Annotated[float, _range(gt=0, le=1)]
TopK = Annotated[int, _range("0 is off; below the model's vocabulary size", ge=0)]
MinP = Annotated[float, _range("0 is off", ge=0, le=1)]
Penalty = Annotated[float, _range(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, _range("1 is off", gt=0)]
Seed = Annotated[int, _range(ge=0, le=2**63 - 1)]
MaxTokens = Annotated[int, _range(ge=1)]
TokenId = Annotated[int, _range("below the model's vocabulary size", ge=0)]
# A token id as a JSON object key: decimal digits only, no sign, spaces, exponent or leading zero. The end is
# `(?![\s\S])`, not `$`, which in Python also matches before a final newline ("5\n").
TokenIdKey = Annotated[str, Meta(pattern=r"^(0|[1-9][0-9]{0,9})(?![\s\S])")]
Bias = Annotated[float, _range(ge=-100, le=100)]
TopLogprobs = Annotated[int, _range("alternatives per token", ge=0, le=20)]


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class Lenient(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class ImageURL(Lenient, kw_only=True):
    url: str
    detail: str | None = None


class ContentPart(Lenient, kw_only=True):
    # Video parts are accepted here so that `normalize` can refuse them naming the part.
    type: Literal["text", "image_url", "input_text", "image", "input_image", "video_url", "input_video", "video"]
    text: str | None = None
    image_url: ImageURL | str | None = None
    # A cache breakpoint where this text part ends, as Anthropic's (sent on OpenAI-shaped bodies by clients that
    # also talk to Anthropic models through a router): mlxd.api.jobs.
    cache_control: Any = None


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


PromptCacheKey = Annotated[str, Meta(max_length=1024)]


class SamplingFields(Strict, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, _range("choices; at most [engine] max_n", ge=1)] = 1
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[TokenIdKey, Bias] | None = None
    # mlxd: false decodes this request without drafted tokens; true asks for speculation where the server's
    # default is off. Ignored (plain decoding) when the server has no drafter: the reason is in /v1/status.
    speculative: bool | None = None
    # NO-OP fields: accepted, no effect.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    # "none"/"minimal" turn the template's thinking off; "low"/"medium"/"high" turn it on (and reach templates that
    # take `reasoning_effort`, as gpt-oss's does).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Requests sharing a key snapshot their prompt where it parts from the key's previous one (the shared prefix),
    # so that the next request of that family reuses all of it (mlxd.pipeline.stages.template_points).
    prompt_cache_key: PromptCacheKey | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[TokenId]
    echo: bool = False
    # The legacy API's logprobs: how many top alternatives per token (0 to 5; mlxd allows up to 20).
    logprobs: TopLogprobs | None = None
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


class FunctionOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionOut
    type: str = "function"


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class LogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(msgspec.Struct):
    content: list[LogprobOut] | None = None
    refusal: None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    # `role` and `content` are always there (content null beside tool calls); the others only when present.
    role: str
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


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
    reasoning_content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


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
    logprobs: CompletionLogprobs | None = None


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
    # mlxd's own: the model's "unloaded", "loading", "ready" or "failed" (mlxd/registry.py).
    state: str = "ready"


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
