"""The serial engine: one request at a time, in arrival order, on one engine thread.

Every MLX call happens on the engine thread; the event loop only puts commands in the inbox and reads
events from each request's handle. Generation composes mlx-lm's ``generate_step`` unchanged, so a lone
request runs exactly as ``mlx_lm.generate`` would, token for token.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import (
    EngineRequest,
    Failed,
    Finished,
    Progress,
    RequestHandle,
    SamplingParams,
    Token,
)
from mlxd.errors import MlxdError, Overloaded
from mlxd.log import get_logger

log = get_logger("mlxd.engine")


@dataclass(slots=True)
class Sequence:
    """A request the engine has taken on."""

    request: EngineRequest
    handle: RequestHandle
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    num_generated: int = 0
    tokens: Any = None  # the generate_step generator once started

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        decoding = self.first_token_at is not None
        elapsed = now - self.first_token_at if decoding else 0.0
        return {
            "request_id": self.request.request_id,
            "phase": "decode" if decoding else ("prefill" if self.tokens is not None else "waiting"),
            "num_prompt_tokens": len(self.request.prompt),
            "num_generated_tokens": self.num_generated,
            "tokens_per_s": round(self.num_generated / elapsed, 2) if elapsed > 0 else None,
            "ttft_s": round(self.first_token_at - self.submitted_at, 4) if decoding else None,
        }


def make_request_sampler(params: SamplingParams):
    """The mlx-lm sampler for a request (greedy at temperature 0)."""
    return make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)


def make_request_processors(params: SamplingParams) -> list:
    """mlx-lm logits processors for the request's penalties and logit bias (empty when none are set)."""
    return make_logits_processors(
        logit_bias=params.logit_bias,
        repetition_penalty=params.repetition_penalty or None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )


class SerialEngine:
    """Serves requests one after another; later issues replace it with a batching engine."""

    def __init__(self, model: Any, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waiting: deque[Sequence] = deque()
        self._active: Sequence | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlxd-engine", daemon=True)
        self._num_pending_submits = 0
        self._lock = threading.Lock()
        self.totals = {"num_requests": 0, "num_prompt_tokens": 0, "num_generated_tokens": 0, "num_failed": 0}

    # ---- event-loop side ----

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    def submit(self, request: EngineRequest) -> RequestHandle:
        with self._lock:
            if self._num_pending_submits + len(self._waiting) >= self.config.max_waiting:
                raise Overloaded(f"{self.config.max_waiting} requests are already waiting; retry shortly")
            self._num_pending_submits += 1
        handle = RequestHandle(request.request_id, self, asyncio.get_running_loop())
        self._inbox.put(("submit", Sequence(request, handle)))
        return handle

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def status(self) -> dict[str, Any]:
        active, waiting = self._active, list(self._waiting)
        return {
            "running": [active.snapshot()] if active else [],
            "waiting": [s.snapshot() for s in waiting],
            "totals": dict(self.totals),
            "memory": {"active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory()},
        }

    # ---- engine thread ----

    def _run(self) -> None:
        try:
            self._warm_up()
        except Exception as e:  # noqa: BLE001 - handed to start(), which re-raises it
            self._startup_error = e
        self._ready.set()
        if self._startup_error is not None:
            return
        while self._apply_inbox(block=self._active is None and not self._waiting):
            self.step()

    def _warm_up(self) -> None:
        prompt = mx.array([1, 2, 3, 4])
        for _ in generate_step(prompt, self.model, max_tokens=max(1, self.config.warmup_tokens)):
            pass
        mx.clear_cache()

    def _apply_inbox(self, block: bool) -> bool:
        """Apply queued commands; return False once asked to stop."""
        while True:
            try:
                command, arg = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command == "stop":
                self._abort_all()
                return False
            if command == "submit":
                with self._lock:
                    self._num_pending_submits -= 1
                self._waiting.append(arg)
            elif command == "cancel":
                self._cancel(arg)

    def step(self) -> None:
        """Start the next request if idle, then advance the active one by one token."""
        if self._active is None:
            if not self._waiting:
                return
            self._active = self._begin(self._waiting.popleft())
        sequence = self._active
        try:
            self._advance(sequence)
        except (MlxdError, ValueError, RuntimeError) as e:
            log.error("request_failed", request_id=sequence.request.request_id, error=str(e))
            self.totals["num_failed"] += 1
            self._finish(sequence, Failed(str(e)))

    def _begin(self, sequence: Sequence) -> Sequence:
        request = sequence.request
        if request.sampling.seed is not None:
            mx.random.seed(request.sampling.seed)
        handle = sequence.handle
        sequence.tokens = generate_step(
            mx.array(request.prompt),
            self.model,
            max_tokens=request.max_tokens,
            sampler=make_request_sampler(request.sampling),
            logits_processors=make_request_processors(request.sampling),
            prefill_step_size=request.prefill_chunk,
            max_kv_size=self.config.max_kv_size or None,
            prompt_progress_callback=lambda done, total: handle.push(Progress(done, total)),
        )
        self.totals["num_requests"] += 1
        self.totals["num_prompt_tokens"] += len(request.prompt)
        return sequence

    def _advance(self, sequence: Sequence) -> None:
        token = next(sequence.tokens, None)
        if sequence.first_token_at is None:
            sequence.first_token_at = time.monotonic()
        if token is None:
            self._finish(sequence, self._finished(sequence, "length"))
            return
        token = token[0]
        if token in sequence.request.stop_token_ids:
            self._finish(sequence, self._finished(sequence, "stop"))
            return
        sequence.num_generated += 1
        self.totals["num_generated_tokens"] += 1
        sequence.handle.push(Token(token))
        if sequence.num_generated >= sequence.request.max_tokens:
            self._finish(sequence, self._finished(sequence, "length"))

    @staticmethod
    def _finished(sequence: Sequence, reason: str) -> Finished:
        return Finished(reason=reason, num_prompt_tokens=len(sequence.request.prompt))

    def _finish(self, sequence: Sequence, event: Finished | Failed) -> None:
        sequence.handle.push(event)
        if sequence is self._active:
            self._active = None
            sequence.tokens = None
            mx.clear_cache()

    def _cancel(self, request_id: str) -> None:
        if self._active is not None and self._active.request.request_id == request_id:
            self._finish(self._active, self._finished(self._active, "cancelled"))
            return
        for sequence in self._waiting:
            if sequence.request.request_id == request_id:
                self._waiting.remove(sequence)
                sequence.handle.push(self._finished(sequence, "cancelled"))
                return

    def _abort_all(self) -> None:
        for sequence in [*([self._active] if self._active else []), *self._waiting]:
            sequence.handle.push(Failed("the server is shutting down"))
        self._active = None
        self._waiting.clear()
