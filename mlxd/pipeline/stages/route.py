"""``route``: decide how the engine runs a request: its path (text or vision) and its decode mode (plain, or
speculative with the configured drafter: prompt lookup, a draft model or the checkpoint's MTP heads).

The decision travels on the engine request (``EngineRequest.route`` and ``EngineRequest.decode``, put there by
``decode``) and the engine acts on it rather than deciding again: a ``vision`` request has its images encoded
(the vision tower) and their features merged into its prompt chunks, then decodes in the same batch as everything
else; a ``text`` request never touches the vision tower, also on a vision model; a ``Speculative`` request drafts
with the drafter it names (the engine refuses a name other than its drafter's), a ``Plain`` one never drafts.

Path. ``vision`` when the request has images (processed by ``template``: ``Job.media``), else ``text``. Images
sent to a text model never get here: ``normalize`` refuses them, naming the part.

Decode mode (``[engine.speculative]``): ``Speculative(drafter, k)`` when a drafter is configured and the request
does not opt out (``"speculative": false``, or the config's ``default = false`` without ``"speculative": true``);
else ``Plain`` with the reason. Requests with images decode plain. Both, with the reason, are in the request's log
line and ``/v1/status``.
"""

from __future__ import annotations

from mlxd.config.schema import SpeculativeConfig
from mlxd.engine.base import DecodeMode, Plain, Speculative
from mlxd.errors import PipelineError, RequestError
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import PipelineContext, Stage

TEXT, VISION = "text", "vision"


class Route(Stage):
    name = "route"
    needs = frozenset({"media", "speculative"})
    provides = frozenset({"route", "decode"})
    speculative = SpeculativeConfig()

    def warm_up(self, ctx: PipelineContext) -> None:
        self.speculative = ctx.config.engine.speculative

    def prepare(self, job: Job) -> None:
        if job.images and job.media is None:  # a third-party stage in place of `template` that skips images
            raise PipelineError("the request has images but the pipeline did not process them for the model")
        job.route = VISION if job.media is not None else TEXT
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
        if job.route == VISION:
            return Plain(reason="requests with images decode plain")
        return Speculative(drafter=config.drafter, k=config.k, adaptive=config.adaptive)
