"""The composition root: config → model → engine → pipeline.

``Daemon`` is what the HTTP layer talks to. It imports MLX only inside :meth:`load`, which runs on a
background thread while the server already answers ``/health`` with 503.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.config.schema import DaemonConfig
from mlxd.errors import MlxdError, ModelNotFound, NotReady, Overloaded
from mlxd.log import get_logger
from mlxd.models.default_model import embedded_name
from mlxd.models.generation_config import with_model_sampling
from mlxd.pipeline.job import Job
from mlxd.pipeline.pipeline import Pipeline
from mlxd.pipeline.preparation import Preparation
from mlxd.pipeline.stage import ModelInfo, PipelineContext
from mlxd.runtime.cancel import CancelFlag
from mlxd.runtime.heap import PAUSES, freeze_loaded_objects

log = get_logger("mlxd.daemon")


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Tokens that never belong in content: the tokenizer's special tokens and added tokens marked special
    (chat markers such as ``<|im_start|>``), but not added tokens like ``<tool_call>`` that parsers need."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    marked = {token_id for token_id, token in added.items() if getattr(token, "special", False)}
    return frozenset(tokenizer.all_special_ids) | marked


class Daemon:
    """Owns the loaded model, the engine and the assembled pipeline, and the serving lifecycle.

    ``state``: ``loading`` → ``ready`` → ``draining`` (SIGTERM: running requests finish, new ones get 503) →
    ``stopped``; ``failed`` when the model could not load or the engine thread ended. ``on_fatal`` (set by
    whoever runs the server) is called with the reason on a failed load or a dead engine, from any thread: the
    process should then exit non-zero so that launchd or systemd restarts it.
    """

    def __init__(self, config: DaemonConfig, pipeline: Pipeline, base_dir: Path | None = None, *,
                 make_engine: Callable[[Any, Any, Any], Any] | None = None, group: Any = None,
                 freeze_heap: bool = False) -> None:
        """``make_engine(engine_config, model, drafter)`` builds the engine (``mlxd.engine.factory.make_engine`` by
        default; tests pass engines around test doubles). ``group``: the distributed group this process is rank 0
        of (``[distributed]``), None for one process. ``freeze_heap``: once loaded, freeze the Python objects
        start-up built (:mod:`mlxd.runtime.heap`); for the process that serves, not for one of many daemons in
        a test run."""
        self.config = config
        self.group = group
        self._make_engine = make_engine
        self.pipeline = pipeline
        self.base_dir = base_dir
        self.state = "loading"
        self.error: str | None = None
        self.engine: Any = None
        self.model_info: ModelInfo | None = None
        self.created = int(time.time())
        self.name = config.model.name or embedded_name(config.model.source) or Path(config.model.source).stem or "model"
        self._loader: threading.Thread | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self.load_s: float | None = None
        self._drain_deadline: float | None = None
        self.freeze_heap = freeze_heap
        self._failing = threading.Lock()
        server = config.server
        self.preparation = Preparation(server.prepare_workers or min(4, os.cpu_count() or 1))
        self.max_preparing = server.max_preparing  # 0: as many as the engine's queue holds (see prepare)
        # Bytes of rendered text that prove a prompt cannot fit the context (mlxd.api.validate); set once loaded.
        self.max_prompt_bytes = 0

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start_loading(self) -> None:
        """Load on a background thread; ``state`` becomes ``ready`` or ``failed``."""
        self._loader = threading.Thread(target=self._load_safely, name="mlxd-loader", daemon=True)
        self._loader.start()

    def wait_loaded(self, timeout: float | None = None) -> None:
        if self._loader is not None:
            self._loader.join(timeout)

    def _load_safely(self) -> None:
        try:
            self.load()
        except MlxdError as e:
            self._fail(e.message)
        except Exception as e:  # noqa: BLE001 - reported in state/health and the log, never swallowed
            log.exception("load_failed")
            self._fail(f"{type(e).__name__}: {e}")

    def _fail(self, message: str) -> None:
        self.state, self.error = "failed", message
        log.error("model_load_failed", error=message)
        self._fatal(message)

    def _engine_failed(self, reason: str) -> None:
        """Called on the engine thread when it ends for good: health turns 503, the process should exit. Once:
        whichever comes first, this or a request thread noticing the engine's recorded failure, tells ``on_fatal``."""
        with self._failing:
            if self.state == "failed" and self.error and self.error.startswith("the engine stopped"):
                return
            self.state, self.error = "failed", f"the engine stopped: {reason}"
        self._fatal(self.error)

    def _fatal(self, reason: str) -> None:
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def load(self) -> None:
        """Load the model, start and warm the engine, warm the pipeline's stages (blocking); then ``ready``."""
        started = time.monotonic()
        loaded = self._load_model()
        self._start_engine(loaded)
        self.model_info = self._model_info(loaded)
        self.max_prompt_bytes = prompt_bytes_bound(loaded.context_length, loaded.tokenizer)
        self._warm_up_pipeline(loaded)
        self.load_s = time.monotonic() - started
        self._become_ready(loaded, started)

    def _load_model(self) -> Any:
        """The model, its tokenizer and processor, on the served device; the config then takes the model's own
        sampling defaults where ``[model.sampling]`` leaves them open."""
        from mlxd.models.load import load

        loaded = load(self.config.model, self.base_dir, group=self.group)
        self.config = with_model_sampling(self.config, loaded.path)  # [model.sampling] > the model's > mlxd's
        return loaded

    def _start_engine(self, loaded: Any) -> None:
        """Build the engine for the loaded model and start its thread (it warms up there); a dead engine later
        calls :meth:`_engine_failed`."""
        self.engine = self._new_engine(loaded)
        self.engine.on_failure = self._engine_failed
        self.engine.start()

    def _model_info(self, loaded: Any) -> ModelInfo:
        """What the pipeline's stages know of the model."""
        tokenizer = loaded.tokenizer
        return ModelInfo(
            name=self.name,
            context_length=loaded.context_length,
            eos_token_ids=frozenset(tokenizer.eos_token_ids),
            special_token_ids=special_token_ids(tokenizer),
            kind=loaded.kind,
            vocab_size=self.engine.vocab_size,  # the logits width, measured at warm-up
            image_token_id=getattr(loaded.model, "image_token_id", None),
        )

    def _warm_up_pipeline(self, loaded: Any) -> None:
        """Warm the pipeline's stages; for a vision model, bound Pillow's decoder first and send the warm-up
        images through afterwards."""
        from mlxd.runtime.progress import phase

        if loaded.kind == "vision":
            from mlxd.media.images import bound_pillow

            bound_pillow(self.config.vision.max_decode_pixels)
        with phase("pipeline_warm_up", stages=[name for name, _ in self.pipeline.stages]):
            self.pipeline.warm_up(PipelineContext(self.config, self.model_info, loaded.tokenizer, self.engine,
                                                  processor=loaded.processor, base_dir=self.base_dir))
        if loaded.kind == "vision":
            self._warm_up_images()

    def _become_ready(self, loaded: Any, started: float) -> None:
        """Settle the heap, turn ``ready`` (unless failed or draining meanwhile) and log ``model_ready``."""
        from mlxd.models.load import platform_summary
        from mlxd.runtime.blas import mapped_blas, reference_blas_warning

        PAUSES.install()
        frozen = freeze_loaded_objects() if self.freeze_heap else None
        if self.state == "loading":
            self.state = "ready"
        blas, summary = mapped_blas(), platform_summary()
        log.info(
            "model_ready",
            model=self.name,
            path=str(loaded.path),
            dtype=loaded.dtype,
            context_length=loaded.context_length,
            blas=blas,
            load_s=round(time.monotonic() - started, 2),
            frozen_objects=frozen,
            **summary,
        )
        if (warning := reference_blas_warning(loaded.dtype, summary["device"], blas)) is not None:
            log.warning("reference_blas", message=warning)

    def _new_engine(self, loaded: Any) -> Any:
        """The engine for the loaded model: a distributed leader under ``[distributed]``, else ``make_engine``'s
        (with the configured drafter)."""
        from mlxd.engine.drafters.registry import make_drafter
        from mlxd.engine.factory import make_engine as default_make_engine

        if self.config.model.kind == "embedding":  # pooled vectors at /v1/embeddings, no token generation
            from mlxd.engine.embedding import make_embedding_engine

            return make_embedding_engine(self.config.model, self.config.engine, loaded, self.name)
        if self.group is not None:
            from mlxd.engine.distributed.channel import Channel
            from mlxd.engine.distributed.leader import make_leader_engine

            return make_leader_engine(loaded.model, self.config.engine, channel=Channel(self.group),
                                      settings=self.config.distributed)
        drafter = make_drafter(self.config.engine.speculative, loaded.model, loaded.path, self.base_dir)
        return (self._make_engine or default_make_engine)(self.config.engine, loaded.model, drafter)

    def _warm_up_images(self) -> None:
        """One image request and its second turn per ``[vision] warm_up_image_sizes`` through the pipeline
        (:mod:`mlxd.pipeline.image_warmup`); a model or a config that cannot take them is logged, not fatal: text
        is still served."""
        from mlxd.pipeline.image_warmup import warm_up_image

        for size in self.config.vision.warm_up_image_sizes:
            try:
                seconds, cached = warm_up_image(self.pipeline, self.name, size)
            except MlxdError as e:
                log.warning("image_warm_up_failed", size=size, error=e.message)
                return
            log.info("image_warm_up", size=size, seconds=round(seconds, 2), turn_2_cached_tokens=cached)

    def close(self) -> None:
        """Stop the engine (ending whatever still runs) and log the ``shutdown`` line."""
        totals = dict(self.engine.totals) if self.engine is not None else {}
        self.preparation.close()
        if self.engine is not None:
            self.engine.stop()
        previous, self.state = self.state, "stopped"
        log.info("shutdown", previous_state=previous, error=self.error, **totals)

    async def prepare(self, job: Job, flag: CancelFlag, until: str | None = None) -> Job:
        """Run the pipeline's ``prepare`` (up to the stage named ``until``) on a preparation worker.

        Requests waiting for or in preparation count against the queue: beyond ``[server] max_preparing``, or
        when they and the engine's requests fill ``[engine] max_running + max_waiting``, a newcomer gets
        ``Overloaded`` (429 with ``Retry-After``) before any work. ``flag`` stops the work at its next check."""
        engine, preparation = self.engine, self.preparation
        num_preparing = preparation.num_preparing
        num_engine = engine.num_active if engine is not None else 0
        # max_running as the engine resolved it (0 in the config: derived from the memory budget at warm-up).
        max_running = engine.max_running if engine is not None else self.config.engine.max_running
        capacity = max(max_running, 1) + self.config.engine.max_waiting
        max_preparing = self.max_preparing or capacity
        if num_preparing >= max_preparing or num_preparing + num_engine >= capacity:
            retry_after = max(engine.retry_after_s() if engine is not None else 1.0, preparation.estimate_s())
            raise Overloaded(f"{num_preparing} requests are being prepared (at most {max_preparing}) and "
                             f"{num_engine} are in the engine (at most {capacity} in all); retry shortly",
                             retry_after=retry_after)
        args = (job,) if until is None else (job, until)  # a plain prepare(job) for whoever wraps the pipeline
        return await preparation.submit(self.pipeline.prepare, *args, flag=flag)

    def size_limits(self) -> dict[str, int]:
        """The bounds ``mlxd.api.validate.check_size`` checks a body against (no text bound before loading)."""
        return {"max_prompt_bytes": self.max_prompt_bytes, "max_messages": self.config.server.max_messages,
                "context_length": self.model_info.context_length if self.model_info is not None else 0}

    def _num_busy(self) -> int:
        return (self.engine.num_active if self.engine is not None else 0) + self.preparation.num_preparing

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests (503 with ``Retry-After``) and let running ones (in preparation or in the engine)
        finish within ``timeout_s``; then end the rest with a final error event. Logs a ``drain`` line when it
        starts and when it ends."""
        started = time.monotonic()
        if self.state in ("loading", "ready"):
            self.state = "draining"
        self._drain_deadline = started + timeout_s
        engine = self.engine
        num_active, num_preparing = self._num_busy(), self.preparation.num_preparing
        log.info("drain", phase="start", num_active=num_active, num_preparing=num_preparing, timeout_s=timeout_s)
        while self._num_busy() and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.05)
        num_unprepared = self.preparation.cancel_all(
            f"the server is shutting down: the request was not prepared within the drain timeout ({timeout_s:g} s); "
            "retry it")
        num_aborted = (engine.num_active if engine is not None else 0) + num_unprepared
        if engine is not None and engine.num_active:
            engine.abort_all(f"the server is shutting down: the request did not finish within the drain timeout "
                             f"({timeout_s:g} s); retry it")
            # The final frames reach the clients once the engine has sent the events.
            settle = time.monotonic() + 5
            while engine.num_active and time.monotonic() < settle:
                await asyncio.sleep(0.02)
        if num_unprepared:  # their requests answer once their workers reach a check; a stuck one is not waited for
            await asyncio.sleep(0.2)
        log.info("drain", phase="done", num_finished=max(0, num_active - num_aborted), num_aborted=num_aborted,
                 drain_s=round(time.monotonic() - started, 3))

    def require_loaded(self) -> None:
        """For operational endpoints: the engine exists (ready or draining)."""
        if self.state not in ("ready", "draining"):
            self.require_ready()

    def require_ready(self) -> None:
        """For generation endpoints: raise ``NotReady`` (503 with ``Retry-After``) unless serving."""
        self._notice_engine_failure()
        if self.state == "ready":
            return
        if self.state == "failed":
            raise NotReady(f"the server cannot serve: {self.error}", retry_after=self._restart_s())
        if self.state in ("draining", "stopped"):
            remaining = max(0.0, (self._drain_deadline or time.monotonic()) - time.monotonic())
            raise NotReady("the server is shutting down; retry shortly", retry_after=remaining + self._restart_s())
        raise NotReady("the model is still loading; retry when GET /health returns 200", retry_after=5.0)

    def _notice_engine_failure(self) -> None:
        """The engine records why it ended before it tells anyone (its requests, then ``on_failure``): a client
        that saw its request fail may ask ``/health`` before ``on_failure`` has run, and must hear the same."""
        failure = getattr(self.engine, "failure", None) if self.state == "ready" else None
        if failure is not None:
            self._engine_failed(failure)

    def _restart_s(self) -> float:
        """How long a restarted daemon takes to serve again: this one's load time, when known."""
        return self.load_s if self.load_s is not None else 5.0

    def health(self) -> tuple[int, dict[str, Any], float | None]:
        """``/health``: (status code, body, seconds for ``Retry-After``); 200 only while serving."""
        self._notice_engine_failure()
        body: dict[str, Any] = {"status": self.state, "model": self.name}
        if self.error:
            body["error"] = self.error
        if self.engine is not None and self.state in ("ready", "draining"):
            body["num_active"] = self.engine.num_active
            body["num_preparing"] = self.preparation.num_preparing  # requests being prepared, not yet in the engine
        try:
            self.require_ready()
        except NotReady as e:
            return 503, body, e.retry_after
        return 200, body, None

    def served_names(self) -> list[str]:
        return [self.name]

    def resolve_model(self, requested: str) -> str:
        """Map a request's ``model`` to the served name (exact name or an alias glob), else 404."""
        if requested in (self.name, self.config.model.source) or any(fnmatch.fnmatchcase(requested, p)
                                                                      for p in self.config.model.aliases):
            return self.name
        aliases = f" or a name matching {self.config.model.aliases}" if self.config.model.aliases else ""
        shown = requested if len(requested) <= 64 else requested[:64] + "…"  # never echo a huge value back
        raise ModelNotFound(f"model {shown!r} is not served here; use {self.name!r}{aliases}", param="model")


