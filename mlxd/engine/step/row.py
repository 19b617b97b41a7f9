"""A request's row in the batch: its sampling state (sampler, processors, random key), its cache until it joins the
decode batch, its speculative state; and the checks that keep a request's values safe to hand to MLX."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from mlxd.cache.quantized import KVQuantization, quantize_layers
from mlxd.engine.base import EngineRequest, SamplingParams
from mlxd.engine.speculative.state import SpecState
from mlxd.engine.step.penalties import penalty_key
from mlxd.engine.step.sampling import make_request_processors, make_request_sampler, sampler_group

# mx.random.seed takes an unsigned 64-bit integer.
MAX_SEED = 2**64 - 1


@dataclass(slots=True, eq=False)
class Row:
    """One request's sampling state: its sampler, logits processors and (when they need it) token history."""

    request_id: str
    params: SamplingParams
    sampler: Any
    sampler_key: tuple
    processors: list
    history: mx.array | None = None
    # The settings its processors come from, when those are all it has (no constraint): rows with equal ones are
    # processed together in a decode step (mlxd.engine.step.penalties). None: none, or processors of its own.
    penalties: tuple | None = None
    cache: list[Any] = field(default_factory=list)  # its own cache until it joins the batch
    # A vision row's prompt: merged input embeddings and per-prompt inputs (mlxd.models.vlm.VisionPrompt).
    vision: Any = None
    # Log-probabilities: None when not asked for, else how many top alternatives to report (0: the chosen only).
    num_logprobs: int | None = None
    # Those of the token sampled last (lazy arrays, see :func:`capture_logprobs`), until the step that feeds it in.
    pending_logprobs: tuple[Any, int, int] | None = None  # mlxd.engine.step.logprobs.Pending
    # A speculative row's drafter, draft length, back-off and counters (mlxd.engine.speculative.state); None: plain.
    spec: SpecState | None = None
    # For drafters that read the model's hidden states (MTP heads): those of the positions kept since the last draft.
    hidden: list[mx.array] = field(default_factory=list)

    @property
    def wants_hidden(self) -> bool:
        return self.spec is not None and self.spec.drafter.needs_hidden

    def keep_hidden(self, hidden: mx.array) -> None:
        """Keep the hidden states ``(L, H)`` of positions the row just kept; a row that drafts rarely keeps the
        latest 512 positions (a drafter skips positions it is not given)."""
        self.hidden.append(hidden)
        while len(self.hidden) > 1 and sum(h.shape[0] for h in self.hidden[1:]) >= 512:
            self.hidden.pop(0)

    def take_hidden(self) -> mx.array | None:
        """The hidden states kept since the last call, ``(m, H)``, or None."""
        if not self.hidden:
            return None
        hidden, self.hidden = mx.concatenate(self.hidden) if len(self.hidden) > 1 else self.hidden[0], []
        return hidden

    @property
    def rope_delta(self) -> int:
        """Decode positions are cache offset + this (multimodal RoPE after an image), else 0."""
        return self.vision.rope_delta if self.vision is not None else 0

    def release_prompt(self) -> None:
        """Drop what only prompt chunks need (a vision row's merged embeddings can be hundreds of MB)."""
        if self.vision is not None:
            self.vision.embeds, self.vision.extras = None, {}

    def prompt_inputs(self, start: int, end: int) -> dict[str, Any]:
        """What a prompt chunk ``[start, end)`` is run with besides its token ids: a vision row's embeddings
        for the chunk and its per-prompt inputs (sliced at the cache offset by the model); nothing for text."""
        if self.vision is None:
            return {}
        return {"embeds": self.vision.embeds[:, start:end], **self.vision.extras}

    @classmethod
    def for_request(cls, request_id: str, params: SamplingParams, model: Any, max_kv_size: int,
                    cache: list[Any] | None = None, *,
                    make_sampler: Callable[[SamplingParams], Any] = make_request_sampler,
                    extra_processors: list | None = None, num_logprobs: int | None = None,
                    kv: KVQuantization | None = None) -> Row:
        """A row for a request; ``cache`` is state to continue from (a prefix-cache hit), else a fresh cache
        (quantized attention layers with ``kv``). ``extra_processors`` (a request's constraints) run after the
        penalties and bias."""
        return cls(
            request_id=request_id,
            params=params,
            sampler=make_sampler(params),
            sampler_key=sampler_group(params, request_id),
            processors=make_request_processors(params) + list(extra_processors or ()),
            penalties=penalty_key(params) if not extra_processors else None,
            cache=cache if cache is not None else make_request_cache(model, max_kv_size, kv),
            num_logprobs=num_logprobs,
        )


    def process(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """Apply this row's logits processors; ``tokens`` are the new input tokens (added to the history)."""
        if not self.processors:
            return logits
        self.history = tokens if self.history is None else mx.concatenate([self.history, tokens])
        for processor in self.processors:
            logits = processor(self.history, logits)
        return logits

    def rollback_history(self, count: int) -> None:
        """Forget the last ``count`` tokens of the history (drafts the model did not keep); processors that keep
        state of their own (a grammar) roll back with it."""
        self.history = self.history[: self.history.size - count]
        for processor in self.processors:
            rollback = getattr(processor, "rollback", None)
            if rollback is not None:
                rollback(self.history.size)


class Refused(ValueError):
    """A request the engine will not hand to MLX as asked; the message names the value and is safe to show."""


def check_request(request: EngineRequest, vocab_size: int) -> SamplingParams:
    """The request's sampling settings, safe to hand to MLX, or ``Refused``.

    Token ids (prompt, ``logit_bias`` keys) must be in ``[0, vocab_size)``: MLX does not bounds-check gathers and
    scatters, so one outside reads or writes memory it does not own. A seed must fit ``mx.random.seed``. A ``top_k``
    that keeps the whole vocabulary is turned off: the same distribution, where mlx-lm's sampler would raise (and,
    raising inside a compiled function, break the global random state). ``vocab_size`` 0 skips the id checks.
    """
    params = request.sampling
    seed = params.seed
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise Refused(f"seed must be in [0, {MAX_SEED}], got {seed}")
    if not vocab_size:
        return params
    bad = [token for token in params.logit_bias or () if not 0 <= token < vocab_size]
    if bad:
        raise Refused(f"logit_bias keys must be token ids in [0, {vocab_size}), got {bad[:5]}")
    if request.prompt and not (0 <= min(request.prompt) and max(request.prompt) < vocab_size):
        bad = [token for token in request.prompt if not 0 <= token < vocab_size]
        raise Refused(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
    if params.top_k >= vocab_size:
        return msgspec.structs.replace(params, top_k=0)
    return params


def sample_each(rows: list[Row], logprobs: mx.array, errors: dict[str, Exception]) -> mx.array:
    """Sample row by row, evaluating each token, so that a failure lands on its own row (the slow path of a decode
    step whose grouped sampling raised): a row that fails again is recorded in ``errors`` and fed a placeholder."""
    reset_random_state()
    mx.eval(logprobs)  # raises when the forward pass itself failed: that is every row's loss
    tokens = []
    for i, row in enumerate(rows):
        try:
            token = row.sampler(logprobs[i : i + 1])
            mx.eval(token)
        except Exception as e:  # noqa: BLE001 - recorded in errors; the engine ends this row
            reset_random_state()
            errors[row.request_id] = e
            token = mx.zeros((1,), dtype=mx.uint32)
        tokens.append(token.astype(mx.uint32))
    return mx.concatenate(tokens)


def reset_random_state() -> None:
    """Give MLX's global random state a fresh key: after a failed graph it can point at an array that cannot be
    evaluated, and every later sampled request would fail with it."""
    mx.random.seed(secrets.randbits(64))


def logits_width(model: Any) -> int:
    """How many logits the model produces per position: token ids at or above it are outside its vocabulary.

    Builds one position's forward pass without evaluating it: MLX knows the shape of a lazy array.
    """
    return model(mx.array([[0]], dtype=mx.uint32), cache=make_request_cache(model)).shape[-1]


def make_request_cache(model: Any, max_kv_size: int = 0, kv: KVQuantization | None = None) -> list[Any]:
    """A request's own cache: the model's, or one ``RotatingKVCache`` per layer when ``max_kv_size`` is set; with
    ``kv``, its attention layers quantized (:func:`mlxd.cache.quantized.quantize_layers`).

    The rotating cache keeps no leading tokens (``keep=0``, where ``generate_step`` keeps 4): mlx-lm's batched
    rotating cache has no such option, and a request must attend to the same tokens alone and in a batch.
    """
    if kv is not None:
        return quantize_layers(make_prompt_cache(model), kv)
    if not max_kv_size or hasattr(model, "make_cache"):
        return make_prompt_cache(model)
    return [RotatingKVCache(max_size=max_kv_size, keep=0) for _ in model.layers]
