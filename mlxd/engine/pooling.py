"""One forward pass over a padded batch of inputs, pooled into one vector per input.

Decoders (mlx-lm text models, :class:`DecoderPool`): the body is mlx-lm's inner model (``model.model``: embeddings,
layers, final norm), which returns the last hidden state. Inputs are padded on the left, and every layer gets an
mlx-lm ``BatchKVCache`` told each row's padding: its mask keeps padding out of every row's attention, and its per-row
offsets start each row's positions at 0 where its tokens start, so that a row's vector does not depend on the rows
beside it. Encoders (the BERT family through mlx-embeddings, :class:`EncoderPool`): inputs padded on the right with
an attention mask, as those models take them. Pooling: ``last`` (each input's last token, as Qwen3-Embedding
pools), ``mean`` (over its own tokens), ``cls`` (its first token); vectors are float32 and L2-normalized unless
``normalize`` is off. Nothing here is reassigned.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxd.errors import ModelLoadError


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


class DecoderPool:
    """An mlx-lm text model's vectors, inputs left-padded, run ``chunk`` positions at a time (the caches carry the
    earlier chunks' keys and values), so that a pass over long inputs never holds more than ``chunk`` queries'
    attention scores, as the batched engine's prompt chunks do."""

    default_pooling = "last"

    def __init__(self, model: Any, chunk: int = 512) -> None:
        check_embeddable(model)
        self.model, self.chunk = model, chunk

    def vocab_size(self) -> int:
        """The logits width, measured with one token."""
        return int(self.model(mx.array([[0]], dtype=mx.int32)).shape[-1])

    def __call__(self, rows: list[list[int]], pooling: str, normalize: bool) -> np.ndarray:
        """Vectors of ``rows`` (token id lists, none empty) in one pass: float32, (len(rows), hidden)."""
        width = max(len(row) for row in rows)
        pads = [width - len(row) for row in rows]
        tokens = mx.array([[0] * pad + row for pad, row in zip(pads, rows, strict=True)], dtype=mx.int32)
        caches = [BatchKVCache(pads) for _ in range(len(self.model.layers))]
        parts = []
        for start in range(0, width, self.chunk):
            parts.append(self.model.model(tokens[:, start: start + self.chunk], cache=caches))
            mx.eval(parts[-1])
        hidden = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
        return _pooled(hidden, pads, [len(row) for row in rows], pooling, normalize)


class EncoderPool:
    """An mlx-embeddings encoder's vectors (BERT family), inputs right-padded with an attention mask."""

    default_pooling = "mean"

    def __init__(self, model: Any, pad_token_id: int | None) -> None:
        self.model, self.pad_token_id = model, pad_token_id or 0

    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def __call__(self, rows: list[list[int]], pooling: str, normalize: bool) -> np.ndarray:
        width = max(len(row) for row in rows)
        tokens = mx.array([row + [self.pad_token_id] * (width - len(row)) for row in rows], dtype=mx.int32)
        mask = mx.array([[1] * len(row) + [0] * (width - len(row)) for row in rows], dtype=mx.float32)
        hidden = self.model(tokens, attention_mask=mask).last_hidden_state
        return _pooled(hidden, [0] * len(rows), [len(row) for row in rows], pooling, normalize)


def _pooled(hidden: mx.array, starts: list[int], lengths: list[int], pooling: str, normalize: bool) -> np.ndarray:
    """Each row's vector from ``hidden`` (batch, width, features), its tokens at ``[start, start + length)``."""
    hidden = hidden.astype(mx.float32)
    rows = mx.arange(len(starts))
    if pooling == "last":
        pooled = hidden[rows, mx.array([s + n - 1 for s, n in zip(starts, lengths, strict=True)])]
    elif pooling == "cls":
        pooled = hidden[rows, mx.array(starts)]
    else:
        positions = mx.arange(hidden.shape[1])[None, :]
        begin, end = mx.array(starts)[:, None], mx.array([s + n for s, n in zip(starts, lengths, strict=True)])[:, None]
        keep = ((positions >= begin) & (positions < end)).astype(mx.float32)
        pooled = (hidden * keep[..., None]).sum(axis=1) / mx.array(lengths, dtype=mx.float32)[:, None]
    if normalize:
        pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    mx.eval(pooled)
    return np.array(pooled, copy=True)


def make_pool(loaded: Any, chunk: int = 512) -> DecoderPool | EncoderPool:
    """The pooled forward pass for a loaded model: an encoder's (``kind`` "encoder") or a decoder's (``chunk``
    positions at a time)."""
    if loaded.kind == "encoder":
        return EncoderPool(loaded.model, loaded.tokenizer.pad_token_id)
    return DecoderPool(loaded.model, chunk)


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
