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
    from mlxd.errors import ConfigError

    config = load_config(path)
    pipelines, errors = [], []
    for served in served_models(config):  # each model's pipeline, checked; an error names the model's table
        try:
            pipelines.append(model_pipeline(served.config, path))
        except ConfigError as e:
            errors.append(f"[{served.table}] pipeline: {e.message}" if config.models else e.message)
    if errors:
        raise ConfigError("\n".join(errors))
    return config, pipelines[0]


def model_pipeline(config: DaemonConfig, path: Path) -> Pipeline:
    """The pipeline of one model's config view (``mlxd.config.models``), assembled; ``path`` is the config file it
    was read from (a pipeline named by path is relative to its folder)."""
    from mlxd.config import resolve_pipeline
    from mlxd.pipeline.pipeline import build_pipeline

    source, tables = resolve_pipeline(config, path)
    return build_pipeline(tables, source)
