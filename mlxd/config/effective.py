"""The effective value of every setting and where it came from: the built-in default, the file, a flag, or the model.

Found by walking the converted structs beside the raw TOML tables they came from, so a new field is listed
without being named here. Sampling defaults the file leaves unset come from the model (its generation_config.json,
or the defaults shipped with an embedded model) or else mlxd's (:mod:`mlxd.config.sampling`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec

from mlxd.config.sampling import resolve_sampling
from mlxd.config.schema import DaemonConfig
from mlxd.errors import ConfigError

MAX_VALUE_CHARS = 72


class Setting(NamedTuple):
    table: str  # dotted ("model.sampling"); "" for top-level keys
    name: str
    value: Any
    origin: str  # "default", "file", "flag" or "model"

    def describe(self) -> str:
        where = f"[{self.table}] " if self.table else ""
        return f"{where}{self.name} = {format_value(self.value)}  ({self.origin})"


def effective_settings(struct: msgspec.Struct, raw: Mapping[str, Any], flags: Mapping[str, Any] | None = None,
                       table: str = "", model_sampling: Mapping[str, Any] | None = None) -> list[Setting]:
    """Every field of ``struct``, nested tables (struct-valued fields) walked in place.

    ``raw`` is the table as read from the file: a field it sets is ``file``, one it leaves out ``default``.
    ``flags`` holds dotted names (``server.port``) that a command-line flag set: those are ``flag``.
    ``model_sampling``: the model's own sampling defaults (``mlxd.models.generation_config.model_sampling``); the
    ``[model.sampling]`` fields the file leaves unset show their resolved value, ``model`` where the model set it.
    """
    settings = _walk(struct, raw, flags or {}, table)
    if not isinstance(struct, DaemonConfig):
        return settings
    resolved, origins = resolve_sampling(struct.model.sampling, model_sampling or {})
    return [Setting(s.table, s.name, getattr(resolved, s.name), origins[s.name])
            if s.table == "model.sampling" and s.name in origins else s for s in settings]


def _walk(struct: msgspec.Struct, raw: Mapping[str, Any], flags: Mapping[str, Any], table: str) -> list[Setting]:
    settings = []
    for field in msgspec.structs.fields(struct):
        value = getattr(struct, field.name)
        key = f"{table}.{field.name}" if table else field.name
        raw_value = raw.get(field.name)
        if isinstance(value, msgspec.Struct) and isinstance(raw_value, Mapping | None):
            settings.extend(_walk(value, raw_value or {}, flags, key))
        elif key in flags:
            settings.append(Setting(table, field.name, value, "flag"))
        else:
            settings.append(Setting(table, field.name, value, "file" if field.name in raw else "default"))
    return settings


def apply_flags(struct: msgspec.Struct, flags: Mapping[str, Any]) -> Any:
    """A copy of ``struct`` with each dotted name in ``flags`` (``server.port``) set to its value, checked as the
    config file's would be: a value out of range is a ``ConfigError`` naming the setting."""
    for key, value in flags.items():
        struct = _replace(struct, key.split("."), value, key)
    return struct


def _replace(struct: msgspec.Struct, path: list[str], value: Any, key: str) -> Any:
    head, *rest = path
    if rest:
        return msgspec.structs.replace(struct, **{head: _replace(getattr(struct, head), rest, value, key)})
    try:
        return msgspec.convert({**msgspec.to_builtins(struct), head: value}, type(struct), strict=True)
    except msgspec.ValidationError as e:
        raise ConfigError(f"flag for {key}: {str(e).split(' - at ')[0]}") from e


def format_value(value: Any) -> str:
    """TOML-like (strings quoted, ``true``/``false``, lists, inline tables), cut to one short line."""
    text = msgspec.json.encode(msgspec.to_builtins(value)).decode()
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"
