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
    from mlxd.config import load_config
    from mlxd.config.models import served_models

    config = load_config(path)
    pipelines = [model_pipeline(served.config, path) for served in served_models(config)]  # each model's, checked
    return config, pipelines[0]


def model_pipeline(config: DaemonConfig, path: Path) -> Pipeline:
    """The pipeline of one model's config view (``mlxd.config.models``), assembled; ``path`` is the config file it
    was read from (a pipeline named by path is relative to its folder)."""
    from mlxd.config import resolve_pipeline
    from mlxd.pipeline.pipeline import build_pipeline

    source, tables = resolve_pipeline(config, path)
    return build_pipeline(tables, source)
