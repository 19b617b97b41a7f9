"""MLX's CUDA backend: settings mlxd makes before a model runs.

Vision towers on cuDNN attention: MLX 0.32 sends prompt-length attention to cuDNN's SDPA. For the vision tower of
Qwen2.5-VL (heads of 80, attention over 64-token windows split out of one sequence), cuDNN 9.14 raises SIGFPE while
MLX asks it for execution plans: a signal that ends the process, not an exception a request could fail with (the
backtrace is in docs/benchmarks/vision.md). MLX reads ``MLX_CUDA_USE_CUDNN_SDPA`` once, at its first attention call;
with it at 0 the same attention runs through MLX's own kernels. So a vision model on CUDA is served with cuDNN
attention off, unless the operator set the variable (either way, the start-up log says which).
"""

from __future__ import annotations

import os

from mlxd.log import get_logger

log = get_logger("mlxd.runtime")

CUDNN_ATTENTION = "MLX_CUDA_USE_CUDNN_SDPA"


def prepare_for_vision() -> None:
    """Turn cuDNN attention off for a vision model on CUDA (before anything runs), unless the operator chose."""
    import mlx.core as mx

    if not mx.cuda.is_available():
        return
    if CUDNN_ATTENTION in os.environ:
        log.info("cudnn_attention", setting=os.environ[CUDNN_ATTENTION], source="environment")
        return
    os.environ[CUDNN_ATTENTION] = "0"
    log.info("cudnn_attention", setting="0", source="mlxd",
             reason="cuDNN attention plans end the process (SIGFPE) for Qwen2.5-VL vision towers on MLX 0.32")