def prompt_bytes_bound(context_length: int, tokenizer: Any) -> int:
    """Bytes of rendered text that cannot fit in ``context_length`` tokens: no token stands for more text than its
    vocabulary entry's UTF-8 bytes, and a normalizer such as NFKC folds at most 4 bytes of input into 1 (the
    template stage refuses on the same bound, after rendering)."""
    from mlxd.pipeline.stages.template import max_token_bytes

    return context_length * max_token_bytes(tokenizer) * 4


def run_follower(config: DaemonConfig, group: Any, base_dir: Path | None = None) -> int:
    """A rank other than 0 of a ``[distributed]`` job: load this rank's shard and run rank 0's steps until it
    stops (0). Exits non-zero (1) when the group breaks or the ranks disagree. It ignores SIGTERM and SIGINT: the
    job ends through rank 0, which drains first and then tells every rank to stop."""
    import signal

    from mlxd.engine.distributed.channel import Channel
    from mlxd.engine.distributed.follower import Follower
    from mlxd.models.load import load

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    rank = group.rank()
    try:
        loaded = load(config.model, base_dir, group=group)
        follower = Follower(loaded.model, config.engine, channel=Channel(group), settings=config.distributed)
        code = follower.run()
    except MlxdError as e:
        log.error("follower_failed", rank=rank, error=e.message)
        return 1
    except Exception as e:  # noqa: BLE001 - the job must end; why goes to the log
        log.error("follower_failed", rank=rank, error_type=type(e).__name__, error=str(e))
        return 1
    log.info("shutdown", rank=rank, reason="rank 0 stopped the job")
    return code
