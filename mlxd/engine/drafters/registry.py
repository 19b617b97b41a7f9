"""Build the drafter that ``[engine.speculative] drafter`` names, checked against the served model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxd.config.schema import SpeculativeConfig
from mlxd.engine.drafters.base import Drafter
from mlxd.errors import ConfigError


def make_drafter(config: SpeculativeConfig, model: Any, folder: Path, base_dir: Path | None = None) -> Drafter | None:
    """The configured drafter for ``model`` (served from ``folder``), or None when speculation is off.
    ``ConfigError`` names the field at fault; relative paths are taken from ``base_dir`` (the config's folder)."""
    if config.drafter == "none":
        return None
    if config.drafter == "prompt_lookup":
        from mlxd.engine.drafters.prompt_lookup import PromptLookupDrafter

        if config.ngram_min > config.ngram_max:
            raise ConfigError(f"[engine.speculative] ngram_min = {config.ngram_min} is above ngram_max = "
                              f"{config.ngram_max}")
        return PromptLookupDrafter(config.ngram_max, config.ngram_min)
    if config.drafter == "draft_model":
        return _draft_model(config, model, base_dir)
    from mlxd.engine.drafters.mtp import make_mtp_drafter

    return make_mtp_drafter(model, folder)


def _draft_model(config: SpeculativeConfig, model: Any, base_dir: Path | None) -> Drafter:
    from mlx_lm.utils import load as mlx_lm_load

    from mlxd.engine.drafters.draft_model import DraftModelDrafter
    from mlxd.models.load import choose_dtype

    if not config.draft_model:
        raise ConfigError("[engine.speculative] drafter = \"draft_model\" needs draft_model (an mlx-lm model folder)")
    folder = Path(config.draft_model).expanduser()
    if not folder.is_absolute() and base_dir is not None:
        folder = base_dir / folder
    try:
        draft, _ = mlx_lm_load(str(folder))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"[engine.speculative] draft_model = {config.draft_model!r}: mlx-lm could not load "
                          f"{folder}: {e}") from e
    dtype = choose_dtype("auto")
    if dtype is not None:
        import mlx.core as mx
        from mlx_lm.utils import dequantize_model

        draft = dequantize_model(draft)
        draft.set_dtype(getattr(mx, dtype))
        # Evaluated here: the engine thread cannot evaluate arrays left lazy on this thread's stream.
        mx.eval(draft.parameters())
    return DraftModelDrafter(draft)
