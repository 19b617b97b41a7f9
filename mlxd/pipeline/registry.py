"""Finding stage classes: built-in names, ``package.module:attr`` paths, and the ``mlxd.stages`` entry points."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import msgspec

from mlxd.errors import PipelineError

ENTRY_POINT_GROUP = "mlxd.stages"

BUILTIN_STAGES = {
    "normalize": "mlxd.pipeline.stages.normalize:Normalize",
    "template": "mlxd.pipeline.stages.template:Template",
    "route": "mlxd.pipeline.stages.route:Route",
    "prefill": "mlxd.pipeline.stages.prefill:Prefill",
    "decode": "mlxd.pipeline.stages.decode:Decode",
    "detokenize": "mlxd.pipeline.stages.detokenize:Detokenize",
    "parse": "mlxd.pipeline.stages.parse:Parse",
}


def _entry_points() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_stage_names() -> list[str]:
    """Built-in names first, then those registered by installed packages."""
    return list(BUILTIN_STAGES) + sorted(set(_entry_points()) - set(BUILTIN_STAGES))


def _import_path(path: str) -> object:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PipelineError(f"cannot import stage module {module_name!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise PipelineError(f"module {module_name!r} has no attribute {attr!r}") from e


def check_contract(cls: object, type_name: str) -> type:
    """A stage is a class with a ``Config`` msgspec struct and ``warm_up``/``prepare``/``stream`` methods."""
    if not isinstance(cls, type):
        raise PipelineError(f"stage {type_name!r} is not a class")
    config = getattr(cls, "Config", None)
    if not (isinstance(config, type) and issubclass(config, msgspec.Struct)):
        raise PipelineError(f"stage {type_name!r} must define `Config` as a msgspec.Struct subclass")
    missing = [m for m in ("warm_up", "prepare", "stream") if not callable(getattr(cls, m, None))]
    if missing:
        raise PipelineError(f"stage {type_name!r} lacks method(s): {', '.join(missing)}")
    return cls


def resolve_stage(type_name: str) -> type:
    """Return the stage class for a config's ``type`` value, checked against the stage contract."""
    if ":" in type_name:
        return check_contract(_import_path(type_name), type_name)
    if type_name in BUILTIN_STAGES:
        return check_contract(_import_path(BUILTIN_STAGES[type_name]), type_name)
    registered = _entry_points()
    if type_name in registered:
        try:
            cls = registered[type_name].load()
        except Exception as e:  # a broken plugin must not hide behind a traceback
            raise PipelineError(f"stage {type_name!r} (entry point) failed to load: {e}") from e
        return check_contract(cls, type_name)
    known = ", ".join(known_stage_names())
    raise PipelineError(
        f"unknown stage type {type_name!r}; known stages: {known} (or give a `package.module:Class` path)"
    )
