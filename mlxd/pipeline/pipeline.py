"""Assembling stages from config tables, and running a request through them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from mlxd.config.effective import effective_settings, format_value
from mlxd.config.load import convert
from mlxd.errors import ConfigError, PipelineError
from mlxd.pipeline.job import JOB_FIELDS, REQUEST_FIELDS, Job
from mlxd.pipeline.registry import resolve_stage
from mlxd.pipeline.stage import PipelineContext, Stage
from mlxd.runtime.cancel import check_cancelled


class Pipeline:
    """An ordered list of stages. ``prepare`` runs them in order; ``stream`` chains their streams."""

    def __init__(self, stages: list[tuple[str, Stage]], source: str,
                 options: list[dict[str, Any]] | None = None) -> None:
        self.stages = stages
        self.source = source
        # Each stage's options as written in the pipeline file, to tell set values from defaults.
        self.options = options if options is not None else [{} for _ in stages]

    def warm_up(self, ctx: PipelineContext) -> None:
        for _, stage in self.stages:
            stage.warm_up(ctx)

    def prepare(self, job: Job, until: str | None = None) -> Job:
        """Run the stages' ``prepare`` in order (blocking: on a preparation worker), or only those before the
        first stage of type ``until`` (counting tokens runs up to ``prefill``). Between stages, a request whose
        preparation was cancelled (its client left) stops here (:func:`~mlxd.runtime.cancel.check_cancelled`)."""
        stages = self.stages
        if until is not None:
            names = [name for name, _ in stages]
            if until not in names:
                raise PipelineError(f"the pipeline has no `{until}` stage ({self.source})")
            stages = stages[: names.index(until)]
        for _, stage in stages:
            check_cancelled()
            stage.prepare(job)
        check_cancelled()
        return job

    def stream(self, job: Job) -> AsyncIterator[Any]:
        events: AsyncIterator[Any] = _nothing()
        for _, stage in self.stages:
            events = stage.stream(job, events)
        return events

    def describe(self) -> str:
        """Per stage: each option's effective value and whether the pipeline file set it, then the Job fields the
        stage needs from earlier stages (request fields left out) and those it provides."""
        lines = [f"pipeline from {self.source}:"]
        for i, ((type_name, stage), raw) in enumerate(zip(self.stages, self.options, strict=True)):
            options = ", ".join(f"{s.name} = {format_value(s.value)} ({s.origin})"
                                for s in effective_settings(stage.config, raw))
            lines.append(f"  {i}. {type_name:<11} {options}".rstrip())
            needs, provides = declared(stage, "needs") - REQUEST_FIELDS, declared(stage, "provides")
            if needs or provides:
                lines.append(f"     {'':<11} needs {', '.join(sorted(needs)) or '-'}; "
                             f"provides {', '.join(sorted(provides)) or '-'}")
        return "\n".join(lines)


async def _nothing() -> AsyncIterator[Any]:
    return
    yield  # pragma: no cover - makes this an async generator


def build_pipeline(tables: list[dict[str, Any]], source: str) -> Pipeline:
    """Resolve each table's ``type`` and validate the rest against that stage's ``Config``.

    Errors name ``source``, the stage index and the field.
    """
    if not tables:
        raise ConfigError(f"{source}: the pipeline has no stages")
    stages, all_options = [], []
    for index, table in enumerate(tables):
        type_name = table.get("type")
        where = f"{source}: stage {index}"
        if not isinstance(type_name, str):
            raise ConfigError(f"{where}: missing or non-string `type`")
        try:
            cls = resolve_stage(type_name)
        except PipelineError as e:
            raise ConfigError(f"{where}: {e.message}") from e
        options = {k: v for k, v in table.items() if k != "type"}
        for option, new_place in getattr(cls, "moved_options", {}).items():
            if option in options:
                raise ConfigError(f"{where} ({type_name}): {option}: no longer a stage option; set {new_place}")
        config = convert(options, cls.Config, f"{where} ({type_name})")
        stages.append((type_name, cls(config)))
        all_options.append(options)
    check_order(stages, source)
    return Pipeline(stages, source, all_options)


def declared(stage: object, kind: str) -> frozenset[str]:
    """A stage's ``needs`` or ``provides`` (none for a stage that declares nothing)."""
    value = getattr(stage, kind, None) or ()
    if isinstance(value, str) or not all(isinstance(name, str) for name in value):
        raise ConfigError(f"`{kind}` of stage {type(stage).__name__} must be a set of Job field names, "
                          f"not {value!r}")
    return frozenset(value)


def check_order(stages: list[tuple[str, Stage]], source: str) -> None:
    """Every field a stage needs is a request field or provided by an earlier stage; every declared field is a
    field of :class:`Job`. ``ConfigError`` names ``source``, the stage and the field, and the later stage that
    provides it, if one does."""
    declarations = []
    for index, (type_name, stage) in enumerate(stages):
        where = f"{source}: stage {index} ({type_name})"
        try:
            needs, provides = declared(stage, "needs"), declared(stage, "provides")
        except ConfigError as e:
            raise ConfigError(f"{where}: {e.message}") from e
        unknown = sorted((needs | provides) - JOB_FIELDS)
        if unknown:
            raise ConfigError(f"{where}: declares {', '.join(unknown)}, not a field of Job "
                              f"(fields: {', '.join(sorted(JOB_FIELDS))})")
        declarations.append((where, needs, provides))
    available = set(REQUEST_FIELDS)
    for index, (where, needs, provides) in enumerate(declarations):
        missing = sorted(needs - available)
        if missing:
            raise ConfigError(f"{where}: needs {_fields_and_providers(missing, stages, declarations, index)}")
        available |= provides


def _fields_and_providers(missing: list[str], stages: list[tuple[str, Stage]],
                          declarations: list[tuple[str, frozenset[str], frozenset[str]]], index: int) -> str:
    """``Job.a, Job.b, which no earlier stage provides (…)``, saying which later stage provides each, if one does."""
    notes = []
    for name in missing:
        providers = [f"stage {later} ({stages[later][0]})" for later in range(index + 1, len(stages))
                     if name in declarations[later][2]]
        notes.append(f"the later {providers[0]} provides Job.{name}: move that stage before this one" if providers
                     else f"no stage of this pipeline provides Job.{name}")
    return f"{', '.join(f'Job.{name}' for name in missing)}, which no earlier stage provides ({'; '.join(notes)})"
