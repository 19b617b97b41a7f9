"""Linear layers that multiply 2 to 16 rows through mlxd's own kernel (:mod:`mlxd.runtime.small_batch`) on CUDA.

:func:`use_small_batch_kernel` replaces each plain ``nn.Linear`` of a loaded model whose weight the kernel takes by a
:class:`SmallBatchLinear` holding the same arrays: no copy, the same parameter names, still an ``nn.Linear``. The
model classes of mlx-lm and mlx-vlm are untouched; their modules call the layer as before. One row (a lone stream)
and more than 16 rows (prompt chunks) stay on MLX's matmul, whose one-row kernel is already bound by the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from mlxd.runtime.small_batch import MAX_ROWS, Launch, fits, plan, run

Matmul = Callable[[Launch, mx.array, mx.array, Any], mx.array]


class SmallBatchLinear(nn.Linear):
    """``linear``'s weight and bias, with products of 2 to ``MAX_ROWS`` rows sent to ``matmul``."""

    def __init__(self, linear: nn.Linear, matmul: Matmul = run) -> None:
        nn.Module.__init__(self)
        self.weight = linear.weight
        if "bias" in linear:
            self.bias = linear.bias
        # Plain attributes (not module state): a tuple or list would be taken for a parameter container.
        object.__setattr__(self, "_launch", plan(self.weight, "bias" in self))
        object.__setattr__(self, "_matmul", matmul)

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype == self.weight.dtype and 1 < x.size // x.shape[-1] <= MAX_ROWS:
            return self._matmul(self._launch, x, self.weight, self.get("bias"))
        return super().__call__(x)


def use_small_batch_kernel(model: nn.Module, matmul: Matmul = run) -> int:
    """Swap the model's eligible ``nn.Linear`` layers (exactly that class, a weight :func:`fits` takes) for
    :class:`SmallBatchLinear`; returns how many."""
    swapped = 0

    def swap(_path: str, module: Any) -> Any:
        nonlocal swapped
        if type(module) is nn.Linear and fits(module.weight):
            swapped += 1
            return SmallBatchLinear(module, matmul)
        return module

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return swapped
