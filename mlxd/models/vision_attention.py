"""SigLIP-style vision towers (mlx-vlm's shared ``VisionAttention``: Gemma 3, Idefics3 / SmolVLM and others) on the
CPU, through :func:`mlxd.models.cpu_attention.cpu_attention`.

Their attention is ``mx.fast.scaled_dot_product_attention`` over every patch of an image, whose CPU softmax runs
MLX's slow ``exp``: one layer of a 1,024-patch image with 12 heads of 64 (SmolVLM's tower) took 507 ms on an Intel
Xeon host against 83 ms through ``cpu_attention``; one of Gemma 3's 4,096-patch images with 16 heads of 72, 9.4 s
against 1.7 s. :func:`use_cpu_vision_attention` swaps each ``VisionAttention`` for :class:`CpuVisionAttention`, which
holds the same projection layers, through MLX's public module updates; the mlx-vlm classes are untouched. Only for
the CPU: GPU backends keep MLX's fused kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.attention import VisionAttention

from mlxd.models.cpu_attention import cpu_attention


class CpuVisionAttention(nn.Module):
    """A ``VisionAttention``'s layers and arithmetic, its attention computed by :func:`cpu_attention`. Any other mask
    than a boolean array (additive values, ``"causal"``) goes to MLX's own attention, which takes it."""

    def __init__(self, attention: VisionAttention) -> None:
        super().__init__()
        self.q_proj, self.k_proj = attention.q_proj, attention.k_proj
        self.v_proj, self.out_proj = attention.v_proj, attention.out_proj
        # Plain attributes (not module state).
        object.__setattr__(self, "num_heads", attention.num_heads)
        object.__setattr__(self, "scale", attention.scale)

    def __call__(self, x: mx.array, mask: mx.array | str | None = None) -> mx.array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        batch, length, _ = q.shape
        q, k, v = (t.reshape(batch, t.shape[1], self.num_heads, -1).transpose(0, 2, 1, 3) for t in (q, k, v))
        if mask is None or (isinstance(mask, mx.array) and mask.dtype == mx.bool_):
            out = cpu_attention(q, k, v, self.scale, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def use_cpu_vision_attention(vlm: nn.Module) -> int:
    """Swap every ``VisionAttention`` module in ``vlm`` (exactly that class) for :class:`CpuVisionAttention`;
    returns how many."""
    return replace_modules(vlm, lambda module: type(module) is VisionAttention, CpuVisionAttention)


def replace_modules(root: nn.Module, match: Callable[[nn.Module], bool], make: Callable[[Any], nn.Module]) -> int:
    """Put ``make(module)`` in the place of each module under ``root`` that ``match``es (in a module's attribute or
    a list of modules); returns how many."""
    replaced = 0
    for path, module in root.named_modules():
        if path and match(module):
            parent_path, _, name = path.rpartition(".")
            parent = root
            for part in filter(None, parent_path.split(".")):
                parent = parent[int(part)] if isinstance(parent, list) else parent[part]
            if isinstance(parent, list):
                parent[int(name)] = make(module)
            else:
                parent.update_modules({name: make(module)})
            replaced += 1
    return replaced
