"""One forward pass of a text model's body over a padded batch of inputs, pooled into one vector per input.

The body is mlx-lm's inner model (``model.model``: embeddings, layers, final norm), which returns the last hidden
state. Inputs are padded on the left, and every layer gets an mlx-lm ``BatchKVCache`` told each row's padding: its
mask keeps padding out of every row's attention, and its per-row offsets start each row's positions at 0 where its
tokens start, so that a row's vector does not depend on the rows beside it. With left padding every row's last token
is the batch's last position (``pooling = "last"``, as Qwen3-Embedding pools); ``"mean"`` averages each row over its
own tokens. Pooled vectors are float32 and L2-normalized unless ``normalize`` is off. Nothing here is reassigned.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxd.errors import ModelLoadError

POOLINGS = ("last", "mean")


def check_embeddable(model: Any) -> None:
    """Raise ``ModelLoadError`` unless ``model`` is an mlx-lm model whose body (``model.model``) takes a cache per
    layer and whose layers all keep plain attention caches (recurrent or sliding-window layers are not padded this
    way)."""
    body = getattr(model, "model", None)  # mlx-lm's text models name their body ``model``
    if body is None or not callable(body):
        raise ModelLoadError(f"{type(model).__module__} has no mlx-lm text body (model.model): it cannot serve "
                             "kind = \"embedding\"")
    kinds = {type(cache).__name__ for cache in make_prompt_cache(model)}
    if kinds != {KVCache.__name__}:
        raise ModelLoadError(f"{type(model).__module__} keeps {sorted(kinds)} caches; kind = \"embedding\" serves "
                             "models whose layers are all full attention (KVCache)")


def pooled_vectors(model: Any, rows: list[list[int]], pooling: str, normalize: bool) -> np.ndarray:
    """Vectors of ``rows`` (token id lists, none empty) in one pass: a float32 array of shape (len(rows), hidden)."""
    width = max(len(row) for row in rows)
    pads = [width - len(row) for row in rows]
    tokens = mx.array([[0] * pad + row for pad, row in zip(pads, rows, strict=True)], dtype=mx.int32)
    caches = [BatchKVCache(pads) for _ in range(len(model.layers))]
    hidden = model.model(tokens, cache=caches).astype(mx.float32)
    if pooling == "last":
        pooled = hidden[:, -1, :]
    else:
        keep = (mx.arange(width)[None, :] >= mx.array(pads)[:, None]).astype(mx.float32)
        lengths = mx.array([len(row) for row in rows], dtype=mx.float32)
        pooled = (hidden * keep[..., None]).sum(axis=1) / lengths[:, None]
    if normalize:
        pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    mx.eval(pooled)
    return np.array(pooled, copy=True)


def shorten(vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The first ``dimensions`` features of each vector (Matryoshka truncation), renormalized when ``normalize``;
    the vectors as they are for None."""
    if dimensions is None or dimensions >= vectors.shape[-1]:
        return vectors
    cut = vectors[:, :dimensions]
    if not normalize:
        return np.ascontiguousarray(cut)
    norms = np.maximum(np.linalg.norm(cut, axis=-1, keepdims=True), 1e-12)
    return (cut / norms).astype(np.float32)
