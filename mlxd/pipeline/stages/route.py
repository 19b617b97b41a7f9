"""``route``: choose the model path for a request (text only for now; vision joins with its issue)."""

from __future__ import annotations

from mlxd.errors import RequestError
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import PipelineContext, Stage


class Route(Stage):
    name = "route"

    def warm_up(self, ctx: PipelineContext) -> None:
        self.model = ctx.model

    def prepare(self, job: Job) -> None:
        if job.num_images and self.model.kind != "vision":
            raise RequestError(
                f"model {self.model.name!r} is a text model and does not accept images "
                f"({job.num_images} image part(s) in the request)",
                param="messages",
            )
        job.route = "vision" if job.num_images else "text"
