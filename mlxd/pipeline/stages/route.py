"""``route``: choose the model path and the decode mode of a request.

Path. ``vision``: the request has images (processed by ``template``); its prompt chunks run with the images'
features merged in, then it decodes in the same batch as everything else. ``text``: no images; the vision tower is
never touched, also on a vision model. (Images sent to a text model never get here: ``normalize`` refuses them,
naming the part.)

Decode mode (``[engine.speculative]``): ``Speculative(drafter, k)`` when a drafter is configured and the request
does not opt out (``"speculative": false``, or the config's ``default = false`` without ``"speculative": true``);
else ``Plain`` with the reason. Requests with images decode plain. Both, with the reason, are in the request's log line and ``/v1/status``.
"""

from __future__ import annotations

from mlxd.config.schema import SpeculativeConfig
from mlxd.engine.base import DecodeMode, Plain, Speculative
from mlxd.errors import PipelineError, RequestError
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import PipelineContext, Stage


class Route(Stage):
    name = "route"
    speculative = SpeculativeConfig()

    def warm_up(self, ctx: PipelineContext) -> None:
        self.speculative = ctx.config.engine.speculative

    def prepare(self, job: Job) -> None:
        if job.images and job.media is None:
            raise PipelineError("the request has images but the pipeline did not process them: put the `template` "
                                "stage before `route`")
        job.route = "vision" if job.media is not None else "text"
        job.decode = self._decode_mode(job)

    def _decode_mode(self, job: Job) -> DecodeMode:
        config, asked = self.speculative, job.speculative
        if config.drafter == "none":
            if asked:
                raise RequestError("this server has no drafter for speculative decoding ([engine.speculative] "
                                   "drafter = \"none\")", param="speculative")
            return Plain(reason="no drafter configured")
        if asked is False:
            return Plain(reason="the request asked for plain decoding")
        if asked is None and not config.default:
            return Plain(reason="speculation is off by default ([engine.speculative] default = false)")
        if job.route == "vision":
            return Plain(reason="requests with images decode plain")
        return Speculative(drafter=config.drafter, k=config.k, adaptive=config.adaptive)
