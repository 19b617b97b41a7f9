"""The batching engine: continuous batching on one engine thread.

Every MLX call happens on the engine thread. The event loop only puts commands in the inbox (submit, cancel, stop)
and reads events from each request's :class:`RequestHandle`; the engine thread applies the commands between steps,
so a cancelled request leaves the batch within one prompt chunk or one decode step.

One :meth:`BatchedEngine.step` is: schedule (:class:`Scheduler`, plain Python) → run the batch (prompt chunks, whole
short prompts together in one pass, then one decode step for every decoding request) → post-process (emit tokens,
finish requests, free their rows).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Failed, Finished, Progress, RequestHandle, SamplingParams, Token
from mlxd.engine.batch import (
    DecodeBatch,
    Row,
    can_batch_prompts,
    make_request_cache,
    process_prompt,
    process_prompts,
)
from mlxd.engine.prefix import PromptReuse, is_trimmable
from mlxd.engine.scheduler import Scheduler, SequenceState
from mlxd.errors import Overloaded
from mlxd.log import get_logger

log = get_logger("mlxd.engine")


@dataclass(slots=True, eq=False)
class Submitted:
    """A request the engine has taken on: what was asked, where its events go, what the scheduler tracks."""

    request: EngineRequest
    handle: RequestHandle
    state: SequenceState
    # Tokens fed to the model after the prompt (every emitted token, and a stop token): with the prompt, what its
    # cache holds, so that it can be kept for the next turn of a conversation.
    generated: list[int] = field(default_factory=list)


class BatchedEngine:
    """Serves many requests at once: chunked prompt processing interleaved with batched decode steps."""

    def __init__(self, model: Any, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.scheduler = Scheduler(
            max_running=config.max_running,
            max_waiting=config.max_waiting,
            step_token_budget=config.step_token_budget,
        )
        self.batch = DecodeBatch(model)
        self._requests: dict[str, Submitted] = {}
        self._prefilling: dict[str, Row] = {}  # rows whose prompt is still going in, each with its own cache
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlxd-engine", daemon=True)
        self._lock = threading.Lock()
        self._pending: dict[str, Submitted] = {}  # submitted on the event loop, not yet applied here
        self._outbox: list[tuple[RequestHandle, Any]] = []  # events of this step, handed over together
        self.reuse = PromptReuse(config.prefix_cache_bytes)
        # Caches that cannot be trimmed (recurrent layers) hit only where snapshotted: at checkpoints.
        self._trimmable = is_trimmable(make_request_cache(model, config.max_kv_size))
        self.totals = {
            "num_requests": 0, "num_prompt_tokens": 0, "num_generated_tokens": 0,
            "num_cancelled": 0, "num_failed": 0, "num_steps": 0,
        }

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
        state = SequenceState(
            request_id=request.request_id,
            num_prompt_tokens=len(request.prompt),
            prefill_chunk=request.prefill_chunk,
            max_tokens=request.max_tokens,
        )
        submitted = Submitted(request, RequestHandle(request.request_id, self, asyncio.get_running_loop()), state)
        with self._lock:
            if not self.scheduler.can_add(num_pending=len(self._pending)):
                raise Overloaded(
                    f"{self.config.max_running} requests are running and {self.config.max_waiting} waiting "
                    "(the most allowed); retry shortly"
                )
            self._pending[request.request_id] = submitted
        self._inbox.put(("submit", submitted))
        return submitted.handle

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

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
        return {
            "running": [s.snapshot() for s in running],
            "waiting": [s.snapshot() for s in [*waiting, *pending]],
            "limits": {
                "max_running": self.config.max_running,
                "max_waiting": self.config.max_waiting,
                "step_token_budget": self.config.step_token_budget,
            },
            "totals": dict(self.totals),
            "memory": {
                "active_bytes": mx.get_active_memory(),
                "peak_bytes": mx.get_peak_memory(),
                "cache_bytes": mx.get_cache_memory(),
            },
        }

    # ---- engine thread ----

    def _run(self) -> None:
        with mx.stream(generation_stream):
            self._serve()
        mx.synchronize(generation_stream)  # nothing of ours may still be running when the thread ends

    def _serve(self) -> None:
        try:
            self._warm_up()
        except Exception as e:  # noqa: BLE001 - handed to start(), which re-raises it
            self._startup_error = e
        self._ready.set()
        if self._startup_error is not None:
            return
        try:
            while self._apply_inbox(block=not self.scheduler.has_work):
                if self.scheduler.has_work:
                    self.step()
                else:
                    mx.clear_cache()  # idle: give the freed buffers back
                self._send()
        finally:
            self._send()

    def _warm_up(self) -> None:
        """Run the shapes serving will use (a full prompt chunk; decode batches of 1, 2, 4, … max_running):
        MLX's GPU backends compile kernels per shape, and the first request should not pay for it."""
        greedy, chunk = SamplingParams(), self.config.prefill_chunk
        row = Row.for_request("warm-up", greedy, self.model, self.config.max_kv_size)
        process_prompt(self.model, row, [1] * chunk, last=False)
        sizes = sorted({min(1 << i, self.config.max_running) for i in range(self.config.max_running.bit_length())})
        for size in sizes:
            batch = DecodeBatch(self.model)
            for i in range(size):
                row = Row.for_request(f"warm-up-{i}", greedy, self.model, self.config.max_kv_size)
                batch.add(row, process_prompt(self.model, row, [1, 2, 3, 4], last=True))
            for _ in range(max(1, self.config.warmup_tokens)):
                batch.step()
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
                self._accept(arg)
            elif command == "cancel":
                self._cancel(arg)
            elif command == "clear_cache":
                loop, future = arg
                loop.call_soon_threadsafe(future.set_result, self.reuse.clear())

    def _accept(self, submitted: Submitted) -> None:
        self._reuse_prefix(submitted)
        with self._lock:
            del self._pending[submitted.request.request_id]
            self.scheduler.add(submitted.state)
        self._requests[submitted.request.request_id] = submitted

    def _reuse_prefix(self, submitted: Submitted) -> None:
        """Start the prompt after the longest state the prefix cache holds for it."""
        request, state = submitted.request, submitted.state
        hit = self.reuse.lookup(request.prompt)
        state.cache_hit, state.num_cached_tokens = hit.kind, hit.num_cached
        if hit.cache is None:
            return
        row = self._new_row(request, hit.cache)
        state.num_prefilled = hit.num_cached
        if row.processors:
            row.history = mx.array(request.prompt[: hit.num_cached], dtype=mx.uint32)

    def step(self) -> None:
        """One engine step: schedule → run the batch → post-process."""
        plan = self.scheduler.schedule()
        # Whole short prompts share a forward pass, except where snapshots must land on checkpoints.
        together = self._prompts_together(plan.prefill) if self._trimmable else []
        for state, num_tokens in plan.prefill:
            if state not in together:
                self._prefill(self._requests[state.request_id], num_tokens)
        self._prefill_together([self._requests[state.request_id] for state in together])
        tokens = self._decode()
        self._post_process(tokens)
        self.totals["num_steps"] += 1

    def _prefill(self, submitted: Submitted, num_tokens: int) -> None:
        """Process one prompt chunk; a request whose prompt is complete joins the decode batch."""
        request, state = submitted.request, submitted.state
        row = self._prefilling.get(request.request_id) or self._new_row(request)
        start = state.num_prefilled
        num_tokens = self.reuse.chunk_end(start, num_tokens, request.checkpoints, self._trimmable)
        end = start + num_tokens
        try:
            first = process_prompt(self.model, row, request.prompt[start:end], last=end == len(request.prompt))
        except (ValueError, RuntimeError) as e:
            self._fail(request.request_id, e)
            return
        if first is None:  # a chunk boundary: keep the work, even if the request is cancelled later
            self.reuse.keep(request.prompt[:end], row.cache)
        self.scheduler.on_prefilled(state, num_tokens)
        self._post(submitted, Progress(state.num_prefilled, state.num_prompt_tokens))
        if first is not None:
            del self._prefilling[request.request_id]
            self.batch.add(row, first)

    @staticmethod
    def _prompts_together(chunks: list[tuple[SequenceState, int]]) -> list[SequenceState]:
        """Whole prompts (one chunk each) worth one left-padded forward pass: the shortest ones, as many as keep
        the padded batch within twice their real tokens."""
        whole = sorted((s for s, n in chunks if s.num_prefilled == 0 and n == s.num_prompt_tokens),
                       key=lambda s: s.num_prompt_tokens)
        total, count = 0, 0
        for i, state in enumerate(whole):
            total += state.num_prompt_tokens
            if (i + 1) * state.num_prompt_tokens <= 2 * total:
                count = i + 1
        return whole[:count] if count > 1 else []

    def _prefill_together(self, group: list[Submitted]) -> None:
        """Process whole short prompts in one forward pass; they join the decode batch together."""
        if not group:
            return
        rows = [self._prefilling.get(s.request.request_id) or self._new_row(s.request) for s in group]
        if not can_batch_prompts(rows):
            for submitted in group:
                self._prefill(submitted, submitted.state.num_prompt_tokens)
            return
        try:
            cache, first = process_prompts(self.model, rows, [s.request.prompt for s in group])
        except (ValueError, RuntimeError) as e:
            for submitted in group:
                self._fail(submitted.request.request_id, e)
            return
        for submitted in group:
            state = submitted.state
            self.scheduler.on_prefilled(state, state.num_prompt_tokens)
            self._post(submitted, Progress(state.num_prefilled, state.num_prompt_tokens))
            del self._prefilling[submitted.request.request_id]
        self.batch.add_batch(rows, cache, first)

    def _new_row(self, request: EngineRequest, cache: list[Any] | None = None) -> Row:
        if request.sampling.seed is not None:
            mx.random.seed(request.sampling.seed)
        row = Row.for_request(request.request_id, request.sampling, self.model, self.config.max_kv_size, cache)
        self._prefilling[request.request_id] = row
        self.totals["num_requests"] += 1
        self.totals["num_prompt_tokens"] += len(request.prompt)
        return row

    def _decode(self) -> list[int]:
        if not len(self.batch):
            return []
        try:
            return self.batch.step()
        except (ValueError, RuntimeError) as e:
            for request_id in self.batch.request_ids:
                self._fail(request_id, e)
            return []

    def _post_process(self, tokens: list[int]) -> None:
        """Emit each row's token; finish the rows that hit a stop token or their ``max_tokens``."""
        finished: dict[str, str] = {}
        for request_id, token in zip(self.batch.request_ids, tokens, strict=True):
            reason = self._emit(self._requests[request_id], token)
            if reason is not None:
                finished[request_id] = reason
        if finished:
            for request_id in finished:
                self._keep_decoded(request_id)
            self.batch.remove(set(finished))
            for request_id, reason in finished.items():
                self._finish(request_id, reason)

    def _emit(self, submitted: Submitted, token: int) -> str | None:
        state = submitted.state
        submitted.generated.append(token)
        if state.first_token_at is None:
            state.first_token_at = time.monotonic()
        if token in submitted.request.stop_token_ids:
            return "stop"
        state.num_generated += 1
        self.totals["num_generated_tokens"] += 1
        self._post(submitted, Token(token))
        return "length" if state.num_generated >= state.max_tokens else None

    def _finish(self, request_id: str, reason: str) -> None:
        submitted = self._release(request_id)
        if submitted is not None:
            state = submitted.state
            self._post(submitted, Finished(reason=reason, num_prompt_tokens=len(submitted.request.prompt),
                                           num_cached_tokens=state.num_cached_tokens, cache_hit=state.cache_hit))

    def _keep_decoded(self, request_id: str) -> None:
        """Snapshot a decoding request's prompt + generated tokens (finished or cancelled) for later turns."""
        submitted = self._requests.get(request_id)
        if submitted is not None and self.reuse.cache is not None:
            tokens = submitted.request.prompt + submitted.generated
            self.reuse.keep(tokens, self.batch.row_cache(request_id))

    def _fail(self, request_id: str, error: BaseException) -> None:
        log.error("request_failed", request_id=request_id, error=str(error))
        self.batch.remove({request_id})
        submitted = self._release(request_id)
        if submitted is not None:
            self.totals["num_failed"] += 1
            self._post(submitted, Failed(str(error)))

    def _cancel(self, request_id: str) -> None:
        if request_id not in self._requests:
            return  # already finished: cancel is idempotent
        if request_id in self.batch.request_ids:
            self._keep_decoded(request_id)
        self.batch.remove({request_id})
        self.totals["num_cancelled"] += 1
        self._finish(request_id, "cancelled")

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

    def _abort_all(self) -> None:
        for submitted in self._requests.values():
            self._post(submitted, Failed("the server is shutting down"))
        self.batch.remove(set(self._requests))
        self._requests.clear()
        self._prefilling.clear()
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
