"""How the engine runs the served model: forward passes with or without hidden states, and the verify pass of a
speculative step, which opens a cache transaction (commit each row's kept length, or abort).

A model is called as mlx-lm calls it, ``model(inputs, cache=cache, **kwargs)``. Two extras come from the vision
wrapper (:class:`mlxd.models.vlm.VisionLanguageModel`): ``forward_hidden`` (the last hidden states, which MTP heads
read) and, for language models that verify speculative blocks themselves (Qwen3.5), ``verify_forward``. Every other
model's verify pass is its ordinary call inside mlx-vlm's ``start_speculative_cache`` transaction, with its
attention caches padded on CUDA (:mod:`mlxd.engine.step.padded`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_vlm.speculative.cache_state import start_speculative_cache

from mlxd.engine.step.padded import pad_verify, padded


def forward(model: Any, inputs: mx.array, cache: list[Any], *, hidden: bool = False,
            **kwargs: Any) -> tuple[mx.array, mx.array | None]:
    """``(logits (B, L, V), hidden (B, L, H) or None)``; hidden states only when asked (they cost nothing more to
    compute, but keep the model's last activations alive)."""
    if hidden:
        return model.forward_hidden(inputs, cache, **kwargs)
    return model(inputs, cache=cache, **kwargs), None


def verify(model: Any, inputs: mx.array, cache: list[Any], **kwargs: Any) -> tuple[mx.array, mx.array | None, Any]:
    """The verify pass of a speculative step: ``(logits, hidden or None, transaction)``."""
    if getattr(model, "has_verify_entry", False):
        return model.verify_forward(inputs, cache, **kwargs)
    transaction = start_speculative_cache(cache, inputs.shape[1])
    try:
        return model(inputs, cache=padded(cache) if pad_verify() else cache, **kwargs), None, transaction
    except BaseException:
        transaction.abort()
        raise
