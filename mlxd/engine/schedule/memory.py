"""Memory admission, the MLX side: what a request's cache costs, what the weights take, and the limit.

Measured once, on the engine thread at warm-up, through mlx-lm's cache protocol only (``nbytes``, and a rotating
layer's ``max_size``), so any architecture is counted the same way: two fresh request caches are fed ``step`` and
``2 * step`` tokens in one pass each, and each layer's ``nbytes`` says what it holds. A layer that grows between the
two (attention KV) costs bytes per token; one that does not (a recurrent ``ArraysCache``) costs fixed bytes; a
rotating layer grows until its window is full. Only graph shapes are read: nothing is evaluated there. What a prompt
pass holds besides (activations, and logits for every position: 300 KB a token at a vocabulary of 152k in bf16) is
measured once on GPU backends, by evaluating a pass of :data:`PASS_PROBE_TOKENS` tokens and reading MLX's peak
memory (estimated from the logits' shape on the CPU); it bounds how many prompt tokens one pass of a burst may take
(:func:`max_pass_tokens`). With ``[engine] kv_bits`` the caches measured are the quantized ones
(:mod:`mlxd.cache.quantized`), so a token costs what its packed features, scales and biases take (8 bits in groups of
64 features: 0.53 of bfloat16's bytes, 0.28 of float32's; 4 bits: 0.28 and 0.16).

What a request reserves is what its cache can grow to, prompt + ``max_tokens``, rounded up to the 256-token step in
which ``KVCache`` allocates. In the decode batch every row is left-padded to the longest row (``BatchKVCache``, or its quantized form), so
the scheduler counts ``rows x the largest reservation`` rather than the sum (see ``mlxd.engine.schedule.scheduler``).
Not counted: transient copies while a row joins or leaves the batch, activations, sampler buffers, and snapshots
the prefix cache takes during a step (it is shrunk back at the start of the next one). Leave headroom for them in
``memory_limit_bytes``; the CPU default keeps a quarter of RAM free.

:class:`MemoryBudget` and :class:`KVCost` are plain numbers, safe to use from the event loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from mlxd.cache.quantized import KVQuantization, check_quantized_attention
from mlxd.engine.step.row import make_request_cache
from mlxd.errors import ConfigError, RequestError

# Without a device that reports a working set: this share of physical RAM (the OS, the Python heap and MLX's
# transient buffers need the rest).
CPU_RAM_SHARE = 0.75
# A GPU that reports only its total memory (CUDA): leave some for the driver and other processes.
GPU_MEMORY_SHARE = 0.9
# MLX keeps freed buffers for reuse up to its cache limit, by default its whole memory limit: buffers of shapes that
# never come back (prompt groups, batch sizes) can hold tens of GB that the process does not use and that other
# processes on the device cannot have. The engine caps the cache at this share of what the weights leave.
CACHE_SHARE = 0.25
MIN_CACHE_BYTES = 256 * 1024**2


@dataclass(frozen=True, slots=True)
class KVCost:
    """What one request's cache costs, for any number of tokens: fixed bytes plus bytes per (allocated) token.

    ``windows`` holds ``(window, bytes per token)`` for rotating layers: they stop growing once the window is full
    (plus one prompt chunk, which a chunk's forward pass keeps beside the window).
    """

    num_fixed_bytes: int
    num_bytes_per_token: int
    windows: tuple[tuple[int, int], ...] = ()
    step: int = KVCache.step

    @property
    def num_bytes_per_token_total(self) -> int:
        """Bytes each new token adds while no window is full."""
        return self.num_bytes_per_token + sum(per_token for _, per_token in self.windows)

    def num_bytes(self, num_tokens: int, chunk: int = 0) -> int:
        """Bytes a cache holding ``num_tokens`` tokens has allocated, processed in chunks of ``chunk`` tokens."""
        allocated = -(-num_tokens // self.step) * self.step
        total = self.num_fixed_bytes + self.num_bytes_per_token * allocated
        for window, per_token in self.windows:
            total += per_token * min(allocated, window + chunk)
        return total


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """The memory limit, the weights' share of it, and what a request's cache costs."""

    limit_bytes: int
    weights_bytes: int
    kv: KVCost
    # Bytes a prompt pass holds per token while it runs (0: not measured).
    pass_bytes_per_token: int = 0

    @property
    def kv_budget_bytes(self) -> int:
        """Bytes left for request caches and the prefix cache together: the limit less the weights."""
        return self.limit_bytes - self.weights_bytes

    @property
    def cache_limit_bytes(self) -> int:
        """What MLX's buffer cache may keep of freed buffers (``mx.set_cache_limit``, :data:`CACHE_SHARE`)."""
        return max(MIN_CACHE_BYTES, int(self.kv_budget_bytes * CACHE_SHARE))


def measure_memory(model: Any, *, limit_bytes: int = 0, max_kv_size: int = 0,
                   kv: KVQuantization | None = None) -> MemoryBudget:
    """Measure the weights and a request's cache cost (its attention layers quantized with ``kv``: the bytes
    per token are those of the configured bits, scales and biases included); ``limit_bytes`` 0 takes
    :func:`default_limit_bytes`.

    Raises :class:`ConfigError` when the weights alone do not fit the limit: no request could ever be served; and
    when the model cannot run on quantized caches (:func:`~mlxd.cache.quantized.check_quantized_attention`).
    """
    if kv is not None:
        check_quantized_attention(model, lambda: make_request_cache(model, max_kv_size, kv), kv)
    limit = limit_bytes or default_limit_bytes()
    budget = MemoryBudget(limit, weights_bytes(model), measure_kv_cost(model, max_kv_size, kv),
                          measure_pass_bytes(model, max_kv_size, kv=kv))
    if budget.kv_budget_bytes <= 0:
        origin = "[engine] memory_limit_bytes" if limit_bytes else "the default memory limit"
        raise ConfigError(
            f"{origin} ({format_bytes(limit)}) leaves no room beside the model's weights "
            f"({format_bytes(budget.weights_bytes)}); set [engine] memory_limit_bytes above the weights"
        )
    return budget


def weights_bytes(model: Any) -> int:
    """Bytes of every parameter array of ``model`` (quantized weights with their scales and biases)."""
    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))


