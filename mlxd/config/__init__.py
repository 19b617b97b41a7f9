"""Daemon configuration: TOML files read into frozen msgspec structs."""

from mlxd.config.load import load_config, resolve_pipeline
from mlxd.config.schema import DaemonConfig, EngineConfig, LoggingConfig, ModelConfig, ServerConfig

__all__ = [
    "DaemonConfig",
    "EngineConfig",
    "LoggingConfig",
    "ModelConfig",
    "ServerConfig",
    "load_config",
    "resolve_pipeline",
]
