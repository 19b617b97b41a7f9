"""Reading config and pipeline files. Every error names the file, the table and the field."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from mlxd.config.schema import DaemonConfig, PipelineSpec
from mlxd.errors import ConfigError


def read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: no such file") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e


def describe_validation_error(err: msgspec.ValidationError) -> str:
    """Turn msgspec's ``... - at `$.server.port``` into ``[server] port: ...``."""
    text = str(err)
    match = re.search(r" - at `\$(.*)`$", text)
    if not match:
        return text
    reason = text[: match.start()]
    parts = [p for p in re.split(r"\.|\[(\d+)\]", match.group(1)) if p]
    if not parts:
        return reason
    where = ".".join(f"[{p}]" if p.isdigit() else p for p in parts)
    return f"{where}: {reason}"


def convert(data: Any, schema: type, source: str) -> Any:
    """``msgspec.convert`` with an error that names ``source`` and the offending field."""
    try:
        return msgspec.convert(data, schema, strict=True)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {describe_validation_error(e)}") from e


def load_config(path: str | Path) -> DaemonConfig:
    """Read and validate a daemon config file. Raises ``ConfigError`` naming the file and field."""
    path = Path(path)
    return convert(read_toml(path), DaemonConfig, str(path))


def pipeline_search_dirs(config_path: Path) -> list[Path]:
    """Where a pipeline named in a config is looked for: beside the config, its parent, then the CWD."""
    base = config_path.resolve().parent
    dirs = [base / "pipelines", base.parent / "pipelines", Path.cwd() / "pipelines"]
    return list(dict.fromkeys(dirs))


def resolve_pipeline(config: DaemonConfig, config_path: Path) -> tuple[str, list[dict[str, Any]]]:
    """Return (where the stages came from, the raw stage tables) for the config's ``pipeline`` entry."""
    spec = config.pipeline
    if isinstance(spec, PipelineSpec):
        return f"{config_path} [pipeline]", spec.stages
    candidate = Path(spec)
    if candidate.suffix == ".toml":
        candidates = [candidate if candidate.is_absolute() else config_path.resolve().parent / candidate]
    else:
        candidates = [d / f"{spec}.toml" for d in pipeline_search_dirs(config_path)]
    for file in candidates:
        if file.is_file():
            stages = convert(read_toml(file), PipelineSpec, str(file)).stages
            return str(file), stages
    tried = ", ".join(str(c) for c in candidates)
    raise ConfigError(f"{config_path}: pipeline {spec!r} not found (looked for {tried})")
