"""``route``: choose the model path for a request.

``vision``: the request has images (processed by ``template``); its prompt chunks run with the images' features
merged in, then it decodes in the same batch as everything else. ``text``: no images; the vision tower is never
touched, also on a vision model. The route is in the request's log line and in ``/v1/status``.
"""

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
        if job.num_images and job.media is None:
            raise RequestError("the request has images but the pipeline did not process them: put the `template` "
                               "stage before `route`", param="messages")
        job.route = "vision" if job.media is not None else "text"
