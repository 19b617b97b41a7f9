"""A vision model's language model as mlx-lm's text model of its family, sharing the vision model's weights.

Text tokens of a multimodal-RoPE model (Qwen2.5-VL, Qwen3-VL) have equal temporal, height and width positions, and
multimodal RoPE at equal positions is ordinary RoPE. So every forward pass that feeds token ids (text prompts, every
decode step, speculative verification) can run through mlx-lm's own text model of the family, which applies
``mx.fast.rope`` and takes per-row positions from the cache, instead of mlx-vlm's language model, which computes
multimodal positions and rotations with separate kernels on every layer (on CUDA its fused path does not apply). Only
prompt chunks that carry image embeddings need mlx-vlm's model.

The twin is mlx-lm's model for the checkpoint (the one ``[model] kind = "text"`` serves), built at load with its
weights left lazy: they are never read, every parameter is replaced by the vision model's array of the same name and shape (the same
arrays, no copy). It is made only where it can stand in exactly: every parameter found with its shape, and caches
of plain attention layers on both sides. Rows then keep mlx-lm's caches, which mlx-vlm's language model drives
through the same protocol for image prompt chunks. Anything else (hybrid recurrent layers, sliding windows, a
family mlx-lm lacks) keeps the vision model's own forward pass and caches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxd.log import get_logger

log = get_logger("mlxd.models")


def language_twin(folder: Path, language_model: Any, dequantize: bool) -> Any | None:
    """mlx-lm's text model of ``folder`` with ``language_model``'s weights (mlx-vlm's), or ``None`` (logged) where
    it cannot stand in. ``dequantize``: the vision model's weights were dequantized at load (a dtype was set)."""
    from mlx_lm.models.cache import make_prompt_cache as text_cache
    from mlx_lm.utils import dequantize_model, load_model
    from mlx_vlm.models.cache import make_prompt_cache as vision_cache

    if not _plain_attention(vision_cache(language_model)):
        return _none(folder, "its language model's caches are not all plain attention caches")
    try:
        text, _ = load_model(folder, lazy=True)
    except (ValueError, FileNotFoundError, KeyError, ImportError, AttributeError, TypeError) as e:
        return _none(folder, f"mlx-lm cannot build its text model: {e}")
    if not _plain_attention(text_cache(text)):
        return _none(folder, "mlx-lm's text model uses caches other than plain attention caches")
    if dequantize:
        text = dequantize_model(text)
    shared = _shared_weights(text, language_model)
    if shared is None:
        return _none(folder, "the text model's weights do not map onto the vision model's language weights")
    text.update(tree_unflatten(list(shared.items())))
    log.info("language_twin", model=str(folder), parameters=len(shared))
    return text


class ShiftedPositions:
    """A cache layer seen with its RoPE positions shifted per row, for rows whose positions run behind their cache
    length after an image (multimodal RoPE): ``positions`` (``(B,)``) is what the model reads as the layer's
    ``offset``. Everything else is the layer's own.

    Every layer of a forward pass reads its offset before writing to it, and all layers hold the same offsets, so one
    ``positions`` array (the first layer's offset plus the row's delta, :func:`shifted`) serves the whole pass: no
    addition per layer and per read on the host."""

    def __init__(self, layer: Any, positions: mx.array) -> None:
        self._layer = layer
        self.offset = positions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def shifted(cache: list[Any], deltas: mx.array) -> list[Any]:
    """``cache`` seen with each row's positions shifted by ``deltas`` (``(B,)``) for one forward pass."""
    positions = cache[0].offset + deltas
    return [ShiftedPositions(layer, positions) for layer in cache]


def _shared_weights(text: Any, language_model: Any) -> dict[str, mx.array] | None:
    """The twin's parameter names mapped to the language model's arrays (names equal once the twin's wrapper prefix
    is dropped), or None unless every one is found with its shape."""
    mine = dict(tree_flatten(text.parameters()))
    theirs = dict(tree_flatten(language_model.parameters()))
    for prefix in ("", "language_model."):
        mapped = {name: theirs.get(name.removeprefix(prefix)) for name in mine}
        if all(a is not None and a.shape == mine[name].shape for name, a in mapped.items()):
            return mapped
    return None


def _plain_attention(caches: list[Any]) -> bool:
    return bool(caches) and all(type(c).__name__ == "KVCache" for c in caches)


def _none(folder: Path, reason: str) -> None:
    log.info("language_twin_unavailable", model=str(folder), reason=reason)
    return None
