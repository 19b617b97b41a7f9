"""A daemon config read and its pipeline assembled: what ``mlxd``, ``mlxd check-config`` and ``mlxd service`` start
from. Below the commands (``cli``, ``service``), above ``config`` and ``pipeline``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxd.config.schema import DaemonConfig
    from mlxd.pipeline.pipeline import Pipeline


def load_everything(path: Path) -> tuple[DaemonConfig, Pipeline]:
    """Config + assembled pipeline, validated; nothing is loaded into memory yet. ``ConfigError`` names the file
    and field of a bad value."""
    # Imported here: `mlxd --help` and `mlxd service` stay light, and MLX is not imported before the device is chosen.
    from mlxd.config import load_config, resolve_pipeline
    from mlxd.pipeline.pipeline import build_pipeline

    config = load_config(path)
    source, tables = resolve_pipeline(config, path)
    return config, build_pipeline(tables, source)
