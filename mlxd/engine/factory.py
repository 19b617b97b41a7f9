"""Build the engine named by ``[engine] type``."""

from __future__ import annotations

from typing import Any

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import Engine


def make_engine(config: EngineConfig, model: Any) -> Engine:
    from mlxd.engine.batched import BatchedEngine

    engines = {"batched": BatchedEngine}
    return engines[config.type](model, config)
