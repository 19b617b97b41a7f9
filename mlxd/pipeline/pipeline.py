"""Assembling stages from config tables, and running a request through them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from mlxd.config.load import convert
from mlxd.errors import ConfigError, PipelineError
from mlxd.pipeline.job import Job
from mlxd.pipeline.registry import resolve_stage
from mlxd.pipeline.stage import PipelineContext, Stage


class Pipeline:
    """An ordered list of stages. ``prepare`` runs them in order; ``stream`` chains their streams."""

    def __init__(self, stages: list[tuple[str, Stage]], source: str) -> None:
        self.stages = stages
        self.source = source

    def warm_up(self, ctx: PipelineContext) -> None:
        for _, stage in self.stages:
            stage.warm_up(ctx)

    def prepare(self, job: Job) -> Job:
        for _, stage in self.stages:
            stage.prepare(job)
        return job

    def stream(self, job: Job) -> AsyncIterator[Any]:
        events: AsyncIterator[Any] = _nothing()
        for _, stage in self.stages:
            events = stage.stream(job, events)
        return events

    def describe(self) -> str:
        lines = [f"pipeline from {self.source}:"]
        for i, (type_name, stage) in enumerate(self.stages):
            options = msgspec.to_builtins(stage.config)
            lines.append(f"  {i}. {type_name:<11} {options if options else ''}".rstrip())
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
    stages = []
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
        config = convert(options, cls.Config, f"{where} ({type_name})")
        stages.append((type_name, cls(config)))
    return Pipeline(stages, source)
