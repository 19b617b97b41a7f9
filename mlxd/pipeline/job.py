"""Per-request state that flows through the pipeline (the events of its response stream are in
:mod:`mlxd.pipeline.events`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from mlxd.engine.base import DecodeMode, EngineRequest, Media, Plain, SamplingParams


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """How the engine processes a prompt, made by the ``prefill`` stage (the prefill chunker): chunks of at most
    ``chunk_tokens`` tokens, a chunk ending at each of ``checkpoints`` (positions worth a prefix-cache snapshot;
    caches that cannot be trimmed are only reused where one was taken), and room for ``max_tokens`` completion
    tokens after the prompt, within the model's context."""

    chunk_tokens: int
    checkpoints: tuple[int, ...]
    max_tokens: int


@dataclass(slots=True)
class Job:
    """One request on its way through the stages. Stages fill in the later fields."""

    request_id: str
    model: str
    # Chat requests carry messages (plain dicts in OpenAI shape); text completions carry a prompt.
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    # Clients that always send a huge max_tokens (Anthropic Messages, OpenAI Responses): cut it to what the context
    # leaves instead of refusing the request; ``max_tokens_clamped_from`` then records what was asked (for the log).
    clamp_max_tokens: bool = False
    max_tokens_clamped_from: int | None = None
    sampling: SamplingParams = SamplingParams()
    stop: list[str] = field(default_factory=list)
    # Output features (chat): what the ``parse`` stage enforces and extracts.
    tool_choice: str | dict[str, Any] | None = None  # "auto", "none", "required" or {"type": "function", ...}
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None  # {"type": "json_object"} or {"type": "json_schema", ...}
    num_logprobs: int | None = None  # None: none; k: the chosen token's and the top k alternatives' logprobs
    # Client cache breakpoints (Anthropic ``cache_control``): markers the API wrote into the messages' text where
    # each breakpoint falls (``mlxd.pipeline.stages.template_points.Breakpoints``); ``template`` locates them and
    # renders the prompt without them. ``prompt_cache_key`` (OpenAI): requests sharing it snapshot where they part
    # from the previous one.
    cache_breakpoints: tuple[str, ...] = ()
    prompt_cache_key: str | None = None
    # Filled by stages.
    images: list[Any] = field(default_factory=list)  # decoded (mlxd.media), in prompt order: vision models only
    media: Media | None = None  # the images processed for the model, with their placeholder spans
    prompt_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    # Prompt positions worth a snapshot (``template``): where the last message ends, where the system prompt and
    # tools end, the client's breakpoints, where the prompt parts from its prompt_cache_key's previous one.
    checkpoints: tuple[int, ...] = ()
    route: str = ""  # "text" or "vision": set by ``route``; the engine acts on it
    speculative: bool | None = None  # the body's "speculative": None leaves it to [engine.speculative] default
    decode: DecodeMode = Plain()  # set by ``route``
    chunk_plan: ChunkPlan | None = None  # set by ``prefill``
    engine_request: EngineRequest | None = None  # built by ``decode`` from the fields above
    # Special tokens that stages downstream of ``detokenize`` need to see (tool-call and channel markers).
    keep_token_ids: frozenset[int] = frozenset()
    # Set by a stage that ends the response stream before the engine does (a stop sequence, a parser): the
    # request then finishes as ``stop`` in the engine, not as a cancellation.
    ended_by_pipeline: bool = False
    # Room for third-party stages.
    extra: dict[str, Any] = field(default_factory=dict)

    def forced_output(self) -> str | None:
        """The request field that forces the shape of the output (enforced with a grammar by ``parse``):
        ``tool_choice`` when it is ``required`` or names a function of the request's tools, ``response_format``
        when it asks for JSON; None when the output is free."""
        if self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, dict)):
            return "tool_choice"
        return "response_format" if self.response_format is not None else None


# The fields the API fills in from the request body; stages provide the others (``Stage.provides``).
REQUEST_FIELDS = frozenset({
    "request_id", "model", "messages", "prompt", "tools", "template_kwargs", "max_tokens", "clamp_max_tokens",
    "sampling", "stop", "tool_choice", "parallel_tool_calls", "response_format", "num_logprobs", "speculative",
    "cache_breakpoints", "prompt_cache_key", "extra",
})
JOB_FIELDS = frozenset(f.name for f in fields(Job))
