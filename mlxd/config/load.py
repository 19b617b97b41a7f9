"""Reading config and pipeline files. Every error names the file, the table and the field."""

from __future__ import annotations

import re
import tomllib
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import msgspec

from mlxd.config.models import normalise, served_models
from mlxd.config.schema import DaemonConfig, EngineConfig, PipelineSpec, ServedModelConfig
from mlxd.errors import ConfigError


def read_toml(path: Path | Traversable) -> dict[str, Any]:
    """The TOML file's tables; a file that is missing, unreadable, not UTF-8 or not TOML is a ``ConfigError``
    naming it."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: no such file") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); TOML files are UTF-8") from e
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from e
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


def convert_models(tables: object, source: str) -> dict[str, ServedModelConfig]:
    """The raw ``[models]`` tables as structs, one by one, so that an error names ``models.NAME.field``."""
    if not isinstance(tables, dict):
        raise ConfigError(f"{source}: models: Expected a table of [models.NAME] tables, got {type(tables).__name__}")
    models = {}
    for key, table in tables.items():
        try:
            models[key] = msgspec.convert(table, ServedModelConfig, strict=True)
        except msgspec.ValidationError as e:
            where = describe_validation_error(e)
            where = f".{where}" if not where.startswith(("Object", "Expected")) else f": {where}"
            raise ConfigError(f"{source}: models.{key}{where}") from e
    return models


def load_config(path: str | Path) -> DaemonConfig:
    """Read and validate a daemon config file. Raises ``ConfigError`` naming the file and field."""
    path = Path(path)
    data = read_toml(path)
    tables = data.pop("models", {})  # converted one by one, so that an error names models.NAME
    config = convert(data, DaemonConfig, str(path))
    if tables:
        config = msgspec.structs.replace(config, models=convert_models(tables, str(path)))
    config = normalise(with_prefix_dirs(config, path.resolve().parent), str(path))
    check_distributed(config, str(path))
    for served in served_models(config):
        table = "engine" if served.config.engine is config.engine else f"{served.table}.engine"
        check_speculative(served.config, str(path), table)
        check_prefix_disk(served.config, str(path), table)
    return config


def with_prefix_dirs(config: DaemonConfig, base: Path) -> DaemonConfig:
    """The config with every ``prefix_cache_dir`` (``[engine]``, ``[models.NAME.engine]``) taken from ``base``
    (the config's folder) when relative."""
    def resolved(engine: EngineConfig) -> EngineConfig:
        folder = Path(engine.prefix_cache_dir).expanduser()
        if not engine.prefix_cache_dir or folder.is_absolute():
            return engine
        return msgspec.structs.replace(engine, prefix_cache_dir=str(base / folder))

    models = {key: msgspec.structs.replace(table, engine=resolved(table.engine)) if table.engine is not None
              else table for key, table in config.models.items()}
    return msgspec.structs.replace(config, engine=resolved(config.engine), models=models)


def check_prefix_disk(config: DaemonConfig, source: str, table: str = "engine") -> None:
    """What the prefix cache's disk tier (``prefix_cache_dir``) needs, named by field."""
    engine = config.engine
    if not engine.prefix_cache_dir:
        return
    if engine.prefix_cache_bytes == 0:
        raise ConfigError(f"{source}: {table}.prefix_cache_dir: the disk tier keeps what the prefix cache evicts from "
                          "memory, and prefix_cache_bytes is 0; set prefix_cache_bytes above 0 or leave "
                          "prefix_cache_dir empty")
    if config.distributed is not None:
        raise ConfigError(f"{source}: {table}.prefix_cache_dir: [distributed] has no disk tier (every rank would need "
                          "the same files to make the same cache decisions); leave prefix_cache_dir empty")


def check_speculative(config: DaemonConfig, source: str, table: str = "engine") -> None:
    """The ``[engine.speculative]`` fields bounded by one another (``table``: where that engine table is)."""
    settings = config.engine.speculative
    if settings.ngram_min > settings.ngram_max:
        raise ConfigError(f"{source}: {table}.speculative.ngram_min: {settings.ngram_min} is more than ngram_max = "
                          f"{settings.ngram_max}")


def check_distributed(config: DaemonConfig, source: str) -> None:
    """What ``[distributed]`` cannot be combined with, named by field."""
    settings = config.distributed
    if settings is None:
        return
    if config.engine.speculative.drafter != "none":
        raise ConfigError(f"{source}: engine.speculative.drafter: [distributed] does not run speculative decoding; "
                          "set it to \"none\"")
    if settings.hosts and settings.hostfile:
        raise ConfigError(f"{source}: distributed.hosts: give hosts or hostfile, not both")
    if settings.hosts and len(settings.hosts) != settings.tensor_parallel:
        raise ConfigError(f"{source}: distributed.hosts: {len(settings.hosts)} hosts (one per rank) but "
                          f"tensor_parallel = {settings.tensor_parallel}")


BUILTIN_PIPELINES = resources.files("mlxd") / "pipelines"


def builtin_pipeline_names() -> list[str]:
    """The pipelines shipped inside the package (``mlxd/pipelines/*.toml``)."""
    return sorted(f.name.removesuffix(".toml") for f in BUILTIN_PIPELINES.iterdir() if f.name.endswith(".toml"))


def pipeline_candidates(spec: str, config_path: Path) -> list[Path | Traversable]:
    """Where the config's ``pipeline`` entry is looked for, in order.

    A path (it ends in ``.toml`` or contains a ``/``) is that file, relative to the config's folder. A name is
    ``pipelines/NAME.toml`` beside the config, then the built-in ``mlxd/pipelines/NAME.toml``.
    """
    base = config_path.resolve().parent
    if spec.endswith(".toml") or "/" in spec:
        path = Path(spec).expanduser()
        return [path if path.is_absolute() else base / path]
    return [base / "pipelines" / f"{spec}.toml", BUILTIN_PIPELINES / f"{spec}.toml"]


def resolve_pipeline(config: DaemonConfig, config_path: Path) -> tuple[str, list[dict[str, Any]]]:
    """Return (where the stages came from, the raw stage tables) for the config's ``pipeline`` entry."""
    spec = config.pipeline
    if isinstance(spec, PipelineSpec):
        return f"{config_path} [pipeline]", spec.stages
    candidates = pipeline_candidates(spec, config_path)
    for file in candidates:
        if file.is_file():
            stages = convert(read_toml(file), PipelineSpec, str(file)).stages
            return str(file), stages
    tried = ", ".join(str(c) for c in candidates)
    builtins = ", ".join(builtin_pipeline_names())
    raise ConfigError(f"{config_path}: pipeline {spec!r} not found (looked for {tried}); built-in pipelines: {builtins}")
