"""MLX's CUDA backend: settings mlxd makes before a model runs.

cuDNN attention is turned off. MLX 0.32 sends attention over several query positions (prompt chunks, speculative
verify passes, vision towers) to cuDNN's SDPA, which builds an execution plan for each new shape and caches it.
Serving meets new shapes all the time: every prompt length, every group of prompts processed together, every chunk
of a long prompt (its keys grow). On an H200 (Qwen3-8B shape, bf16; ``benchmarks/attention_plans.py``, results in
``docs/benchmarks/engine.md``) a one-row prompt pass of a length not seen before took 49-71 ms against 10-13 ms
for a length seen before; eight rows together, 59 ms to almost a second. With cuDNN attention off, MLX runs the same
attention through its own kernels: 13-42 ms and 20-82 ms for new lengths, the same as before for seen ones, and
decoding one row costs the same up to 4000 tokens of context. For the vision tower of Qwen2.5-VL (heads of 80,
attention over 64-token windows), cuDNN 9.14 also raises SIGFPE while MLX asks it for plans: a signal that ends the
process (the backtrace is in ``docs/benchmarks/vision.md``).

MLX reads ``MLX_CUDA_USE_CUDNN_SDPA`` once, at its first attention call. An operator who sets it keeps their
setting; either way, the start-up log says which.
"""

from __future__ import annotations

import os

from mlxd.log import get_logger

log = get_logger("mlxd.runtime")

CUDNN_ATTENTION = "MLX_CUDA_USE_CUDNN_SDPA"

_REASONS = {
    "text": "cuDNN builds an attention plan for every new prompt shape (40-60 ms more for one row on an H200)",
    "vision": "cuDNN builds an attention plan for every new prompt shape, and its plans end the process (SIGFPE) "
              "for Qwen2.5-VL vision towers on MLX 0.32",
}


def prepare_attention(kind: str) -> None:
    """Turn cuDNN attention off on CUDA (before anything runs) for a ``kind`` ("text" or "vision") model, unless
    the operator chose."""
    import mlx.core as mx

    if not mx.cuda.is_available():
        return
    if CUDNN_ATTENTION in os.environ:
        log.info("cudnn_attention", setting=os.environ[CUDNN_ATTENTION], source="environment")
        return
    os.environ[CUDNN_ATTENTION] = "0"
    log.info("cudnn_attention", setting="0", source="mlxd", reason=_REASONS[kind])


def cudnn_attention() -> bool:
    """Whether MLX runs attention over several positions through cuDNN (CUDA, and not turned off)."""
    import mlx.core as mx

    return mx.cuda.is_available() and os.environ.get(CUDNN_ATTENTION, "1") != "0"
