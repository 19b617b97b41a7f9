"""``route``: choose the model path for a request.

``vision``: the request has images (processed by ``template``); its prompt chunks run with the images' features
merged in, then it decodes in the same batch as everything else. ``text``: no images; the vision tower is never
touched, also on a vision model. The route is in the request's log line and in ``/v1/status``. (Images sent to a
text model never get here: ``normalize`` refuses them, naming the part.)
"""

from __future__ import annotations

from mlxd.errors import PipelineError
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import Stage


class Route(Stage):
    name = "route"

    def prepare(self, job: Job) -> None:
        if job.images and job.media is None:
            raise PipelineError("the request has images but the pipeline did not process them: put the `template` "
                                "stage before `route`")
        job.route = "vision" if job.media is not None else "text"
