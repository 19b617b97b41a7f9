"""The batching engine: continuous batching on one engine thread, and its event-loop side.

Every MLX call happens on the engine thread, which runs :class:`mlxd.engine.loop.EngineLoop` over the engine's core
(:mod:`mlxd.engine.core`). The event loop only queues commands for it (:meth:`BatchedEngine.submit`, ``cancel``,
``abort_all``, the prefix cache's ``clear`` and ``shrink``) and reads events from each request's
:class:`RequestHandle`; this module starts and stops the thread and answers status and memory questions.

A failure ends only the requests it must, with ``Failed`` and one ``request_failed`` log line each: the one request
whose row could not be built, whose prompt chunk or sampler raised (a group of prompts processed together is retried
one by one); every decoding request when the shared decode step breaks. The loop goes on, with MLX's random state
and the decode batch reset. Should the thread end anyway, :attr:`BatchedEngine.failure` says why, every request ends
with a 503 ``Failed``, :meth:`BatchedEngine.submit` refuses, and ``on_failure`` is called.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, RequestHandle, SamplingParams
from mlxd.engine.commands import (
    Accept,
    Cancel,
    Clear,
    EndAll,
    Evict,
    ImagesEncoded,
    RequestSpec,
    Stop,
)
from mlxd.engine.core import EngineCore, Group
from mlxd.engine.drafters.base import Drafter
from mlxd.engine.loop import EngineLoop
from mlxd.engine.prefix import PromptReuse
from mlxd.engine.requests import Submitted
from mlxd.engine.schedule.memory import MemoryBudget, require_fits
from mlxd.engine.schedule.scheduler import Scheduler, SequenceState, SharedKV
from mlxd.engine.status import engine_status
from mlxd.engine.step.sampling import make_request_sampler
from mlxd.engine.step.steptimes import StepTimes
from mlxd.engine.step.vision import VisionPrefill
from mlxd.errors import NotReady, Overloaded
from mlxd.log import get_logger
from mlxd.runtime.device import device_stream

if TYPE_CHECKING:
    from mlxd.engine.distributed.leader import Leader

log = get_logger("mlxd.engine")


class BatchedEngine:
    """Serves many requests at once: chunked prompt processing interleaved with batched decode steps.

    ``make_sampler`` builds each request's sampler (mlx-lm's by default); ``drafter`` proposes tokens for speculative
    requests (:mod:`mlxd.engine.drafters`), None: every request decodes plain. In a distributed group, ``channel``
    shares rank 0's sampled tokens and rank 0's ``leader`` sends what the engine applies
    (:mod:`mlxd.engine.distributed`)."""

    def __init__(self, model: Any, config: EngineConfig, *,
                 make_sampler: Callable[[SamplingParams], Any] = make_request_sampler,
                 drafter: Drafter | None = None, channel: Group | None = None,
                 leader: Leader | None = None,
                 held: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
                 kv_share: SharedKV | None = None) -> None:
        self.model = model
        # Held around each step and the warm-up: the device's turn when several models share it
        # (:class:`mlxd.runtime.device_turn.DeviceTurn`); nothing otherwise.
        self.held = held
        self.drafter = drafter
        # Images are encoded on a thread of their own while the engine steps (not in a distributed group, whose
        # ranks must run the same work in the same step).
        deliver = ((lambda encoded: self.engine_loop.put(ImagesEncoded(encoded)))
                   if config.vision_encoder_thread else None)
        self.core = EngineCore(model, config, make_sampler=make_sampler, drafter=drafter, channel=channel,
                               deliver=deliver, record=leader.record if leader is not None else None)
        self.leader = leader
        self.engine_loop = EngineLoop(self.core, held=held, leader=leader)
        # A memory budget shared with other models' engines (mlxd.registry): admission claims each row from it too.
        self.core.scheduler.shared = kv_share
        # Why the engine thread ended, when it did not end by stop(); on_failure(reason) is called then, on the
        # engine thread.
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._stopping = False
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlxd-engine", daemon=True)
        if leader is not None:
            leader.attach(self)

    # Views of the core's parts, for the owner and for status pages.

    @property
    def config(self) -> EngineConfig:
        """The engine's settings; ``max_running`` as resolved at warm-up (set, or derived from the memory budget)."""
        return self.core.config

    @property
    def max_running(self) -> int:
        """Requests that may decode together (``[engine] max_running``, or derived at warm-up when it is 0)."""
        return self.core.config.max_running

    @property
    def vocab_size(self) -> int:
        """The model's logits width, learned at warm-up: token ids must be below it."""
        return self.core.runner.vocab_size

    @property
    def vision(self) -> VisionPrefill | None:
        return self.core.runner.vision

    @property
    def reuse(self) -> PromptReuse:
        return self.core.reuse

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def memory(self) -> MemoryBudget | None:
        return self.core.memory

    @property
    def totals(self) -> dict[str, Any]:
        return self.core.totals

    @property
    def step_times(self) -> StepTimes:
        return self.core.step_times

    # ---- the event loop's side: thread-safe, no MLX ----

    def start(self) -> None:
        with self.held():  # the warm-up runs on the engine thread while this waits for it
            self._thread.start()
            self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error
        if self.leader is not None:
            self.leader.start()

    def stop(self) -> None:
        if self.leader is not None and self.failure is not None:
            return  # the engine thread may be blocked inside a collective for good: do not wait for it
        with self.core.table.lock:
            self._stopping = True
        self.engine_loop.put(Stop())
        self._thread.join(timeout=30)
        cache = self.reuse.cache
        if cache is not None and self.failure is None and not self._thread.is_alive():
            cache.persist(self.config.prefix_cache_persist_s)  # the disk tier keeps what memory holds (a clean stop)

    def abort_all(self, message: str) -> None:
        """End every request the engine holds (waiting, prefilling, decoding) with ``Failed(message, 503)``.

        Thread-safe: applied on the engine thread, between steps. Requests submitted later are served."""
        self.engine_loop.put(EndAll(message))

    @property
    def num_active(self) -> int:
        """Requests submitted and not ended yet: pending, waiting and running (thread-safe)."""
        with self.core.table.lock:
            return self.core.table.num_pending + self.scheduler.num_waiting + self.scheduler.num_running

    def retry_after_s(self) -> float:
        """Seconds a newcomer should wait before retrying: the queue ahead of it, over the running slots, times the
        recent mean request duration (1 s while none is known); at least 1."""
        num_queued = self.core.table.num_pending + self.scheduler.num_waiting
        return max(1.0, num_queued / self.scheduler.max_running * (self.core.table.mean_duration_s or 1.0))

    def submit(self, request: EngineRequest) -> RequestHandle:
        state = SequenceState.for_request(request)
        if self.memory is not None:  # a request that could never fit is a 400 now, not a wait forever
            state.num_kv_bytes = require_fits(self.memory, len(request.prompt), request.max_tokens,
                                              request.prefill_chunk)
            self._require_shared_room(state.num_kv_bytes)
        handle = RequestHandle(request.request_id, self, asyncio.get_running_loop(), on_end=request.on_end)
        submitted = Submitted(request, handle, state)
        with self.core.table.lock:
            if self.failure is not None or self._stopping:
                raise NotReady(f"the engine has stopped: {self.failure or 'the server is shutting down'}")
            if not self.scheduler.can_add(num_pending=self.core.table.num_pending):
                raise Overloaded(
                    f"{self.config.max_running} requests are running and {self.config.max_waiting} waiting "
                    "(the most allowed); retry shortly", retry_after=self.retry_after_s(),
                )
            self.core.table.pending[request.request_id] = submitted
        self.engine_loop.put(Accept(RequestSpec.of(request)))
        return submitted.handle

    def _require_shared_room(self, num_kv_bytes: int) -> None:
        """Under a budget shared with other models, a request whose cache cannot fit beside their weights even once
        none of their rows runs gets 503 now (retry once an idle model is unloaded), instead of waiting for good."""
        shared = self.scheduler.shared
        if shared is not None and not shared.fits_alone(num_kv_bytes):
            raise NotReady(f"this request needs {num_kv_bytes} bytes of KV cache, more than [server] "
                           "models_memory_bytes leaves beside the loaded models' weights; retry once another model "
                           "is unloaded, or lower max_tokens", retry_after=max(5.0, self.retry_after_s()))

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self.engine_loop.put(Cancel(request_id, reason))

    def cache_stats(self) -> dict[str, Any]:
        """Prefix-cache counters (thread-safe: the cache takes its own lock)."""
        return self.reuse.stats()

    def memory_bytes(self) -> dict[str, int]:
        """What the engine holds beside its weights, for a budget over several models (thread-safe, no MLX call):
        ``kv``, the bytes its running requests' caches reserve (what admission counts: each row up to prompt +
        ``max_tokens``, padded to the batch's widest reservation), and ``prefix_cache``, the bytes its prefix
        cache's snapshots hold now."""
        with self.core.table.lock:
            num_kv_bytes = self.scheduler.num_reserved_bytes
        return {"kv": num_kv_bytes, "prefix_cache": self.reuse.num_bytes}

    async def shrink_prefix_cache(self, num_bytes: int) -> None:
        """Evict least recently used prefix-cache entries until at most ``num_bytes`` are held (on the engine thread,
        between steps): room for another model under a budget they share (:mod:`mlxd.registry`)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.engine_loop.put(Evict(max(0, num_bytes)), (loop, future))
        await future

    async def clear_prefix_cache(self) -> dict[str, Any]:
        """Drop every prefix-cache entry on the engine thread, between steps; returns the stats before."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.engine_loop.put(Clear(), (loop, future))
        return await future

    def status(self, prompts: bool = False) -> dict[str, Any]:
        """Requests, limits, totals, step times and memory, for ``GET /v1/status``
        (:func:`mlxd.engine.status.engine_status`). Rendered prompts (clipped) are shown only when ``prompts`` asks
        for them."""
        return engine_status(self, prompts)

    # ---- the engine thread ----

    def _run(self) -> None:
        vision = self.core.runner.vision
        if vision is not None:
            vision.start()
        try:
            # The device the model was loaded on, with a stream of this thread's own (synchronized on the way out:
            # nothing of ours may still be running when the thread ends).
            with device_stream():
                self._serve()
        except BaseException as e:  # noqa: BLE001 - the engine is gone: its requests and its owner are told
            self._die(e)
        finally:
            if vision is not None:
                vision.stop()

    def _serve(self) -> None:
        try:
            self.engine_loop.warm_up()
        except Exception as e:  # noqa: BLE001 - handed to start(), which re-raises it
            self._startup_error = e
        self._ready.set()
        if self._startup_error is not None:
            return
        self.engine_loop.serve()
        if self.leader is not None and self.failure is None:
            self.leader.stopped()

    def _die(self, error: BaseException) -> None:
        """The engine thread ends on an error: record why, end every request, refuse new ones, tell the owner."""
        reason = (self.leader.failure_reason(error) if self.leader is not None
                  else f"{type(error).__name__} on the engine thread")
        log.error("engine_failed", reason=reason, error=str(error), exc_info=error)
        if not self._ready.is_set():  # still warming up: start() raises it
            self._startup_error = error
            self._ready.set()
        self.halt(reason, f"the engine has stopped ({reason}); retry shortly")

    def halt(self, reason: str, message: str) -> None:
        """The engine cannot go on: record why (``failure``), end every request with ``message`` (503), refuse new
        ones and tell the owner. Touches no MLX state."""
        with self.core.table.lock:
            self.failure = reason
        self.core.end_all(message)
        self.core.table.send(flush=True)
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:  # noqa: BLE001 - the engine is gone either way; the owner's error is logged
                log.exception("engine_on_failure_failed")

