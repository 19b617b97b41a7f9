"""Load a vision-language checkpoint with mlx-vlm, into the same handle a text model gets.

The handle's pieces: the model, wrapped so that the engine drives it like an mlx-lm model
(:class:`~mlxd.models.vlm.VisionLanguageModel`); mlx-lm's tokenizer wrapper over the checkpoint's own tokenizer files
(encode/decode, a streaming detokenizer, the chat template), whatever the processor wraps; the processor itself
(images → pixel inputs, placeholder tokens expanded); and the config. End-of-sequence ids are gathered from every
place checkpoints keep them: the config, its ``text_config``, ``generation_config.json`` and the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxd.errors import ModelLoadError


def load_vision(folder: Path) -> tuple[Any, Any, Any, dict]:
    """``(model, tokenizer, processor, config)`` for a checkpoint with a ``vision_config``."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm.utils import load as mlx_vlm_load

    from mlxd.models.vlm import VisionLanguageModel

    config = json.loads((folder / "config.json").read_text())
    try:
        model, processor = mlx_vlm_load(str(folder))
    except (ValueError, FileNotFoundError, KeyError, ImportError) as e:
        raise ModelLoadError(f"mlx-vlm could not load {folder}: {e}") from e
    tokenizer = load_tokenizer(folder, eos_token_ids=sorted(eos_token_ids(folder, config)))
    # The processor's template is the one that renders image parts (chat_template.json); some mlx-vlm processors
    # never load it, and then the tokenizer's is used.
    template = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ModelLoadError(f"{folder} has no chat template (neither its processor nor its tokenizer)")
    tokenizer.chat_template = template
    return VisionLanguageModel(model), tokenizer, processor, config


def eos_token_ids(folder: Path, config: dict) -> set[int]:
    """Every end-of-sequence id the checkpoint names (config, text_config, generation_config.json)."""
    tables = [config, config.get("text_config") or {}]
    generation = folder / "generation_config.json"
    if generation.is_file():
        tables.append(json.loads(generation.read_text()))
    ids: set[int] = set()
    for table in tables:
        value = table.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids
