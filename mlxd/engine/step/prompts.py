"""The MLX side of prompt processing: a request's prompt goes into a cache of its own, then joins the decode batch.

Each request processes its prompt in chunks into a cache of its own (``make_prompt_cache``, what ``generate_step``
uses): :func:`process_prompt`. Short prompts that arrive together go through one left-padded forward pass instead
(:func:`process_prompts`); the rests of prompts that start from cached prefixes, and image prompts planned in the
same step, through one right-padded pass (:func:`right_padded_pass`). Each returns the first generated token of
its rows, sampled lazily, for :class:`mlxd.engine.step.batch.DecodeBatch` to take on.

Rows carry their own cache offsets (positions), so rows that need their own positions or input embeddings (vision
prompts) fit the same decode step: only their prompt processing differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlxd.cache.quantized import QuantizedLayer
from mlxd.engine.step.batchcache import gather_rows
from mlxd.engine.step.buckets import Buckets
from mlxd.engine.step.logprobs import capture_logprobs
from mlxd.engine.step.row import Row
from mlxd.engine.step.target import forward


def same(tokens: mx.array) -> mx.array:
    """Sampled tokens as they are (one process); a distributed group replaces them with rank 0's."""
    return tokens


def process_prompt(model: Any, row: Row, tokens: list[int], *, last: bool, start: int = 0,
                   share: Callable[[mx.array], mx.array] = same) -> mx.array | None:
    """Run one prompt chunk, which starts at prompt position ``start``, through the model into the row's cache.

    For the last chunk, sample the first generated token and return it (a lazy ``(1,)`` array, passed through
    ``share``); otherwise evaluate the cache and return ``None``.
    """
    inputs = mx.array(tokens, dtype=mx.uint32)
    logits, hidden = forward(model, inputs[None], row.cache, hidden=row.wants_hidden,
                             **row.prompt_inputs(start, start + len(tokens)))
    if hidden is not None:
        row.keep_hidden(hidden[0])
    if not last:
        if row.processors:
            row.history = inputs if row.history is None else mx.concatenate([row.history, inputs])
        mx.eval([c.state for c in row.cache])
        return None
    raw = logits[:, -1, :]
    logits = row.process(inputs, raw)
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    first = share(row.sampler(logprobs))
    capture_logprobs([row], raw, first)
    mx.async_eval(first)
    return first


# Cache types whose batched form can be left-padded before a first forward pass.
_LEFT_PADDABLE = (KVCache, RotatingKVCache, ArraysCache, QuantizedLayer)

# Whole prompts processed together are left-padded to a multiple of this many positions on GPU backends. MLX's CUDA
# backend builds work for each new shape of a pass: on an H200 (Qwen3-8B shape) 16 prompts of 27 tokens took 73 ms
# the first time and 30 ms after; each new (rows, length) pair paid 5-43 ms more once. Rounded lengths repeat,
# and warm-up meets the first ones (:mod:`mlxd.engine.step.warmup`). On the CPU nothing is built per shape, and padding
# would only add work.
GROUP_BUCKET = 16


def group_bucket() -> int:
    """The multiple a group's padded length is rounded up to on this device (1: the longest prompt's length)."""
    return 1 if mx.default_device() == mx.cpu else GROUP_BUCKET


