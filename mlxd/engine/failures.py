"""How a request that failed or waited too long ends, for the core (:meth:`mlxd.engine.core.EngineCore.fail`,
:meth:`~mlxd.engine.core.EngineCore.expire_waiting`).

A prompt that failed while running from a prefix-cache hit runs again once from its start, without the entry it
started from (that entry's state may be what failed). Otherwise the request is dropped through the core's ``apply``
(so that a distributed leader records it) and ends with ``Failed`` (500, a client-safe message by phase) and one
``request_failed`` log line. In a distributed group a failure only this rank saw (not a refusal) ends the job: the
other ranks cannot follow. A request that waited in the queue longer than ``[engine] max_queue_wait_s`` ends with
503 and one ``request_timed_out`` log line.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mlxd.engine.commands import Command, Drop
from mlxd.engine.prefix import PromptReuse
from mlxd.engine.requests import RequestTable
from mlxd.engine.schedule.scheduler import SequenceState
from mlxd.engine.step.row import Refused, reset_random_state
from mlxd.engine.step.runner import StepRunner
from mlxd.errors import DistributedFault
from mlxd.log import get_logger

log = get_logger("mlxd.engine")

# What a failed request is told, by phase; the exception itself goes to the log only.
_FAILED = {
    "build": "the engine could not set up this request",
    "prefill": "the engine failed while processing the prompt",
    "sample": "the engine failed while sampling the next token",
    "decode": "the engine failed while generating",
}


class Failures:
    """Ends the core's failed and timed-out requests. ``apply`` is the core's; ``rank`` is this rank's in a distributed group
    (None: no group). Remembers the prefix-cache entry each request that hit started from, until it is dropped."""

    def __init__(self, table: RequestTable, reuse: PromptReuse, runner: StepRunner, *,
                 apply: Callable[[Command], Any], rank: int | None = None) -> None:
        self.table, self.reuse, self.runner = table, reuse, runner
        self.rank = rank
        self._apply = apply
        self._hit_entries: dict[str, tuple[int, ...]] = {}

    def started_from(self, request_id: str, entry: tuple[int, ...]) -> None:
        """``request_id`` starts from the prefix-cache entry ``entry`` (dropped if running from it fails)."""
        self._hit_entries[request_id] = entry

    def forget(self, request_id: str) -> None:
        self._hit_entries.pop(request_id, None)

    def fail(self, request_id: str, phase: str, error: Exception) -> None:
        """End one request with ``Failed`` (500, a client-safe message); the error itself goes to the log. A
        prompt that failed while running from a prefix-cache hit runs again from its start first
        (:meth:`_retry_cold`)."""
        if self._retry_cold(request_id, phase, error):
            return
        if self.rank is not None and not isinstance(error, Refused):  # only this rank saw it
            raise DistributedFault(f"rank {self.rank}: a request failed in the {phase} phase "
                                   f"({type(error).__name__}: {error}); the other ranks cannot follow") from error
        reset_random_state()  # a failed graph can leave it unusable for every later sampled request
        submitted = self._apply(Drop(request_id))
        if submitted is None:
            return  # ended already
        log.error("request_failed", request_id=request_id, phase=phase, error_type=type(error).__name__,
                  error=str(error))
        self.table.post_failed(submitted, str(error) if isinstance(error, Refused) else _FAILED[phase], 500,
                               "num_failed")

    def expire_waiting(self, waiting: deque[SequenceState], limit_s: float) -> None:
        """End the requests of ``waiting`` (the queue, oldest first) that have waited longer than ``limit_s`` (0:
        no limit) with 503."""
        now = time.monotonic()
        if not limit_s or not waiting or now - waiting[0].submitted_at <= limit_s:  # the head waited longest
            return
        for state in [s for s in waiting if now - s.submitted_at > limit_s]:
            submitted = self._apply(Drop(state.request_id))
            if submitted is not None:
                log.warning("request_timed_out", request_id=state.request_id,
                            waited_s=round(now - state.submitted_at, 3))
                self.table.post_failed(submitted, f"the request waited more than {limit_s:g} s in the queue for a "
                                       "free slot; retry later", 503, "num_timed_out")

    def _retry_cold(self, request_id: str, phase: str, error: Exception) -> bool:
        """Run a prompt that failed while running from a prefix-cache hit again from its start, without the hit:
        the entry it started from is dropped (its state may be what failed) and the request stays queued as a
        miss. Once: a second failure has no hit to blame. Not in a distributed group (the other ranks cannot
        follow) and not for a refusal (the request is at fault, not the state). Returns whether it retries."""
        submitted = self.table.get(request_id)
        if (submitted is None or phase != "prefill" or self.rank is not None or isinstance(error, Refused)
                or not submitted.state.num_cached_tokens):
            return False
        state, entry = submitted.state, self._hit_entries.pop(request_id, ())
        dropped = self.reuse.drop_entry(entry)
        log.warning("prefix_entry_failed", request_id=request_id, num_cached_tokens=state.num_cached_tokens,
                    cache_hit=state.cache_hit, num_entry_tokens=len(entry), entry_dropped=dropped,
                    error_type=type(error).__name__,
                    error=str(error), action="retrying from the start without the entry")
        reset_random_state()
        self.runner.prefilling.pop(request_id, None)
        state.num_prefilled = state.num_cached_tokens = 0
        state.cache_hit = "miss"
        return True
