"""Encoder embedding models (the BERT family) through mlx-embeddings, for ``[model] kind = "embedding"``.

mlx-lm loads decoder models only; a folder whose ``config.json`` names an encoder ``model_type`` (:data:`ENCODER_TYPES`)
is loaded with mlx-embeddings' own model classes instead (``pip install mlx-embeddings``; it adds no dependency mlxd
does not have), and its tokenizer with mlx-lm's tokenizer loader (which adds ``[CLS]`` and ``[SEP]`` as the
checkpoint's tokenizer says). The result is the :class:`mlxd.models.load.LoadedModel` the daemon serves, with kind
``encoder``: only the embedding engine serves it.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxd.config.schema import ModelConfig
from mlxd.errors import ModelLoadError
from mlxd.log import get_logger
from mlxd.models.load import LoadedModel, choose_context_length, choose_dtype, resolve_source

log = get_logger("mlxd.models.encoder")

# model_type values mlx-embeddings builds encoders for; XLM-RoBERTa keeps 2 positions for its padding offset.
ENCODER_TYPES = {"bert": 0, "xlm-roberta": 2, "modernbert": 0}


def encoder_type(config: ModelConfig, base_dir: Path | None = None) -> str | None:
    """The encoder ``model_type`` of a ``kind = "embedding"`` model's folder, None for anything else (no loading,
    no MLX import; a source that cannot be resolved is left to the ordinary loader's error)."""
    if config.kind != "embedding" or config.source.startswith("embedded:") or config.source.endswith(".gguf"):
        return None
    folder = Path(config.source).expanduser()
    if not folder.is_absolute() and not folder.exists() and base_dir is not None:
        folder = base_dir / folder
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    return model_type if model_type in ENCODER_TYPES else None


def load_encoder(config: ModelConfig, base_dir: Path | None = None) -> LoadedModel:
    """Load an encoder folder (see :func:`encoder_type`) on the served device. Raises ``ModelLoadError`` when
    mlx-embeddings is not installed or cannot build the model."""
    folder = resolve_source(config.source, base_dir)
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    try:
        from mlx_embeddings.utils import load_model
    except ImportError as e:
        raise ModelLoadError(f"{folder} is a {model_type} encoder: serving it needs mlx-embeddings (pip install "
                             "mlx-embeddings)") from e
    import mlx.core as mx
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxd.runtime.device import select_device, use_device

    use_device(select_device(config.device))
    try:
        model = load_model(folder)
        tokenizer = load_tokenizer(folder)
    except (ValueError, FileNotFoundError, KeyError, TypeError) as e:
        raise ModelLoadError(f"mlx-embeddings could not load {folder}: {e}") from e
    dtype = choose_dtype(config.dtype)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
    model_config = json.loads((folder / "config.json").read_text())
    trained = int(model_config.get("max_position_embeddings", 512)) - ENCODER_TYPES[model_type]
    context = min(choose_context_length(config.context_length, trained), trained)  # positions are learned
    log.info("encoder_loaded", folder=str(folder), model_type=model_type, context_length=context)
    return LoadedModel(model, tokenizer, folder, "encoder", context, dtype or "native")