def group_width(rows: list[Row], longest: int, buckets: Buckets | None = None) -> int:
    """The padded length of a group whose longest prompt has ``longest`` tokens: rounded up to
    :func:`group_bucket`, or to :data:`GROUP_BUCKET` wherever batches are bucketed (``buckets`` given). Sliding-window
    caches keep their exact length: padding takes positions of their window."""
    multiple = GROUP_BUCKET if buckets is not None else group_bucket()
    bucket = 1 if any(isinstance(c, RotatingKVCache) for c in rows[0].cache) else multiple
    return -(-longest // bucket) * bucket


def can_batch_prompts(rows: list[Row]) -> bool:
    """Whether these rows' (empty) caches can be merged into one left-padded batch for :func:`process_prompts`."""
    return len(rows) > 1 and all(row.vision is None and isinstance(c, _LEFT_PADDABLE) and c.empty()
                                 for row in rows for c in row.cache)


def process_prompts(model: Any, rows: list[Row], prompts: list[list[int]],
                    share: Callable[[mx.array], mx.array] = same,
                    buckets: Buckets | None = None) -> tuple[list[Any], mx.array]:
    """Run several whole prompts (rows with empty caches) through the model in one left-padded forward pass, of
    :func:`group_width` positions, and of ``buckets.width(len(rows))`` rows when ``buckets`` is given (the first
    prompt repeated in the filler rows, which are dropped after the pass).

    Returns the batched cache (rows in order) and the first generated token of each row, sampled lazily.
    """
    filler = _filler(buckets, len(rows))
    padded_prompts = prompts + [prompts[0]] * filler
    width = group_width(rows, max(len(p) for p in prompts), buckets)
    padding = [width - len(p) for p in padded_prompts]
    inputs = mx.array([[0] * pad + p for p, pad in zip(padded_prompts, padding, strict=True)], dtype=mx.uint32)
    caches = [row.cache for row in rows] + [rows[0].cache] * filler
    cache = [layer.merge([c[i] for c in caches]) for i, layer in enumerate(rows[0].cache)]
    for layer in cache:
        if isinstance(layer, ArraysCache):
            layer.left_padding = mx.array(padding)
        else:
            layer.prepare(left_padding=padding)
    logits, hidden = forward(model, inputs, cache, hidden=any(row.wants_hidden for row in rows))
    logits = raw = logits[: len(rows), -1, :]
    _drop_filler(cache, len(rows), filler)
    for i, row in enumerate(rows):
        if row.wants_hidden:
            row.keep_hidden(hidden[i, padding[i] :])
    if any(row.processors for row in rows):
        logits = mx.concatenate([row.process(mx.array(p, dtype=mx.uint32), logits[i : i + 1])
                                 for i, (row, p) in enumerate(zip(rows, prompts, strict=True))])
    return cache, first_tokens(rows, raw, logits, share)


def _filler(buckets: Buckets | None, num_rows: int) -> int:
    return buckets.width(num_rows) - num_rows if buckets is not None else 0


def _drop_filler(cache: list[Any], num_rows: int, filler: int) -> None:
    if filler:  # mlx-lm's filter, with the attention layers' left padding read once, not once a layer
        gather_rows(cache, mx.arange(num_rows), trim=True)


def first_tokens(rows: list[Row], raw: mx.array, logits: mx.array, share: Callable[[mx.array], mx.array]) -> mx.array:
    """Each row's first generated token, sampled lazily from ``logits`` (the rows' processors applied to ``raw``,
    one row of logits each), with its log-probabilities captured from ``raw``. The rows' own caches are dropped:
    the batched cache now holds them."""
    first = share(sample(rows, logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
    capture_logprobs(rows, raw, first)
    mx.async_eval(first)
    for row in rows:
        row.cache = []
    return first


def can_continue_together(rows: list[Row]) -> bool:
    """Whether these rows, each holding a cached prefix of its prompt (attention layers only), can run the rest of
    their prompts in one pass (:func:`process_continuations`)."""
    return len(rows) > 1 and all(row.vision is None and not row.processors and not row.wants_hidden
                                 and all(type(c) in (KVCache, QuantizedLayer) and not c.empty() for c in row.cache)
                                 for row in rows)


def process_continuations(model: Any, rows: list[Row], suffixes: list[list[int]],
                          share: Callable[[mx.array], mx.array] = same,
                          buckets: Buckets | None = None) -> tuple[list[Any], mx.array]:
    """Run the rest of several prompts in one forward pass, each row's cache already holding the prompt's start
    (a prefix-cache hit; lengths may differ): :func:`right_padded_pass`, of :func:`group_width` positions and, with
    ``buckets``, of bucketed rows (as :func:`process_prompts`)."""
    return right_padded_pass(model, rows, suffixes, share, buckets=buckets,
                             width=group_width(rows, max(len(s) for s in suffixes), buckets))


# The per-prompt inputs a vision row's prompt may carry and still share a pass (Qwen-VL positions, deepstack).
_PADDABLE_EXTRAS = frozenset({"position_ids", "visual_pos_masks", "deepstack_visual_embeds"})


def can_batch_vision_prompts(rows: list[Row]) -> bool:
    """Whether these vision rows (fresh attention caches, whole prompts) can share one pass
    (:func:`process_vision_prompts`)."""
    if len(rows) < 2 or any(row.vision is None for row in rows):
        return False
    keys = rows[0].vision.extras.keys()
    return keys <= _PADDABLE_EXTRAS and all(
        row.vision.extras.keys() == keys and not row.processors and not row.wants_hidden
        and all(type(c) is KVCache and c.empty() for c in row.cache) for row in rows)


def process_vision_prompts(model: Any, rows: list[Row], prompts: list[list[int]],
                           share: Callable[[mx.array], mx.array] = same) -> tuple[list[Any], mx.array]:
    """Run several whole image prompts in one forward pass: their merged embeddings and position inputs
    right-padded to the longest (:func:`right_padded_pass`). Each row keeps its own multimodal positions."""
    right = _right_padding(prompts)
    embeds = mx.concatenate([mx.pad(row.vision.embeds, [(0, 0), (0, pad), (0, 0)])
                             for row, pad in zip(rows, right, strict=True)])
    extras = _padded_extras([row.vision.extras for row in rows], right)
    return right_padded_pass(model, rows, prompts, share, embeds=embeds, **extras)


def _padded_extras(extras: list[dict[str, Any]], right: list[int]) -> dict[str, Any]:
    """One batch's position inputs from each row's (1-row) ones, right-padded (padding positions are never
    attended to); the deepstack features, compact per row, joined row after row."""
    def padded(name: str, axis: int) -> mx.array:
        parts = []
        for e, pad in zip(extras, right, strict=True):
            widths = [(0, 0)] * e[name].ndim
            widths[-1] = (0, pad)
            parts.append(mx.pad(e[name], widths))
        return mx.concatenate(parts, axis=axis)

    out: dict[str, Any] = {}
    if "position_ids" in extras[0]:
        out["position_ids"] = padded("position_ids", 1)  # (3, B, L)
    if "visual_pos_masks" in extras[0]:
        out["visual_pos_masks"] = padded("visual_pos_masks", 0)  # (B, L)
    if "deepstack_visual_embeds" in extras[0]:
        layers = zip(*(e["deepstack_visual_embeds"] for e in extras), strict=True)
        out["deepstack_visual_embeds"] = [mx.concatenate(layer) for layer in layers]
    return out


def _right_padding(prompts: list[list[int]], width: int = 0) -> list[int]:
    longest = max(width, *(len(p) for p in prompts))
    return [longest - len(p) for p in prompts]


def right_padded_pass(model: Any, rows: list[Row], prompts: list[list[int]],
                      share: Callable[[mx.array], mx.array] = same, *, buckets: Buckets | None = None,
                      width: int = 0, **inputs: Any) -> tuple[list[Any], mx.array]:
    """Run ``prompts`` (each the next tokens of its row: a whole prompt into an empty cache, or the rest after a
    cached start) in one forward pass, with the model ``inputs`` given (already right-padded), of at least
    ``width`` positions; with ``buckets`` (text only: no ``inputs``), of bucketed rows, the first row's cache and
    prompt repeated in the filler rows, which are dropped after the pass.

    The rows' caches are merged left-padded (cached lengths may differ); the prompts go in right-padded, and mlx-lm's
    ``BatchKVCache`` then rolls each row's right padding to its left (``prepare(right_padding=...)``,
    ``finalize``), so that the batch joins the decode step left-padded like any other. Causal attention keeps a
    row's real positions from seeing its right padding. Returns the batched cache and each row's first generated
    token, sampled lazily from the logits at its last real position.
    """
    filler = _filler(buckets, len(rows))
    padded_prompts = prompts + [prompts[0]] * filler
    right = _right_padding(padded_prompts, width)
    tokens = mx.array([p + [0] * pad for p, pad in zip(padded_prompts, right, strict=True)], dtype=mx.uint32)
    caches = [row.cache for row in rows] + [rows[0].cache] * filler
    cache = [layer.merge([c[i] for c in caches]) for i, layer in enumerate(rows[0].cache)]
    for layer in cache:
        layer.prepare(right_padding=right)
    logits, _ = forward(model, tokens, cache, **inputs)
    raw = logits[mx.arange(len(rows)), mx.array([len(p) - 1 for p in prompts])]
    for layer in cache:
        layer.finalize()
    _drop_filler(cache, len(rows), filler)
    return cache, first_tokens(rows, raw, raw, share)


def sample(rows: list[Row], logprobs: mx.array) -> mx.array:
    """One token per row: one sampler call when the rows sample alike, else one per row."""
    first = rows[0]
    if all(row.sampler_key == first.sampler_key for row in rows):
        return first.sampler(logprobs)
    return mx.concatenate([row.sampler(logprobs[i : i + 1]) for i, row in enumerate(rows)])
