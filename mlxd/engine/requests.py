"""The request table: every request the engine holds, its state, and its event channel.

A request is *pending* from :meth:`RequestTable.add_pending` (the event loop, under :attr:`RequestTable.lock`) until
the engine thread applies its ``Accept``; then it is *held* until a ``Drop`` (or ``Cancel``, ``EndAll``, ``Stop``)
lets it go. Events of a step are collected in an outbox and handed to the event loops together (:meth:`send`), a
stream's tokens paced when there are many streams (:mod:`mlxd.engine.pacing`). Plain Python: no MLX.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mlxd.engine.base import EngineRequest, Failed, Finished, RequestHandle, Token
from mlxd.engine.pacing import StreamPacer
from mlxd.engine.schedule.scheduler import SequenceState

TOTALS = (
    "num_requests", "num_prompt_tokens", "num_generated_tokens", "num_cancelled", "num_failed", "num_steps",
    # Ended with 503: by abort_all/stop or a dead engine; waited past max_queue_wait_s.
    "num_aborted", "num_timed_out",
    # Speculative requests, counted when they end: tokens drafted and kept, decode steps and tokens emitted, time in
    # the drafter.
    "speculative_drafted", "speculative_accepted", "speculative_steps", "speculative_emitted", "speculative_drafter_ms",
)


@dataclass(slots=True, eq=False)
class Submitted:
    """A request the engine has taken on: what was asked, where its events go (None: nobody listens, as on a
    distributed follower), what the scheduler tracks."""

    request: EngineRequest
    handle: RequestHandle | None
    state: SequenceState
    # Tokens fed to the model after the prompt (every emitted token, and a stop token): with the prompt, what its
    # cache holds, so that it can be kept for the next turn of a conversation.
    generated: list[int] = field(default_factory=list)
    started_at: float | None = None  # when its first prompt chunk ran (admitted)
    # The prompt as the prefix cache keys it (image placeholders keyed by image digest): set on admission.
    cache_key: list[int] = field(default_factory=list)
    # A prefix-cache state the prompt starts from, held while its images are encoded (its row is built after).
    start_cache: list[Any] | None = None


class RequestTable:
    """Pending and held requests, their events and the engine's request counters."""

    def __init__(self, stream_updates_per_s: float = 0) -> None:
        # Guards ``pending`` and the scheduler's queues (the event loop reads them; the engine thread changes them).
        self.lock = threading.Lock()
        self.pending: dict[str, Submitted] = {}  # submitted on the event loop, not applied yet
        self._held: dict[str, Submitted] = {}
        self._outbox: list[tuple[RequestHandle, Any]] = []
        self.pacer = StreamPacer(stream_updates_per_s)
        self.totals = dict.fromkeys(TOTALS, 0)
        self.mean_duration_s: float | None = None  # recent requests, admitted to finished (for Retry-After)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __getitem__(self, request_id: str) -> Submitted:
        return self._held[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def get(self, request_id: str) -> Submitted | None:
        return self._held.get(request_id)

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    def is_pending(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self.pending

    def hold(self, submitted: Submitted) -> None:
        """Hold an accepted request (counted in the totals)."""
        self._held[submitted.request.request_id] = submitted
        self.totals["num_requests"] += 1
        self.totals["num_prompt_tokens"] += len(submitted.request.prompt)

    def pop(self, request_id: str) -> Submitted | None:
        return self._held.pop(request_id, None)

    def take_all(self) -> list[Submitted]:
        """Every pending and held request, now let go (the caller holds :attr:`lock`)."""
        taken = [*self.pending.values(), *self._held.values()]
        self.pending.clear()
        self._held.clear()
        return taken

    # ---- events ----

    def post(self, submitted: Submitted, event: Any) -> None:
        if submitted.handle is not None:
            self._outbox.append((submitted.handle, event))

    def send(self, flush: bool = False) -> None:
        """Hand this step's events to the event loops, together, but the tokens the pacer holds back; ``flush``
        hands everything (the engine thread is ending)."""
        if self._outbox or self.pacer.num_held:
            events, self._outbox = self._outbox, []
            events = self.pacer.release(events, len(self._held), flush=flush)
            if events:
                RequestHandle.push_all(events)

    def emit_all(self, submitted: Submitted, tokens: list[int], logprobs: list | None) -> tuple[str | None, int]:
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
        self.post(submitted, Token(token) if logprobs is None else Token(token, logprobs[0], tuple(logprobs[1])))
        return "length" if state.num_generated >= state.max_tokens else None

    def post_finished(self, submitted: Submitted, reason: str) -> None:
        """Tell a request that it ended (``reason``: stop, length, cancelled), with its summary: what the prefix
        cache gave it, the prompt tokens it computed, and its time in the queue and in its prompt (a request that
        ended before its first token counts them until now)."""
        state, now = submitted.state, time.monotonic()
        started, first = submitted.started_at, state.first_token_at
        self.post(submitted, Finished(reason=reason, num_prompt_tokens=len(submitted.request.prompt),
                                      num_cached_tokens=state.num_cached_tokens, cache_hit=state.cache_hit,
                                      num_prompt_computed=state.num_prefilled - state.num_cached_tokens,
                                      decode=self._decode_summary(submitted),
                                      queued_s=_seconds(state.submitted_at, started or now),
                                      prefill_s=_seconds(started, first or now) if started is not None else 0.0))
        if reason != "cancelled" and started is not None:
            duration, mean = time.monotonic() - started, self.mean_duration_s
            self.mean_duration_s = duration if mean is None else 0.8 * mean + 0.2 * duration

    def post_failed(self, submitted: Submitted, message: str, status: int, counter: str) -> None:
        """Tell a request that it failed; ``counter`` names the total it counts in."""
        self.totals[counter] += 1
        self.post(submitted, Failed(message, status=status))

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


def _seconds(start: float | None, end: float | None) -> float | None:
    return round(end - start, 4) if start is not None and end is not None else None
