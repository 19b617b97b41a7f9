"""How requests come in, on the engine thread: the inbox's commands (submit, cancel, abort, clear the prefix cache,
encoded images) applied between steps, and a submitted request taken on: its prompt started after the longest
state the prefix cache holds for it, and its images handed to the encoder thread (:mod:`mlxd.engine.step.encoder`)
before the scheduler may admit it. :class:`~mlxd.engine.batched.BatchedEngine` builds the rows (``_new_row``) and
runs the steps.
"""

from __future__ import annotations

import queue
import time
from typing import Any

import mlx.core as mx

from mlxd.engine.base import Plain
from mlxd.engine.front import Submitted
from mlxd.engine.outcomes import Outcomes
from mlxd.engine.step.encoder import Encoded
from mlxd.engine.step.row import Row
from mlxd.engine.step.vision import VisionPrefill, prompt_key


class Intake(Outcomes):
    """The engine thread's side of submit, cancel and the other commands (the event loop's is
    :class:`~mlxd.engine.front.EngineFront`)."""

    vision: VisionPrefill | None

    def _new_row(self, request: Any, cache: list[Any] | None = None) -> Row:
        raise NotImplementedError

    def _apply_inbox(self, block: bool) -> bool:
        """Apply queued commands; return False once asked to stop. Blocks for at most ``_idle_wait_s`` (None:
        until a command comes) when ``block``.

        A request that wakes the idle engine waits for the requests arriving with it: commands are taken until
        none has come for ``gather_ms`` (at most ten times that in all), so that a burst of requests starts in one
        prompt pass instead of the first alone and the rest a step later."""
        gather_s = self.config.gather_ms / 1000
        deadline = None
        while True:
            try:
                command, arg = self._inbox.get(block=block or deadline is not None,
                                               timeout=self._idle_wait_s if block else _left(deadline, gather_s))
            except queue.Empty:
                if self.vision is not None:
                    self.vision.flush()  # the images of the requests just taken on, as one job
                return True
            if block and command == "submit" and gather_s > 0:
                deadline = time.monotonic() + 10 * gather_s
            block = False
            if command == "stop":
                self._end_all("the server is shutting down; retry shortly")
                return False
            if command == "submit":
                self._accept(arg)
            elif command == "cancel":
                self._cancel(*arg)
            elif command == "abort_all":
                self._end_all(arg)
            elif command == "encoded":
                self._encoded(arg)
            elif command == "clear_cache":
                loop, future = arg
                loop.call_soon_threadsafe(future.set_result, self._clear_prefix_cache())

    def _clear_prefix_cache(self) -> dict[str, Any]:
        return self.reuse.clear()

    def _accept(self, submitted: Submitted) -> None:
        request_id = submitted.request.request_id
        with self._lock:
            if request_id not in self._pending:
                return  # ended before it got here (abort_all)
        self._requests[request_id] = submitted
        mode = submitted.request.decode
        submitted.state.decode = ({"mode": "plain", "reason": mode.reason} if isinstance(mode, Plain)
                                  else {"mode": "speculative", "drafter": mode.drafter, "k": mode.k})
        self.totals["num_requests"] += 1
        self.totals["num_prompt_tokens"] += len(submitted.request.prompt)
        try:
            if submitted.request.media is not None and self.vision is not None:
                submitted.state.encoding = self.vision.hold(submitted.request)
            self._reuse_prefix(submitted)
        except Exception as e:  # noqa: BLE001 - this request fails with it (reported, not swallowed)
            with self._lock:
                del self._pending[request_id]
            self._fail(request_id, "build", e)
            return
        with self._lock:
            del self._pending[request_id]
            self.scheduler.add(submitted.state)

    def _encoded(self, encoded: Encoded) -> None:
        """The encoder thread finished a job: the requests whose images are now all in may start (those starting
        from a prefix-cache state get their rows now)."""
        for request_id in self.vision.take(encoded):
            submitted = self._requests.get(request_id)
            if submitted is None:
                continue
            submitted.state.encoding = False
            cache, submitted.start_cache = submitted.start_cache, None
            if cache is not None:
                try:
                    self._start_from(submitted, cache)
                except Exception as e:  # noqa: BLE001 - this request fails with it (reported, not swallowed)
                    self._fail(request_id, "build", e)

    def _release(self, request_id: str) -> Submitted | None:
        if self.vision is not None:
            self.vision.forget(request_id)
        return super()._release(request_id)

    def _reuse_prefix(self, submitted: Submitted) -> None:
        """Start the prompt after the longest state the prefix cache holds for it."""
        request, state = submitted.request, submitted.state
        submitted.cache_key = prompt_key(request)
        hit = self.reuse.lookup(submitted.cache_key)
        state.cache_hit, state.num_cached_tokens = hit.kind, hit.num_cached
        if hit.cache is None:
            return
        state.num_prefilled = hit.num_cached
        if state.encoding:  # the row merges the images' features: it is built once they are in
            submitted.start_cache = hit.cache
        else:
            self._start_from(submitted, hit.cache)

    def _start_from(self, submitted: Submitted, cache: list[Any]) -> None:
        """Build the row of a request whose prompt starts from a cached state (``num_prefilled`` tokens)."""
        request = submitted.request
        row = self._new_row(request, cache)
        if row.processors:
            row.history = mx.array(request.prompt[: submitted.state.num_prefilled], dtype=mx.uint32)


def _left(deadline: float | None, gap_s: float) -> float | None:
    """How long to wait for the next command while gathering a burst (None when not gathering)."""
    return None if deadline is None else max(0.0, min(gap_s, deadline - time.monotonic()))
