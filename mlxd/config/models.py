"""The models a config serves, as one list: ``[model]`` alone is a one-model config, ``[models.NAME]`` tables are
several. Everything that needs to know which models there are reads :func:`served_models`; nothing else looks at
``[model]`` or ``[models]`` to count them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from mlxd.config.schema import DaemonConfig, ModelConfig, ServedModelConfig
from mlxd.errors import ConfigError

_MODEL_FIELDS = ModelConfig.__struct_fields__


class ServedModel(msgspec.Struct, frozen=True, kw_only=True):
    """One configured model: its served name, the daemon config as that model sees it (``model``, ``engine`` and
    ``pipeline`` are its own; ``server``, ``vision``, ``logging`` are shared) and its loading policy."""

    name: str
    config: DaemonConfig
    load: Literal["at_start", "on_request"]
    idle_unload_s: float = 0.0
    pin: bool = False
    table: str = "model"  # where it is configured, for messages: "model" or "models.NAME"


def served_models(config: DaemonConfig) -> list[ServedModel]:
    """Every configured model, the first one first. ``[model]`` is one model loaded at start, never unloaded."""
    if not config.models:
        assert config.model is not None  # load_config refuses a config with neither
        return [ServedModel(name=default_name(config.model), config=_view(config, config.model, {}),
                            load="at_start", pin=True)]
    return [_entry(config, key, table, first=i == 0) for i, (key, table) in enumerate(config.models.items())]


def _entry(config: DaemonConfig, key: str, table: ServedModelConfig, *, first: bool) -> ServedModel:
    model = ModelConfig(**{field: getattr(table, field) for field in _MODEL_FIELDS})
    model = msgspec.structs.replace(model, name=table.name or key)
    overrides = {"engine": table.engine} if table.engine is not None else {}
    if table.pipeline is not None:
        overrides["pipeline"] = table.pipeline
    load = table.load if table.load != "default" else ("at_start" if first else "on_request")
    return ServedModel(name=model.name, config=_view(config, model, overrides), load=load,
                       idle_unload_s=table.idle_unload_s, pin=table.pin, table=f"models.{key}")


def _view(config: DaemonConfig, model: ModelConfig, overrides: dict) -> DaemonConfig:
    return msgspec.structs.replace(config, model=model, models={}, **overrides)


def default_name(model: ModelConfig) -> str:
    """The served name of a ``[model]``: ``name``, else the embedded model's name, else the source's stem."""
    from pathlib import Path

    from mlxd.models.default_model import embedded_name

    return model.name or embedded_name(model.source) or Path(model.source).stem or "model"


def normalise(config: DaemonConfig, source: str) -> DaemonConfig:
    """Check ``[model]`` against ``[models.*]`` and give a ``[models.*]`` config its first model as ``model`` (what
    single-model tools such as device selection read). ``ConfigError`` names ``source`` and the field."""
    if config.model is not None and config.models:
        raise ConfigError(f"{source}: model: give one [model] table or [models.NAME] tables, not both")
    if config.model is None and not config.models:
        raise ConfigError(f"{source}: Object missing required table `model`; give [model] (or [models.NAME] tables) "
                          "with a source")
    if config.distributed is not None:
        check_distributed(config, source)
    if not config.models:
        return config
    seen: dict[str, str] = {}
    for (key, table), served in zip(config.models.items(), served_models(config), strict=True):
        if served.name in seen:
            raise ConfigError(f"{source}: {served.table}.name: {served.name!r} is also the name of {seen[served.name]}")
        seen[served.name] = served.table
        if len(config.models) > 1 and served.config.engine.vision_encoder_thread:
            where = f"models.{key}.engine" if table.engine is not None else "engine"
            raise ConfigError(f"{source}: {where}.vision_encoder_thread: the encoder thread runs a vision tower "
                              "outside the device's turn, which several models take one at a time; set it to false "
                              "or serve the model alone")
    return msgspec.structs.replace(config, model=served_models(config)[0].config.model)


def check_distributed(config: DaemonConfig, source: str) -> None:
    """What a ``[distributed]`` job cannot serve: several models, or an embedding model (its engine pools vectors
    in one process; the ranks of a job run a generating model's steps together). ``ConfigError`` names the field."""
    if len(config.models) > 1:
        raise ConfigError(f"{source}: models: a [distributed] job serves one model; {len(config.models)} are "
                          "configured")
    [served] = served_models(config)
    if served.config.model.kind == "embedding":
        raise ConfigError(f"{source}: {served.table}.kind: an embedding model (kind = \"embedding\") is not served by "
                          "a [distributed] job, whose ranks run a generating model's steps together; serve it from a "
                          "daemon without [distributed]")


def model_settings(config: DaemonConfig, raw: Mapping[str, Any],
                   samplings: Mapping[str, Mapping[str, Any]]) -> list[Any]:
    """What ``check-config`` shows of each model of a ``[models.NAME]`` config, each setting with where it came from
    (:class:`mlxd.config.effective.Setting`): its ``[models.NAME]`` fields and loading policy, its sampling defaults
    resolved against the model's own (``samplings``, by served name), its pipeline, and its own engine table when
    it has one (the others share the top-level ``[engine]``, shown once)."""
    from mlxd.config.effective import Setting, effective_settings

    settings: list[Setting] = []
    tables = raw.get("models", {})
    for key, served in zip(config.models, served_models(config), strict=True):
        own = tables.get(key, {})
        seen = {"model": own, "engine": own.get("engine", {}), **({"pipeline": own["pipeline"]} if "pipeline" in own
                                                                   else {})}
        for setting in effective_settings(served.config, seen, model_sampling=samplings.get(served.name)):
            table = _model_table(setting, key, own_engine="engine" in own)
            if table is not None:
                settings.append(setting._replace(table=table))
        for field in ("load", "idle_unload_s", "pin"):
            settings.append(Setting(f"models.{key}", field, getattr(served, field), "file" if field in own
                                    else "default"))
    return settings


def _model_table(setting: Any, key: str, *, own_engine: bool) -> str | None:
    """Where a setting of one model's config view lives in a ``[models.NAME]`` config; None: a shared table."""
    table = setting.table
    if table == "model" or table.startswith("model."):
        return f"models.{key}{table[len('model'):]}"
    if own_engine and (table == "engine" or table.startswith("engine.")):
        return f"models.{key}.{table}"
    return f"models.{key}" if table == "" and setting.name == "pipeline" else None


def shared_setting(setting: Any) -> bool:
    """Whether a setting of a ``[models.NAME]`` config's own walk is shared by its models (``[server]``,
    ``[engine]`` ...), not one that :func:`model_settings` shows per model."""
    table = setting.table
    return not (table == "model" or table.startswith("model.") or (table == "" and setting.name in ("models",
                                                                                                   "pipeline")))
