"""The typed events of a response stream, from ``detokenize`` and ``parse`` to the API surfaces.

Every API surface (OpenAI chat and completions, Anthropic messages, OpenAI responses) renders these events; none
re-parses text. ``detokenize`` makes :class:`ContentDelta`, :class:`TokenLogprobs` and :class:`Done`; ``parse``
splits content into :class:`ReasoningDelta` and :class:`ToolCallDelta`.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ContentDelta(msgspec.Struct, frozen=True):
    """Generated text for the answer, cut at stop sequences, free of special tokens and tool-call markup."""

    text: str


class ReasoningDelta(msgspec.Struct, frozen=True):
    """Generated text of the model's reasoning (``reasoning_content``), kept apart from the answer."""

    text: str


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of the ``index``-th tool call of the response: its first delta carries ``id`` and ``name``, later
    ones carry fragments of its JSON ``arguments``; the fragments joined are the arguments as a JSON object."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class TopLogprob(msgspec.Struct, frozen=True):
    token: int
    text: str
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """One generated token with its log-probability under the model's raw logits (before penalties, bias, grammar
    masks and temperature), and the ``top`` most likely tokens at its position when asked for."""

    token: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


class TokenLogprobs(msgspec.Struct, frozen=True):
    """Log-probabilities of the tokens whose text the stream has sent so far (in order)."""

    entries: tuple[TokenLogprob, ...]


class KeepAlive(msgspec.Struct, frozen=True):
    """Nothing to send yet (queued or prefilling); streaming clients get an SSE comment."""


class Done(msgspec.Struct, frozen=True, kw_only=True):
    """The last event of a response stream.

    ``finish_reason``: ``stop`` (a stop token or sequence, or a parser that ended the stream), ``length``,
    ``tool_calls``, ``cancelled`` or ``error``. ``stop_sequence``: the stop string that matched, if one did.
    """

    finish_reason: str
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int = 0
    cache_hit: str = "miss"
    stop_sequence: str | None = None
    # How the engine decoded it (plain with the reason, or the speculative counters): for the request log line.
    decode: dict[str, Any] | None = None
    # Where the time to first token went in the engine (:class:`mlxd.engine.base.Finished`).
    queued_s: float | None = None
    prefill_s: float | None = None
