"""Warm-up: run every shape serving uses before the engine reports ready.

MLX's GPU backends build kernels, compiled graphs and matmul plans the first time they meet a shape or kind of pass
(the CUDA backend compiles kernels with NVRTC, and keeps them on disk for later processes). :func:`warm_up_shapes`
meets them beforehand, through the same functions serving calls (:mod:`mlxd.engine.step.prompts`,
:mod:`mlxd.engine.step.batch`), so what it warms is what serving runs. On an H100 with an empty kernel cache (Qwen3-8B
shape, bf16), the first 8-stream pass after ``/health`` turned 200 ran at 0.20x the aggregate tokens/s of the next
pass when warm-up covered only decode batches of powers of two and one prompt chunk; 1.04x with this warm-up
(``benchmarks/load.py``, "first pass after ready").

What :func:`warm_up_shapes` warms with every shape, in this order (each part's seconds logged as ``warm_up_part``).
The widths warmed, ``W``: with buckets (what serving pads batches to, :mod:`mlxd.engine.step.buckets`), their
widths, 1, 2, 4, 8, 16, 24, ... ``n = max_running``; without, every width 1..n.

- ``join``: prompt chunks, a full ``prefill_chunk``, then a partial last chunk continuing it (attention over cached
  positions, and the first token sampled); then decode batches at every width of ``W``, reached by rows joining
  (``add``: the lone row's cache merged at 2, ``extend`` beyond, then padded to the bucket; with buckets, the rows
  that take the batch to its next width join as one group when they are several), with ``warmup_tokens`` steps at
  each width;
- ``leave``: rows leaving so that the batch passes through every width of ``W`` (``filter``, then ``extract`` back
  to a lone row), and a row's cache taken out of the batch (``row_cache``), as the prefix cache does when a request
  ends;
- ``groups``: whole prompts processed together (:func:`process_prompts`), groups at every width of ``W`` above 1 and
  each length of :data:`GROUP_PROMPT_LENGTHS` (rows a token apart, so they are left-padded), joining an empty batch,
  and, at the shortest length and below n, a batch of one row (``extend``), with a decode step each (which grows the
  batched cache), then leaving;
- ``continuations``: the rests of prompts that start from cached states, processed together
  (:func:`process_continuations`), groups at every width of ``W`` above 1, each with one decode step.

With buckets, serving then meets no decode width and no group width that warm-up did not (groups at the lengths
warmed: multiples of 16 up to 64 on GPU backends). Not warmed: groups of longer prompts, a lone prompt's own length
and a last chunk's, samplers other than greedy (mlx-lm compiles them per temperature and filter value), logits
processors, speculative steps (:func:`warm_up_verify`) and vision rows.

The cost with buckets (:func:`count_passes` counts any case), for ``m = len(W)`` (at least 3), ``L`` group lengths
(4, fewer when ``prefill_chunk`` is below 64) and ``T = warmup_tokens``: ``L (m - 1) + 3m + 1`` prompt passes,
``L (m - 1) + 3m - 5`` of them groups, and ``T m + (L + 2)(m - 1) - 1`` decode steps; about ``176 * sum(W)`` prompt
tokens. At n = 128: m = 19, 130 prompt passes (124 groups), ``19 T + 107`` decode steps, about 190,000 prompt
tokens, where warming every width took ``9n - 11`` = 1,141 passes, ``n T + 16n - 24`` = 2,536 steps at T = 4 and
``160 n^2`` = 2.6 million prompt tokens. Every width at n = 16 measured 21-24 s on an H100 (Qwen3-8B shape, kernels
compiled by an earlier process; 51-52 s in the first), 202 s at 64 on an H200; the buckets of 128 (with two decode
steps after each group and rows joining one at a time) 69.9 s on an H200 with an empty kernel cache, 51.1 s with
kernels compiled.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxd.cache.quantized import kv_quantization
from mlxd.config.schema import EngineConfig
from mlxd.engine.base import SamplingParams
from mlxd.engine.step.batch import DecodeBatch
from mlxd.engine.step.buckets import Buckets
from mlxd.engine.step.padded import BUCKET, pad_verify
from mlxd.engine.step.prompts import (
    GROUP_BUCKET,
    can_batch_prompts,
    can_continue_together,
    process_continuations,
    process_prompt,
    process_prompts,
)
from mlxd.engine.step.row import Row, make_request_cache
from mlxd.engine.step.target import verify
from mlxd.log import get_logger
from mlxd.runtime import progress

log = get_logger("mlxd.engine")

# Whole prompts processed together in one left-padded pass: these lengths (of the longest row), capped at a chunk.
# On GPU backends groups are padded to multiples of GROUP_BUCKET (16) positions: these are the widths of groups of
# prompts up to 64 tokens, the bursts of short requests whose first token waits for them.
GROUP_PROMPT_LENGTHS = tuple(GROUP_BUCKET * i for i in (1, 2, 3, 4))
# The prompt of each row joining the decode batch on its own.
_SHORT_PROMPT = [1, 2, 3, 4]


def warm_up_shapes(model: Any, config: EngineConfig, every_shape: bool | None = None,
                   buckets: Buckets | None = None) -> None:
    """Run the shapes serving uses (the module's docstring lists them, in order, and what they cost), with greedy
    rows on the calling thread's stream, and leave nothing behind: MLX's buffer cache is cleared after each phase
    and each group width, since buffers of one width's shapes are not reused by the next (on an H100 with a
    Qwen3-8B shape the groups left 44 GB cached, and a server sharing the GPU with another ran out of memory in its
    warm-up).

    ``every_shape`` (default: on GPU backends, which build kernels per shape, and wherever ``buckets`` are given;
    not on the CPU otherwise, where nothing is built per shape and the full set costs minutes with a real model):
    warm everything. Otherwise a prompt chunk and decode batches of powers of two (and ``max_running``) only:
    enough to fail at start-up, not in a request."""
    batch = DecodeBatch(model, buckets=buckets)
    if every_shape is None:
        every_shape = mx.default_device() != mx.cpu or buckets is not None
    widths = warmed_widths(config.max_running, buckets)
    stepped = widths if every_shape else _powers(widths)
    num_steps = len(stepped) + 2 if every_shape else len(stepped)  # joining, then leaving, groups, continuations
    timed = _Timed()
    _join_up_to(model, config, batch, stepped, num_steps)
    timed.part("join")
    mx.clear_cache()
    if every_shape:
        _leave_group_continue(model, config, batch, widths, buckets, timed, num_steps)
    _release(batch)


def _leave_group_continue(model: Any, config: EngineConfig, batch: DecodeBatch, widths: tuple[int, ...],
                          buckets: Buckets | None, timed: _Timed, num_steps: int) -> None:
    """The parts after joining, with every shape: rows leave, groups join and leave, continuations (each timed;
    the start-up phase's steps ``len(widths) + 1`` and ``num_steps`` after the last two)."""
    _leave_through(batch, widths)
    timed.part("leave")
    _join_in_groups(model, config, batch, widths)
    timed.part("groups")
    progress.step(len(widths) + 1, num_steps)
    _continue_in_groups(model, config, widths, buckets)
    timed.part("continuations")
    progress.step(num_steps, num_steps)


def _release(batch: DecodeBatch) -> None:
    """Let the warm-up's buffers go, once nothing still runs on them."""
    mx.eval(batch.inputs)
    batch.clear()
    mx.clear_cache()


def warmed_widths(max_running: int, buckets: Buckets | None) -> tuple[int, ...]:
    """The batch widths warm-up meets: the buckets', else every width 1..``max_running``."""
    return buckets.widths if buckets is not None else tuple(range(1, max_running + 1))


def group_lengths(config: EngineConfig) -> list[int]:
    """The padded lengths prompt groups are warmed at (capped at a chunk)."""
    return sorted({min(n, config.prefill_chunk) for n in GROUP_PROMPT_LENGTHS})


def count_passes(config: EngineConfig, buckets: Buckets | None) -> tuple[int, int, int]:
    """``(prompt passes, of them groups, decode steps)`` that :func:`warm_up_shapes` runs with every shape (the
    formula of the module's docstring), for models whose caches can be grouped and continued together."""
    widths, lengths = warmed_widths(config.max_running, buckets), len(group_lengths(config))
    m = len(widths)
    gaps = [b - a for a, b in itertools.pairwise(widths)]
    joined_groups = sum(1 for gap in gaps if buckets is not None and gap > 1)
    joined_alone = sum(gap for gap in gaps if buckets is None or gap == 1)
    groups = lengths * (m - 1) + max(0, m - 2)
    continued = m - 1
    prompts = 2 + joined_alone + joined_groups + groups + (3 + continued if m > 1 else 0)
    return prompts, joined_groups + groups + continued, config.warmup_tokens * m + groups + continued


def _powers(widths: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(w for w in widths if w & (w - 1) == 0 or w == widths[-1])


def _join_up_to(model: Any, config: EngineConfig, batch: DecodeBatch, stepped: tuple[int, ...],
                num_phase_steps: int) -> None:
    """A chunked prompt starts the batch; rows then join up to ``max_running``, with decode steps at the sizes in
    ``stepped`` (each a step of the start-up phase's ``num_phase_steps``). With buckets, the rows that take the
    batch to its next size join as one group when they are several (a group pass of a width the groups below warm
    too); otherwise, and for a single row, one at a time (``add``: merged at 2, ``extend`` beyond). On an H200 the
    first step after a join cost as much more at a width met before as at a new one (the join's copy, not a kernel
    build), so joining at every width warms nothing more."""
    num_steps = max(1, config.warmup_tokens)
    chunk = config.prefill_chunk
    row = _row(model, config, 0)
    process_prompt(model, row, _tokens(chunk), last=False)
    batch.add(row, process_prompt(model, row, _tokens(max(1, chunk // 4)), last=True, start=chunk))
    _steps(batch, num_steps)
    progress.step(1, num_phase_steps)
    for index, size in enumerate(stepped[1:], start=2):
        rows = [_row(model, config, i) for i in range(len(batch), size)]
        if batch.buckets is not None and len(rows) > 1 and can_batch_prompts(rows):
            batch.add_batch(rows, *process_prompts(model, rows, [_SHORT_PROMPT] * len(rows), buckets=batch.buckets))
        else:
            for row in rows:
                batch.add(row, process_prompt(model, row, _SHORT_PROMPT, last=True))
        _steps(batch, num_steps)
        progress.step(index, num_phase_steps)


def _leave_through(batch: DecodeBatch, widths: tuple[int, ...]) -> None:
    """Rows leave so that the batch passes through every width of ``widths`` below its own, widest first (each
    time the last row's cache taken out first, as the prefix cache does when a request ends), down to one row
    (``extract`` back to a lone cache)."""
    for width in reversed([w for w in widths if w < len(batch)]):
        mx.eval([layer.state for layer in batch.row_cache(batch.request_ids[-1])])
        batch.remove(set(batch.request_ids[width:]))
        _evaluate(batch)


def _join_in_groups(model: Any, config: EngineConfig, batch: DecodeBatch, widths: tuple[int, ...]) -> None:
    """Groups of whole prompts at every width of ``widths`` above 1 join an empty batch and (at the shortest length,
    not for a full group) ``batch``, which holds one row; they decode one step there and leave. The first decode
    step after a group joins grows the batched cache, and MLX's CUDA backend builds that step's graphs once per
    batch size and width (they last while its graph cache holds them, which :mod:`mlxd.runtime.cuda` makes room
    for): on an H100 (Qwen3-8B shape) a group of 16 rows of 27 tokens joining an empty batch took 34-70 ms for that
    step when warm-up had not run it (six processes), 12-18 ms when it had (six), as much as the steps after it."""
    lengths = group_lengths(config)
    for size in widths[1:]:
        for length in lengths:
            hosts = [DecodeBatch(model, buckets=batch.buckets)]
            if length == lengths[0] and size < config.max_running:
                hosts.append(batch)
            if not all(_join_and_leave(model, config, host, size, length) for host in hosts):
                return
        mx.clear_cache()  # every width leaves buffers of shapes no later one reuses: 44 GB on an H100 (Qwen3-8B)


def _join_and_leave(model: Any, config: EngineConfig, host: DecodeBatch, size: int, length: int) -> bool:
    """A group of ``size`` prompts of about ``length`` tokens joins ``host``, decodes a step there and leaves;
    False when the model's caches cannot be grouped (then nothing ran)."""
    rows = [_row(model, config, f"group-{size}-{length}-{len(host)}-{i}") for i in range(size)]
    if not can_batch_prompts(rows):
        return False
    prompts = [_tokens(max(1, length - i % 2)) for i in range(size)]
    cache, first = process_prompts(model, rows, prompts, buckets=host.buckets)
    host.add_batch(rows, cache, first)
    _steps(host, 1)
    host.remove({row.request_id for row in rows})
    _evaluate(host)
    return True


def _continue_in_groups(model: Any, config: EngineConfig, widths: tuple[int, ...], buckets: Buckets | None) -> None:
    """Groups at every width of ``widths`` above 1, each row holding a cached prefix (of 4, 5 or 6 tokens: three
    lone passes, whose caches the rows share, since merging only reads them), run the rests of their prompts in one
    pass (:func:`process_continuations`: merged caches, right padding rolled left), join an empty batch for one
    decode step, then leave. On an H100 the first such pass after start-up took 10.9 s building its kernels when
    nothing had run it before."""
    if len(widths) < 2:
        return
    prefixes = []
    for i in range(3):
        row = _row(model, config, f"prefix-{i}")
        process_prompt(model, row, _tokens(4 + i), last=False)
        prefixes.append(row.cache)
    for size in widths[1:]:
        rows = [_row(model, config, f"continue-{size}-{i}") for i in range(size)]
        for i, row in enumerate(rows):
            row.cache = prefixes[i % 3]
        if not can_continue_together(rows):
            return
        host = DecodeBatch(model, buckets=buckets)
        host.add_batch(rows, *process_continuations(model, rows, [_tokens(1 + i % 2) for i in range(size)],
                                                    buckets=buckets))
        host.step()
        mx.eval(host.inputs)
        host.clear()
        mx.clear_cache()


class _Timed:
    """Logs how long each part of the warm-up took (``warm_up_part``), for whoever tunes it."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def part(self, name: str) -> None:
        now = time.perf_counter()
        log.info("warm_up_part", part=name, seconds=round(now - self.started, 2))
        self.started = now


def _row(model: Any, config: EngineConfig, tag: Any) -> Row:
    return Row.for_request(f"warm-up-{tag}", SamplingParams(), model, config.max_kv_size, kv=kv_quantization(config))


def _tokens(n: int) -> list[int]:
    return [1 + i % 8 for i in range(n)]


def _evaluate(batch: DecodeBatch) -> None:
    """Run what joining or leaving built (the batched cache's copies), without a decode step."""
    if len(batch):
        mx.eval(batch.inputs, [layer.state for layer in batch.cache])


def _steps(batch: DecodeBatch, num_steps: int) -> None:
    for _ in range(num_steps):
        batch.step()


# Verify passes are warmed over caches filling the first this many buckets of key positions (mlxd/engine/padded.py).
VERIFY_BUCKETS = 2


def warm_up_verify(model: Any, config: EngineConfig, force: bool = False) -> int:
    """Build the attention plans of speculative verify passes before serving (CUDA, where :mod:`.padded` pads
    them; ``force``: here too, for tests): every batch size 1..``max_running``, every block width 2..k + 1, over
    caches in each of the first :data:`VERIFY_BUCKETS` buckets. Caches of other kinds (rotating, recurrent,
    quantized) are left out. Returns the number of verify passes run.

    Unwarmed, a verify step meeting a new shape paid about 75 ms on an H100 (Qwen3-8B shape) where a decode step
    takes 12: the first verify steps of a request, exactly those that decide whether drafting pays, looked several
    times dearer than plain steps. One row's prompt fills each bucket (``BUCKET * VERIFY_BUCKETS`` tokens in all);
    batches of several rows are that row's cache copied (``merge``), one batch size at a time. The cost:
    ``max_running * k * VERIFY_BUCKETS`` verify passes, once per process.
    """
    base = make_request_cache(model, 0, kv_quantization(config))  # quantized layers build no plans: left out
    if not (pad_verify() or force) or not all(type(c) is KVCache for c in base):
        return 0
    k, passes = config.speculative.k, 0
    for index in range(VERIFY_BUCKETS):
        _fill(model, base, (index + 1) * BUCKET - k - 1)  # the bucket, less the widest block
        for size in range(1, config.max_running + 1):
            cache = base if size == 1 else [layer.merge([layer] * size) for layer in base]
            for width in range(2, k + 2):
                logits, _, transaction = verify(model, mx.array([_tokens(width)] * size, dtype=mx.uint32), cache)
                mx.eval(logits)
                transaction.abort()
                passes += 1
            del cache
        _fill(model, base, (index + 1) * BUCKET)
    mx.clear_cache()
    return passes


def _fill(model: Any, cache: list[Any], length: int) -> None:
    """Extend a lone row's cache to ``length`` positions."""
    missing = length - cache[0].offset
    if missing > 0:
        mx.eval(model(mx.array([_tokens(missing)], dtype=mx.uint32), cache=cache))
