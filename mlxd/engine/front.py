"""The event-loop side of the batching engine: submit, cancel, abort, status.

These methods run on the server's event loop (any thread, for the thread-safe ones). They never run MLX: they put
commands in the inbox, which the engine thread (:mod:`mlxd.engine.batched`) applies between steps, and they read
counters under a lock.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, RequestHandle
from mlxd.engine.prefix import PromptReuse
from mlxd.engine.schedule.memory import MemoryBudget, memory_status, require_fits
from mlxd.engine.schedule.scheduler import Scheduler, SequenceState
from mlxd.errors import NotReady, Overloaded


@dataclass(slots=True, eq=False)
class Submitted:
    """A request the engine has taken on: what was asked, where its events go, what the scheduler tracks."""

    request: EngineRequest
    handle: RequestHandle
    state: SequenceState
    # Tokens fed to the model after the prompt (every emitted token, and a stop token): with the prompt, what its
    # cache holds, so that it can be kept for the next turn of a conversation.
    generated: list[int] = field(default_factory=list)
    started_at: float | None = None  # when its first prompt chunk ran (admitted)
    # The prompt as the prefix cache keys it (image placeholders keyed by image digest): set on admission.
    cache_key: list[int] = field(default_factory=list)
    # A prefix-cache state the prompt starts from, held while its images are encoded (its row is built after).
    start_cache: list[Any] | None = None


class EngineFront:
    """State shared with the engine thread, and the methods the event loop calls. Subclasses run the thread
    (``_run``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Why the engine thread ended, when it did not end by stop(); on_failure(reason) is called then, on the
        # engine thread.
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._stopping = False
        self._mean_duration_s: float | None = None  # recent requests, admitted to finished (for Retry-After)
        self.scheduler = Scheduler(
            max_running=config.max_running,
            max_waiting=config.max_waiting,
            step_token_budget=config.step_token_budget,
        )
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._idle_wait_s: float | None = None  # while idle, the engine thread wakes this often (None: never)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlxd-engine", daemon=True)
        self._lock = threading.Lock()
        self._pending: dict[str, Submitted] = {}  # submitted on the event loop, not yet applied here
        self.reuse = PromptReuse(config.prefix_cache_bytes, config.prefix_cache_min_tokens)
        self.memory: MemoryBudget | None = None  # measured at warm-up, on the engine thread
        self.totals = {
            "num_requests": 0, "num_prompt_tokens": 0, "num_generated_tokens": 0,
            "num_cancelled": 0, "num_failed": 0, "num_steps": 0,
            # Ended with 503: by abort_all/stop or a dead engine; waited past max_queue_wait_s.
            "num_aborted": 0, "num_timed_out": 0,
            # Speculative requests, counted when they end: tokens drafted and kept, decode steps and tokens emitted,
            # time in the drafter.
            "speculative_drafted": 0, "speculative_accepted": 0, "speculative_steps": 0, "speculative_emitted": 0,
            "speculative_drafter_ms": 0,
        }

    def _run(self) -> None:
        raise NotImplementedError

    def _speculative_status(self) -> dict[str, Any]:
        """The drafter, and what speculative requests that ended got from it."""
        totals, drafter = self.totals, getattr(self, "drafter", None)
        drafted, steps = totals["speculative_drafted"], totals["speculative_steps"]
        return {
            "drafter": drafter.name if drafter is not None else None,
            "acceptance": round(totals["speculative_accepted"] / drafted, 3) if drafted else None,
            "tokens_per_step": round(totals["speculative_emitted"] / steps, 2) if steps else None,
            "drafter_ms": round(totals["speculative_drafter_ms"], 1),
        }

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    def abort_all(self, message: str) -> None:
        """End every request the engine holds (waiting, prefilling, decoding) with ``Failed(message, 503)``.

        Thread-safe: applied on the engine thread, between steps. Requests submitted later are served."""
        self._inbox.put(("abort_all", message))

    @property
    def num_active(self) -> int:
        """Requests submitted and not ended yet: pending, waiting and running (thread-safe)."""
        with self._lock:
            return len(self._pending) + self.scheduler.num_waiting + self.scheduler.num_running

    def retry_after_s(self) -> float:
        """Seconds a newcomer should wait before retrying: the queue ahead of it, over the running slots, times the
        recent mean request duration (1 s while none is known); at least 1."""
        num_queued = len(self._pending) + self.scheduler.num_waiting
        return max(1.0, num_queued / self.config.max_running * (self._mean_duration_s or 1.0))

    def submit(self, request: EngineRequest) -> RequestHandle:
        state = SequenceState.for_request(request)
        if self.memory is not None:  # a request that could never fit is a 400 now, not a wait forever
            state.num_kv_bytes = require_fits(self.memory, len(request.prompt), request.max_tokens,
                                              request.prefill_chunk)
        submitted = Submitted(request, RequestHandle(request.request_id, self, asyncio.get_running_loop()), state)
        with self._lock:
            if self.failure is not None or self._stopping:
                raise NotReady(f"the engine has stopped: {self.failure or 'the server is shutting down'}")
            if not self.scheduler.can_add(num_pending=len(self._pending)):
                raise Overloaded(
                    f"{self.config.max_running} requests are running and {self.config.max_waiting} waiting "
                    "(the most allowed); retry shortly", retry_after=self.retry_after_s(),
                )
            self._pending[request.request_id] = submitted
        self._inbox.put(("submit", submitted))
        return submitted.handle

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self._inbox.put(("cancel", (request_id, reason)))

    def cache_stats(self) -> dict[str, Any]:
        """Prefix-cache counters (thread-safe: the cache takes its own lock)."""
        return self.reuse.stats()

    async def clear_prefix_cache(self) -> dict[str, Any]:
        """Drop every prefix-cache entry on the engine thread, between steps; returns the stats before."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(("clear_cache", (loop, future)))
        return await future

    def status(self) -> dict[str, Any]:
        with self._lock:
            pending = [s.state for s in self._pending.values()]
            running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
        vision = getattr(self, "vision", None)
        return {
            **({"vision": vision.status()} if vision is not None else {}),
            "running": [s.snapshot() for s in running],
            "waiting": [s.snapshot() for s in [*waiting, *pending]],
            "limits": {
                "max_running": self.config.max_running,
                "max_waiting": self.config.max_waiting,
                "step_token_budget": self.config.step_token_budget,
            },
            "totals": dict(self.totals),
            "speculative": self._speculative_status(),
            **({"step_ms": self.step_times.status(), "num_steps": self.step_times.num_steps}
               if hasattr(self, "step_times") else {}),
            "memory": {
                "active_bytes": mx.get_active_memory(),
                "peak_bytes": mx.get_peak_memory(),
                "cache_bytes": mx.get_cache_memory(),
                # Admission: the limit, the weights' share, what requests reserve, what the prefix cache holds.
                **(memory_status(self.memory, self.scheduler.num_reserved_bytes, self.reuse.num_bytes)
                   if self.memory is not None else {}),
            },
        }