def measure_kv_cost(model: Any, max_kv_size: int = 0, kv: KVQuantization | None = None) -> KVCost:
    """Feed ``step`` and ``2 * step`` tokens into fresh request caches and read what each layer holds."""
    step = KVCache.step
    short, long = _layer_bytes(model, step, max_kv_size, kv), _layer_bytes(model, 2 * step, max_kv_size, kv)
    fixed = per_token = 0
    windows: dict[int, int] = {}
    for (n_short, window), (n_long, _) in zip(short, long, strict=True):
        grown = -(-(n_long - n_short) // step)  # bytes per token, rounded up
        fixed += max(0, n_short - grown * step)
        if grown and window:
            windows[window] = windows.get(window, 0) + grown
        else:
            per_token += grown
    return KVCost(fixed, per_token, tuple(sorted(windows.items())), step)


# The prompt pass measured for its transient memory: long enough that per-token arrays dominate what does not grow.
PASS_PROBE_TOKENS = 128


# Where a probe pass would cost seconds (the CPU, an 8B model: about 2 TFLOP for 128 tokens), the bytes a pass holds
# per token are estimated from its logits alone: this many times one position's logits (the tiny test models,
# measured: 2.7).
PASS_ESTIMATE_FACTOR = 3


def measure_pass_bytes(model: Any, max_kv_size: int = 0, evaluate: bool | None = None,
                       kv: KVQuantization | None = None) -> int:
    """Bytes per token one prompt pass holds at its peak (activations, every position's logits, the KV it writes),
    from evaluating a pass of :data:`PASS_PROBE_TOKENS` tokens into a fresh request cache; or, where ``evaluate`` is
    off (default: on the CPU), :data:`PASS_ESTIMATE_FACTOR` times one position's logits, read from the graph's
    shape without evaluating it."""
    if not (mx.default_device() != mx.cpu if evaluate is None else evaluate):
        logits = model(mx.zeros((1, 1), dtype=mx.uint32), cache=make_request_cache(model, max_kv_size, kv))
        return PASS_ESTIMATE_FACTOR * logits.shape[-1] * logits.dtype.size
    mx.eval(model.parameters())
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = make_request_cache(model, max_kv_size, kv)
    logits = model(mx.zeros((1, PASS_PROBE_TOKENS), dtype=mx.uint32), cache=cache)
    mx.eval(logits[:, -1, :])
    num_bytes = max(0, mx.get_peak_memory() - before)
    del logits, cache
    return -(-num_bytes // PASS_PROBE_TOKENS)


# A pass of whole prompts arriving together (a burst) holds at most MAX_PASS_TOKENS tokens, and at most what the room
# beside the weights holds at the measured bytes a token; each step the scheduler also keeps the pass and every
# reservation within the room together (Scheduler._pass_fits). Beyond the limit the device keeps GPU_MEMORY_SHARE's
# remainder (CUDA) or a quarter of RAM (CPU).
MAX_PASS_TOKENS = 32768


def max_pass_tokens(budget: MemoryBudget, step_token_budget: int, wide: bool | None = None) -> int:
    """The prompt tokens one pass of whole prompts may hold at most: the room beside the weights over the measured
    bytes per token, in ``[step_token_budget, MAX_PASS_TOKENS]``. On an H200 beside a bf16 8B model with a 48 GiB
    share (37.6 GB of room, 1.23-1.45 MB a token measured), that is 26,000-30,000: a burst of 64 prompts of 260
    tokens (16,640) in one pass, which the scheduler starts when its reservations leave the room (3.7 GB for those
    64 rows).

    Only where wide passes pay (``wide``, default: GPU backends, where a pass of 16k tokens costs little more than
    one of 512 per token and far less in all than 32 of them). On the CPU a pass costs its tokens' compute whatever
    its width, so one wide pass only holds back the first tokens of the prompts that a narrow one would have
    finished first: with the tiny benchmark model at 64 streams, time to first token p50 rose from 0.7 to 2.7 s.
    There the step token budget stands."""
    if not (mx.default_device() != mx.cpu if wide is None else wide) or not budget.pass_bytes_per_token:
        return step_token_budget
    tokens = budget.kv_budget_bytes // budget.pass_bytes_per_token
    return max(step_token_budget, min(MAX_PASS_TOKENS, tokens))


def _layer_bytes(model: Any, num_tokens: int, max_kv_size: int,
                 kv: KVQuantization | None) -> list[tuple[int, int | None]]:
    """Each layer's ``(nbytes, window)`` after one forward pass of ``num_tokens`` tokens (shapes only)."""
    cache = make_request_cache(model, max_kv_size, kv)
    model(mx.zeros((1, num_tokens), dtype=mx.uint32), cache=cache)
    return [(layer.nbytes, _window(layer)) for layer in cache]


def _window(layer: Any) -> int | None:
    # A rotating layer (mlx-lm's RotatingKVCache) keeps at most ``max_size`` tokens once its window is full.
    size = getattr(layer, "max_size", None)
    return size if isinstance(size, int) and size > 0 else None


def default_limit_bytes() -> int:
    """The GPU's recommended working set (Metal), else a share of its total memory (CUDA); on the CPU a share of
    physical RAM."""
    device = mx.default_device()
    if device.type == mx.DeviceType.gpu:
        info = mx.device_info(device)
        if info.get("max_recommended_working_set_size"):
            return int(info["max_recommended_working_set_size"])
        total = info.get("total_memory") or info.get("memory_size")
        if total:
            return int(int(total) * GPU_MEMORY_SHARE)
    return int(physical_ram_bytes() * CPU_RAM_SHARE)


def physical_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def format_bytes(num_bytes: int) -> str:
    """``123456789 bytes (117.74 MiB)``: exact for the reader who compares, readable for the one who does not."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(num_bytes) >= size:
            return f"{num_bytes} bytes ({num_bytes / size:.2f} {unit})"
    return f"{num_bytes} bytes"


def require_fits(budget: MemoryBudget, num_prompt_tokens: int, max_tokens: int, chunk: int) -> int:
    """The bytes a request reserves: its cache grown to prompt + ``max_tokens`` tokens.

    Raises :class:`RequestError` (a 400, ``param="max_tokens"``) when that alone exceeds what the limit leaves
    beside the weights: such a request could never be admitted, however long it waited.
    """
    num_bytes = budget.kv.num_bytes(num_prompt_tokens + max_tokens, chunk)
    if num_bytes > budget.kv_budget_bytes:
        raise RequestError(
            f"the memory limit of {format_bytes(budget.limit_bytes)} leaves {format_bytes(budget.kv_budget_bytes)} "
            f"beside the model weights, and this request needs {format_bytes(num_bytes)} of KV cache "
            f"({num_prompt_tokens} prompt tokens + max_tokens={max_tokens}); lower max_tokens, shorten the prompt, "
            "or raise [engine] memory_limit_bytes",
            param="max_tokens",
        )
    return num_bytes


# A default max_running ([engine] max_running = 0) is the number of rows whose caches, each at this many tokens, fit
# the budget beside the weights and the prefix cache. Not the model's context length: rows of 32-128k tokens each
# would allow one to three rows on most devices, where a shared server mostly sees chat turns of a few thousand
# tokens; and admission still holds every request to what memory allows (rows x the largest reservation, at most
# the budget), so this only caps how many may run when they fit.
TYPICAL_CONTEXT_TOKENS = 4096
# The derived value is rounded down to a power of two and kept at most this: a shared server's load is 32-64
# streams. Set [engine] max_running for more.
MAX_DERIVED_RUNNING = 64
# On GPU backends the same 64. It was 16 while warm-up met every batch width up to max_running (202 s at 64 rows on
# an H200 with Qwen3-8B); decode steps and prompt groups now run at bucketed widths (mlxd.engine.step.buckets), and
# warm-up visits those only: 12 widths at 64 rows (1, 2, 4, 8, 16, 24, ... 64), 74 prompt passes and 103 decode
# steps, where every width took 565 and 1,256. An H100 (80 GB, 0.9 of it the limit) beside a bf16 8B model holds
# about 88 rows of 4,096 tokens, an H200 about 190: both get 64. With [engine] batch_buckets = "off" warm-up meets
# every width again: set [engine] max_running there.
MAX_DERIVED_RUNNING_GPU = 64


@dataclass(frozen=True, slots=True)
class RunningLimit:
    """How many requests may decode together, and where the number came from (``config`` or ``derived``)."""

    max_running: int
    source: str
    context_tokens: int = 0
    row_bytes: int = 0
    room_bytes: int = 0


def derive_max_running(budget: MemoryBudget, *, prefix_cache_bytes: int, max_kv_size: int = 0,
                       cap: int = MAX_DERIVED_RUNNING) -> RunningLimit:
    """The default ``max_running``: rows of :data:`TYPICAL_CONTEXT_TOKENS` tokens (``max_kv_size`` when a rotating
    cache keeps fewer) that fit what the limit leaves beside the weights and the prefix cache, rounded down to a
    power of two in ``[1, cap]`` (:data:`MAX_DERIVED_RUNNING`, or :data:`MAX_DERIVED_RUNNING_GPU` on GPUs).

    The prefix cache counts for at most half of what the weights leave: it gives way to running requests, so
    counting all of a large one (the 2 GiB default beside an 8B model on a 24 GB CPU host) would leave one row where
    the memory holds more."""
    context = min(TYPICAL_CONTEXT_TOKENS, max_kv_size) if max_kv_size else TYPICAL_CONTEXT_TOKENS
    row_bytes = max(1, budget.kv.num_bytes(context))
    room = budget.kv_budget_bytes - min(prefix_cache_bytes, budget.kv_budget_bytes // 2)
    rows = min(cap, max(1, room // row_bytes))
    return RunningLimit(1 << (rows.bit_length() - 1), "derived", context, row_bytes, room)


def memory_status(budget: MemoryBudget, reserved_bytes: int, prefix_cache_bytes: int) -> dict[str, Any]:
    """The ``memory`` fields of ``GET /v1/status`` that admission adds."""
    return {
        "limit_bytes": budget.limit_bytes,
        "weights_bytes": budget.weights_bytes,
        "kv_reserved_bytes": reserved_bytes,
        "kv_bytes_per_token": budget.kv.num_bytes_per_token_total,
        "kv_fixed_bytes": budget.kv.num_fixed_bytes,
        "prefix_cache_bytes": prefix_cache_bytes,
    }

