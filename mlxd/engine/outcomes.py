"""The engine thread's side of how requests end: tokens emitted as events, requests finished, cancelled, failed,
timed out or aborted, and the thread's own death.

Events of a step are collected in an outbox and handed to the event loop together (:meth:`Outcomes._send`). A
request leaves every table at once (:meth:`Outcomes._release`): the scheduler's queues, the prompt rows, the
request table; the decode batch drops its row. :class:`~mlxd.engine.batched.BatchedEngine` runs the steps that
lead here.
"""

from __future__ import annotations

import time
from typing import Any

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import Failed, Finished, RequestHandle, Token
from mlxd.engine.front import EngineFront, Submitted
from mlxd.engine.step.batch import DecodeBatch
from mlxd.engine.step.row import Refused, Row, reset_random_state
from mlxd.log import get_logger

log = get_logger("mlxd.engine")


# What a failed request is told, by phase; the exception itself goes to the log only.
_FAILED = {
    "build": "the engine could not set up this request",
    "prefill": "the engine failed while processing the prompt",
    "sample": "the engine failed while sampling the next token",
    "decode": "the engine failed while generating",
}


class Outcomes(EngineFront):
    """Request endings on the engine thread, over the tables the engine keeps (``batch`` is the subclass's)."""

    batch: DecodeBatch

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._requests: dict[str, Submitted] = {}
        self._prefilling: dict[str, Row] = {}  # rows whose prompt is still going in, each with its own cache
        self._outbox: list[tuple[RequestHandle, Any]] = []  # events of this step, handed over together

    def _post_process(self, tokens: list[int]) -> None:
        """Emit each row's token; finish the rows that hit a stop token or their ``max_tokens``."""
        finished: dict[str, str] = {}
        for row, emitted in zip(self.batch.rows, tokens, strict=True):
            submitted = self._requests[row.request_id]
            reason, unsent = self._emit_all(submitted, emitted, self.batch.logprobs.get(row.request_id))
            if reason is not None:
                finished[row.request_id] = reason
                if row.spec is not None:
                    row.spec.emitted -= unsent
            elif row.spec is not None:
                submitted.state.num_feeding = 1 + row.spec.k
        if finished:
            for request_id in finished:
                self._keep_decoded(request_id)
            self.batch.remove(set(finished))
            for request_id, reason in finished.items():
                self._finish(request_id, reason)
        if self.batch.errors:  # rows whose next token could not be computed; the tokens they got stand
            errors, self.batch.errors = self.batch.errors, {}
            for request_id, error in errors.items():
                self._fail(request_id, "sample", error)

    def _emit_all(self, submitted: Submitted, tokens: list[int], logprobs: list | None) -> tuple[str | None, int]:
        """Emit a row's tokens of this step in order, up to the one that finishes it: the reason, if one did, and
        how many tokens were not sent. Those are still in the row's cache: they join ``generated`` (what the
        cache holds). A stop token ends the row unsent too."""
        for i, token in enumerate(tokens):
            reason = self._emit(submitted, token, logprobs[i] if logprobs is not None else None)
            if reason is not None:
                submitted.generated.extend(tokens[i + 1 :])
                return reason, len(tokens) - i - (reason != "stop")
        return None, 0

    def _emit(self, submitted: Submitted, token: int,
              logprobs: tuple[float, list[tuple[int, float]]] | None = None) -> str | None:
        state = submitted.state
        submitted.generated.append(token)
        if state.first_token_at is None:
            state.first_token_at = time.monotonic()
        if token in submitted.request.stop_token_ids:
            return "stop"
        state.num_generated += 1
        self.totals["num_generated_tokens"] += 1
        self._post(submitted, Token(token) if logprobs is None else Token(token, logprobs[0], tuple(logprobs[1])))
        return "length" if state.num_generated >= state.max_tokens else None

    def _finish(self, request_id: str, reason: str) -> None:
        submitted = self._release(request_id)
        if submitted is not None:
            state = submitted.state
            decode = self._decode_summary(submitted)
            started, first = submitted.started_at, state.first_token_at
            self._post(submitted, Finished(reason=reason, num_prompt_tokens=len(submitted.request.prompt),
                                           num_cached_tokens=state.num_cached_tokens, cache_hit=state.cache_hit,
                                           decode=decode, queued_s=_seconds(state.submitted_at, started),
                                           prefill_s=_seconds(started, first)))
            if reason != "cancelled" and submitted.started_at is not None:
                duration, mean = time.monotonic() - submitted.started_at, self._mean_duration_s
                self._mean_duration_s = duration if mean is None else 0.8 * mean + 0.2 * duration

    def _decode_summary(self, submitted: Submitted) -> dict[str, Any]:
        """How the request decoded (for its log line); a speculative one's counters join the totals."""
        decode = submitted.state.decode
        if not callable(decode):
            return decode
        summary = decode()
        for key in ("drafted", "accepted", "steps", "emitted"):
            self.totals[f"speculative_{key}"] += summary.get(key, 0)
        self.totals["speculative_drafter_ms"] += summary["drafter_ms"]
        return summary

    def _keep_decoded(self, request_id: str) -> None:
        """Snapshot a decoding request's prompt + generated tokens (finished or cancelled) for later turns."""
        submitted = self._requests.get(request_id)
        if submitted is not None and self.reuse.cache is not None:
            tokens = submitted.cache_key + submitted.generated
            self.reuse.keep(tokens, self.batch.row_cache(request_id))

    def _fail(self, request_id: str, phase: str, error: Exception) -> None:
        """End one request with ``Failed`` (500, a client-safe message); the error itself goes to the log."""
        reset_random_state()  # a failed graph can leave it unusable for every later sampled request
        submitted = self._release(request_id)
        if submitted is None:
            return  # ended already
        self.batch.remove({request_id})
        log.error("request_failed", request_id=request_id, phase=phase, error_type=type(error).__name__,
                  error=str(error))
        self.totals["num_failed"] += 1
        self._post(submitted, Failed(str(error) if isinstance(error, Refused) else _FAILED[phase], status=500))

    def _cancel(self, request_id: str, reason: str) -> None:
        """End a request early: ``cancelled`` (its client left) or ``stop`` (its pipeline has what it needs)."""
        if request_id not in self._requests:
            return  # already finished: cancel is idempotent
        if request_id in self.batch.request_ids:
            self._keep_decoded(request_id)
        self.batch.remove({request_id})
        if reason == "cancelled":
            self.totals["num_cancelled"] += 1
        self._finish(request_id, reason)

    def _post(self, submitted: Submitted, event: Any) -> None:
        self._outbox.append((submitted.handle, event))

    def _send(self) -> None:
        if self._outbox:
            events, self._outbox = self._outbox, []
            RequestHandle.push_all(events)

    def _release(self, request_id: str) -> Submitted | None:
        """Forget a request everywhere: scheduler queues, prompt rows, the request table."""
        self.scheduler.remove(request_id)
        self._prefilling.pop(request_id, None)
        return self._requests.pop(request_id, None)

    def _end_all(self, message: str) -> None:
        """End every request, pending ones included, with ``Failed(message, 503)``. Touches no MLX state: the
        engine may be broken."""
        with self._lock:
            ended = {**self._pending, **self._requests}
            self._pending.clear()
            self.scheduler.waiting.clear()
            self.scheduler.running.clear()
        for submitted in ended.values():
            self._post(submitted, Failed(message, status=503))
        self.totals["num_aborted"] += len(ended)
        self.batch.clear()
        self._requests.clear()
        self._prefilling.clear()

    def _expire_waiting(self) -> None:
        """End the requests that have waited in the queue longer than ``max_queue_wait_s`` (503)."""
        limit, waiting, now = self.config.max_queue_wait_s, self.scheduler.waiting, time.monotonic()
        if not limit or not waiting or now - waiting[0].submitted_at <= limit:  # the head waited longest
            return
        for state in [s for s in waiting if now - s.submitted_at > limit]:
            submitted = self._release(state.request_id)
            if submitted is not None:
                waited_s = round(now - state.submitted_at, 3)
                log.warning("request_timed_out", request_id=state.request_id, waited_s=waited_s)
                self.totals["num_timed_out"] += 1
                self._post(submitted, Failed(f"the request waited more than {limit:g} s in the queue for a free "
                                             "slot; retry later", status=503))

    def _failure_reason(self, error: BaseException) -> str:
        """Why the engine stopped, as clients and ``/health`` are told (the error itself goes to the log)."""
        return f"{type(error).__name__} on the engine thread"

    def _die(self, error: BaseException) -> None:
        """The engine thread ends on an error: record why, end every request, refuse new ones, tell the owner."""
        reason = self._failure_reason(error)
        log.error("engine_failed", reason=reason, error=str(error), exc_info=error)
        with self._lock:
            self.failure = reason
        if not self._ready.is_set():  # still warming up: start() raises it
            self._startup_error = error
            self._ready.set()
        self._end_all(f"the engine has stopped ({reason}); retry shortly")
        self._send()
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:  # noqa: BLE001 - the engine is gone either way; the owner's error is logged
                log.exception("engine_on_failure_failed")


def _seconds(start: float | None, end: float | None) -> float | None:
    return round(end - start, 4) if start is not None and end is not None else None
