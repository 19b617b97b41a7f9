"""MLX's CUDA backend: settings mlxd makes before a model runs.

**cuDNN attention is turned off.** MLX 0.32 sends attention over several query positions (prompt chunks, speculative
verify passes, vision towers) to cuDNN's SDPA, which builds an execution plan for each new shape and caches it.
Serving meets new shapes all the time: every prompt length, every group of prompts processed together, every chunk
of a long prompt (its keys grow). On an H200 (Qwen3-8B shape, bf16; results in
``docs/benchmarks/engine.md``) a one-row prompt pass of a length not seen before took 49-71 ms against 10-13 ms
for a length seen before; eight rows together, 59 ms to almost a second. With cuDNN attention off, MLX runs the same
attention through its own kernels: 13-42 ms and 20-82 ms for new lengths, the same as before for seen ones, and
decoding one row costs the same up to 4000 tokens of context. For the vision tower of Qwen2.5-VL (heads of 80,
attention over 64-token windows), cuDNN 9.14 also raises SIGFPE while MLX asks it for plans: a signal that ends the
process (the backtrace is in ``docs/benchmarks/vision.md``).

MLX reads ``MLX_CUDA_USE_CUDNN_SDPA`` once, at its first attention call.

**MLX's cache of CUDA graphs is made larger.** MLX records kernels into CUDA graphs and keeps the executable graph
of each topology it has launched, up to ``MLX_CUDA_GRAPH_CACHE_SIZE`` of them (400 by default), least recently used
first out. A topology met again is updated in place; one not in the cache is instantiated anew, which costs the
host far more, and a decode step of an 8B model is about forty graphs. Warm-up runs every
group of prompts joining the batch and its first decode steps, more topologies than 400 hold, so the groups warmed
first were evicted again before serving began: on an H100 (Qwen3-8B shape, bf16) the first step after 8 or 12
prompts joined, or 8 joined 4 rows decoding, took 18-56 ms against 9-18 ms for the steps after it. With room for
:data:`GRAPH_CACHE_SIZE` graphs it took 11-21 ms (``benchmarks/decode_lengths.py --warm-up``;
``docs/benchmarks/engine.md``), and the device's peak memory moved within its run-to-run spread.

MLX reads each setting once. An operator who sets one keeps their setting; either way, the start-up log says which.
"""

from __future__ import annotations

import os

from mlxd.log import get_logger

log = get_logger("mlxd.runtime")

CUDNN_ATTENTION = "MLX_CUDA_USE_CUDNN_SDPA"
GRAPH_CACHE = "MLX_CUDA_GRAPH_CACHE_SIZE"
GRAPH_CACHE_SIZE = 4000

_REASONS = {
    "text": "cuDNN builds an attention plan for every new prompt shape (40-60 ms more for one row on an H200)",
    "vision": "cuDNN builds an attention plan for every new prompt shape, and its plans end the process (SIGFPE) "
              "for Qwen2.5-VL vision towers on MLX 0.32",
}


def prepare_cuda(kind: str) -> None:
    """Before anything runs on CUDA, for a ``kind`` ("text" or "vision") model: turn cuDNN attention off and
    make the graph cache larger, each unless the operator chose."""
    import mlx.core as mx

    if not mx.cuda.is_available():
        return
    _choose("cudnn_attention", CUDNN_ATTENTION, "0", _REASONS[kind])
    _choose("cuda_graph_cache", GRAPH_CACHE, str(GRAPH_CACHE_SIZE),
            "warm-up's graphs outnumber MLX's default 400, and a graph evicted costs a new instantiation later")


def _choose(event: str, name: str, value: str, reason: str) -> None:
    if name in os.environ:
        log.info(event, setting=os.environ[name], source="environment")
        return
    os.environ[name] = value
    log.info(event, setting=value, source="mlxd", reason=reason)


def cudnn_attention() -> bool:
    """Whether MLX runs attention over several positions through cuDNN (CUDA, and not turned off)."""
    import mlx.core as mx

    return mx.cuda.is_available() and os.environ.get(CUDNN_ATTENTION, "1") != "0"
