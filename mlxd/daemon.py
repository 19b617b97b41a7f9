"""The composition root: config → model → engine → pipeline.

``Daemon`` is what the HTTP layer talks to. It imports MLX only inside :meth:`load`, which runs on a
background thread while the server already answers ``/health`` with 503.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.config.models import served_models
from mlxd.config.schema import DaemonConfig
from mlxd.errors import MlxdError, NotReady
from mlxd.log import get_logger
from mlxd.model_slot import SlotHooks
from mlxd.model_slot import special_token_ids as special_token_ids  # where callers have found it
from mlxd.pipeline.pipeline import Pipeline
from mlxd.pipeline.preparation import Preparation
from mlxd.pipeline.stage import ModelInfo
from mlxd.registry import ModelRegistry, pipeline_path
from mlxd.runtime.device_turn import DeviceTurn
from mlxd.runtime.heap import PAUSES, freeze_loaded_objects

log = get_logger("mlxd.daemon")


class Daemon:
    """The serving lifecycle over the daemon's models (:class:`mlxd.registry.ModelRegistry`, ``models``).

    ``state``: ``loading`` → ``ready`` → ``draining`` (SIGTERM: running requests finish, new ones get 503) →
    ``stopped``; ``failed`` when a model loaded at start could not load or an engine thread ended. ``on_fatal`` (set
    by whoever runs the server) is called with the reason on a failed load or a dead engine, from any thread: the
    process should then exit non-zero so that launchd or systemd restarts it. ``engine``, ``pipeline``,
    ``model_info`` and ``name`` are the first model's (what one-model callers read).
    """

    def __init__(self, config: DaemonConfig, pipeline: Pipeline, base_dir: Path | None = None, *,
                 make_engine: Callable[[Any, Any, Any], Any] | None = None, group: Any = None,
                 freeze_heap: bool = False) -> None:
        """``pipeline``: the first model's, assembled (the others are assembled from the config when they load).
        ``make_engine(engine_config, model, drafter)`` builds each engine (``mlxd.engine.factory.make_engine`` by
        default; tests pass engines around test doubles). ``group``: the distributed group this process is rank 0
        of (``[distributed]``), None for one process. ``freeze_heap``: once loaded, freeze the Python objects
        start-up built (:mod:`mlxd.runtime.heap`); for the process that serves, not for one of many daemons in
        a test run."""
        self.group = group
        self.base_dir = base_dir
        self.state = "loading"
        self.error: str | None = None
        self.created = int(time.time())
        self._loader: threading.Thread | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self.load_s: float | None = None
        self._drain_deadline: float | None = None
        self.freeze_heap = freeze_heap
        self._failing = threading.Lock()
        server = config.server
        self.preparation = Preparation(server.prepare_workers or min(4, os.cpu_count() or 1))
        served = served_models(config)
        hooks = SlotHooks(base_dir=base_dir, group=group, make_engine=make_engine,
                          turn=DeviceTurn() if len(served) > 1 else None, preparation=self.preparation,
                          max_preparing=server.max_preparing, make_pipeline=self._make_pipeline,
                          on_engine_failure=self._slot_failed)
        self.models = ModelRegistry(served, hooks, first_pipeline=pipeline, budget=server.models_memory_bytes,
                                    gate=self.require_ready)

    # The first model's parts, for one-model callers.

    @property
    def config(self) -> DaemonConfig:
        return self.models.first.config

    @property
    def name(self) -> str:
        return self.models.first.name

    @property
    def engine(self) -> Any:
        return self.models.first.engine

    @property
    def pipeline(self) -> Pipeline | None:
        return self.models.first.pipeline

    @property
    def model_info(self) -> ModelInfo | None:
        return self.models.first.model_info

    @property
    def max_prompt_bytes(self) -> int:
        return self.models.first.max_prompt_bytes

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def _make_pipeline(self, config: DaemonConfig) -> Pipeline:
        from mlxd.assemble import model_pipeline

        return model_pipeline(config, pipeline_path(self.base_dir))

    def start_loading(self) -> None:
        """Load the models loaded at start on a background thread; ``state`` becomes ``ready`` or ``failed``.
        Called on the event loop, it also starts unloading idle models (``idle_unload_s``)."""
        self._loader = threading.Thread(target=self._load_safely, name="mlxd-loader", daemon=True)
        self._loader.start()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self.models.start_reaper()

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

    def _slot_failed(self, slot: Any, reason: str) -> None:
        """A model's engine thread ended for good (on that thread): the model fails, and so does the daemon."""
        slot.state, slot.error = "failed", f"the engine stopped: {reason}"
        self._engine_failed(reason)

    def _engine_failed(self, reason: str) -> None:
        """Called when an engine ends for good: health turns 503, the process should exit. Once: whichever comes
        first, this or a request thread noticing the engine's recorded failure, tells ``on_fatal``."""
        with self._failing:
            if self.state == "failed" and self.error and self.error.startswith("the engine stopped"):
                return
            self.state, self.error = "failed", f"the engine stopped: {reason}"
        self._fatal(self.error)

    def _fatal(self, reason: str) -> None:
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def load(self) -> None:
        """Load the models loaded at start (each: model, engine, pipeline; blocking); then ``ready``."""
        started = time.monotonic()
        self.models.load_at_start()
        self.load_s = time.monotonic() - started
        self._become_ready(started)

    def _become_ready(self, started: float) -> None:
        """Settle the heap, turn ``ready`` (unless failed or draining meanwhile) and log ``model_ready``."""
        from mlxd.models.load import platform_summary
        from mlxd.runtime.blas import mapped_blas, reference_blas_warning

        PAUSES.install()
        frozen = freeze_loaded_objects() if self.freeze_heap else None
        if self.state == "loading":
            self.state = "ready"
        blas, summary = mapped_blas(), platform_summary()
        loaded = next((slot for slot in self.models.slots if slot.state == "ready"), self.models.first)
        log.info("model_ready", model=loaded.name, **loaded.summary, blas=blas,
                 load_s=round(time.monotonic() - started, 2), frozen_objects=frozen, **summary)
        if (warning := reference_blas_warning(loaded.summary.get("dtype"), summary["device"], blas)) is not None:
            log.warning("reference_blas", message=warning)

    def close(self) -> None:
        """Stop every engine (ending whatever still runs) and log the ``shutdown`` line (the first model's totals)."""
        self.models.stop_reaper()
        totals = dict(self.engine.totals) if self.engine is not None else {}
        self.preparation.close()
        for slot in self.models.slots:
            if slot.engine is not None:
                slot.engine.stop()
        previous, self.state = self.state, "stopped"
        log.info("shutdown", previous_state=previous, error=self.error, **totals)

    def _engines(self) -> list[Any]:
        return [slot.engine for slot in self.models.slots if slot.engine is not None]

    def _num_active(self) -> int:
        return sum(engine.num_active for engine in self._engines())

    def _num_busy(self) -> int:
        return self._num_active() + self.preparation.num_preparing

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests (503 with ``Retry-After``) and let running ones (in preparation or in the engine)
        finish within ``timeout_s``; then end the rest with a final error event. Logs a ``drain`` line when it
        starts and when it ends."""
        started = time.monotonic()
        if self.state in ("loading", "ready"):
            self.state = "draining"
        self._drain_deadline = started + timeout_s
        num_active, num_preparing = self._num_busy(), self.preparation.num_preparing
        log.info("drain", phase="start", num_active=num_active, num_preparing=num_preparing, timeout_s=timeout_s)
        while self._num_busy() and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.05)
        num_unprepared = self.preparation.cancel_all(
            f"the server is shutting down: the request was not prepared within the drain timeout ({timeout_s:g} s); "
            "retry it")
        num_aborted = self._num_active() + num_unprepared
        if self._num_active():
            for engine in self._engines():
                engine.abort_all(f"the server is shutting down: the request did not finish within the drain "
                                 f"timeout ({timeout_s:g} s); retry it")
            # The final frames reach the clients once the engines have sent the events.
            settle = time.monotonic() + 5
            while self._num_active() and time.monotonic() < settle:
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
        if self.state != "ready":
            return
        for slot in self.models.slots:
            failure = getattr(slot.engine, "failure", None)
            if failure is not None:
                self._slot_failed(slot, failure)

    def _restart_s(self) -> float:
        """How long a restarted daemon takes to serve again: this one's load time, when known."""
        return self.load_s if self.load_s is not None else 5.0

    def health(self) -> tuple[int, dict[str, Any], float | None]:
        """``/health``: (status code, body, seconds for ``Retry-After``); 200 only while serving."""
        self._notice_engine_failure()
        body: dict[str, Any] = {"status": self.state, "model": self.name,
                                "models": {slot.name: slot.state for slot in self.models.slots}}
        if self.error:
            body["error"] = self.error
        if self._engines() and self.state in ("ready", "draining"):
            body["num_active"] = self._num_active()
            body["num_preparing"] = self.preparation.num_preparing  # requests being prepared, not yet in the engine
        try:
            self.require_ready()
        except NotReady as e:
            return 503, body, e.retry_after
        return 200, body, None


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
