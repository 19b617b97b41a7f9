"""Text models' attention on the CPU: prompt passes through :func:`mlxd.models.prompt_attention.prompt_attention`.

mlx-lm's Llama and Qwen2 ``Attention`` project, rotate, write the cache and call
``mlx_lm.models.base.scaled_dot_product_attention``, which on MLX's CPU backend is ``mx.fast``'s kernel: for a long
prompt its softmax runs MLX's slow ``exp`` over every score (see :mod:`mlxd.models.prompt_attention`).
:class:`CpuTextAttention` holds the same layers under the same names and does the same, except that a pass of at
least :data:`MIN_QUERIES` query positions (a prompt chunk) goes to numpy's blocked attention, and so does a decode
step over at least :data:`MIN_KEYS` cached positions: MLX's CPU kernel took 0.9-6.3 s a layer for one query over
20,480 keys (9 heads over 3), numpy 20 ms, so a decode step of SmolLM2-135M at Claude Code's 20k-token prompt took
3.5 s in the daemon. Shorter decode steps and verify passes keep mlx-lm's call (MLX's kernel, or its
quantized-cache attention; it stays lazy, where the blocked kernel evaluates its inputs), as does any mask the
blocked kernel does not take. :func:`use_cpu_text_attention` swaps the modules in at load through MLX's public module
updates; the mlx-lm classes are untouched. Only for the CPU: GPU backends keep MLX's fused kernel.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

from mlxd.models.prompt_attention import prompt_attention, supports
from mlxd.models.vision_attention import replace_modules

# mlx-lm families whose ``Attention.__call__`` is exactly q/k/v projections, RoPE at the cache's offset, the cache
# update, attention and the output projection (mlx-lm 0.32); Mistral and SmolLM load as ``llama``.
FAMILIES = ("llama", "qwen2")
# Query positions from which a pass is a prompt pass: fewer (decode, speculative verification) stay with MLX...
MIN_QUERIES = 16
# ... unless they attend to at least this many keys (one query, 9 heads over 3, on 2 cores: MLX 1.8 ms, numpy 1.0 ms
# at 4,096 keys; 11.9 against 5.0 ms at 8,192; even at 1,024).
MIN_KEYS = 4096


class CpuTextAttention(nn.Module):
    """A family ``Attention``'s layers and arithmetic, prompt passes' attention computed by numpy in blocks."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.q_proj, self.k_proj = attention.q_proj, attention.k_proj
        self.v_proj, self.o_proj = attention.v_proj, attention.o_proj
        self.rope = attention.rope
        # Plain attributes (not module state).
        object.__setattr__(self, "n_heads", attention.n_heads)
        object.__setattr__(self, "n_kv_heads", attention.n_kv_heads)
        object.__setattr__(self, "scale", attention.scale)

    def __call__(self, x: mx.array, mask: mx.array | str | None = None, cache: Any = None) -> mx.array:
        batch, length, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(batch, length, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries, keys = self.rope(queries), self.rope(keys)
        # A quantized cache hands back (packed, scales, biases) triples, which only mlx-lm's quantized attention reads.
        blocked = not hasattr(cache, "bits") and (length >= MIN_QUERIES or keys.shape[2] >= MIN_KEYS)
        if blocked and supports(queries, keys, mask):
            output = prompt_attention(queries, keys, values, self.scale, mask)
        else:
            output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def use_cpu_text_attention(model: nn.Module) -> int:
    """Swap every ``Attention`` of a :data:`FAMILIES` mlx-lm model under ``model`` (exactly those classes) for
    :class:`CpuTextAttention`; returns how many (0 for other families)."""
    classes = tuple(importlib.import_module(f"mlx_lm.models.{family}").Attention for family in FAMILIES)
    return replace_modules(model, lambda module: type(module) in classes, CpuTextAttention)
