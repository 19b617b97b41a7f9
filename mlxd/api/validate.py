"""Checks that depend on the loaded model: token ids (``top_k``, ``logit_bias`` keys, prompt ids) below the
vocabulary size. The model-independent ranges are ``msgspec.Meta`` constraints in ``mlxd.api.schemas``."""

from __future__ import annotations

from mlxd.api.schemas import CompletionRequest, SamplingFields
from mlxd.errors import RequestError
from mlxd.pipeline.stage import ModelInfo


def check_against_model(body: SamplingFields, model: ModelInfo | None) -> None:
    """Raise a 400 naming the field when a token id or ``top_k`` is not below the model's vocabulary size.

    Does nothing before the model is loaded or when its vocabulary size is unknown (0)."""
    vocab = model.vocab_size if model is not None else 0
    if vocab <= 0:
        return
    if body.top_k is not None and body.top_k >= vocab:
        raise RequestError(f"top_k must be below the vocabulary size {vocab} (0 is off), got {body.top_k}",
                           param="top_k")
    if body.logit_bias:
        bad = [key for key in body.logit_bias if int(key) >= vocab]
        if bad:
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab}), got {_ids(bad)}",
                               param="logit_bias")
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list):
        bad_ids = [token for token in body.prompt if token >= vocab]
        if bad_ids:
            raise RequestError(f"prompt token ids must be in [0, {vocab}), got {_ids(bad_ids)}", param="prompt")


def _ids(values: list[int] | list[str]) -> str:
    shown = ", ".join(str(v) if len(str(v)) <= 24 else str(v)[:24] + "…" for v in values[:5])
    return shown + (f" and {len(values) - 5} more" if len(values) > 5 else "")
