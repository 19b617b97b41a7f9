"""Build the engine named by ``[engine] type``."""

from __future__ import annotations

from typing import Any

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import Engine


def make_engine(config: EngineConfig, model: Any, drafter: Any = None) -> Engine:
    """``drafter``: what proposes tokens for speculative requests (``mlxd.engine.drafters``), None for none."""
    from mlxd.engine.engine import BatchedEngine

    engines = {"batched": BatchedEngine}
    return engines[config.type](model, config, drafter=drafter)
