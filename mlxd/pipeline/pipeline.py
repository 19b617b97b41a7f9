"""Assembling stages from config tables, and running a request through them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from mlxd.config.effective import effective_settings, format_value
from mlxd.config.load import convert
from mlxd.errors import ConfigError, PipelineError
from mlxd.pipeline.job import Job
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
        """One line per stage with each option's effective value and whether the pipeline file set it."""
        lines = [f"pipeline from {self.source}:"]
        for i, ((type_name, stage), raw) in enumerate(zip(self.stages, self.options, strict=True)):
            options = ", ".join(f"{s.name} = {format_value(s.value)} ({s.origin})"
                                for s in effective_settings(stage.config, raw))
            lines.append(f"  {i}. {type_name:<11} {options}".rstrip())
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
    return Pipeline(stages, source, all_options)
