"""Per-request state that flows through the pipeline, and the events of its response stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from mlxd.engine.base import EngineRequest, Media, SamplingParams


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
    sampling: SamplingParams = SamplingParams()
    stop: list[str] = field(default_factory=list)
    # Filled by stages.
    images: list[Any] = field(default_factory=list)  # decoded (mlxd.media), in prompt order: vision models only
    media: Media | None = None  # the images processed for the model, with their placeholder spans
    prompt_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    checkpoints: tuple[int, ...] = ()
    route: str = ""
    engine_request: EngineRequest | None = None
    # Room for third-party stages.
    extra: dict[str, Any] = field(default_factory=dict)


class TextDelta(msgspec.Struct, frozen=True):
    """Generated text, already cut at stop sequences and free of special tokens."""

    text: str


class KeepAlive(msgspec.Struct, frozen=True):
    """Nothing to send yet (queued or prefilling); streaming clients get an SSE comment."""


class Done(msgspec.Struct, frozen=True, kw_only=True):
    """The last event of a response stream."""

    finish_reason: str
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int = 0
    cache_hit: str = "miss"
