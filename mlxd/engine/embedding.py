"""The engine of a ``kind = "embedding"`` model: requests' inputs pooled into vectors, batched on its own thread.

The event loop hands over an :class:`EmbeddingRequest` (texts or token id lists) and awaits its
:class:`Embedded` answer. The engine thread takes every request waiting, tokenizes and checks their inputs (an empty
or over-long one, or a token id outside the vocabulary, is a ``RequestError`` naming ``input[i]``), sorts all the
inputs by length and runs them in passes of at most :data:`MAX_PASS_ROWS` rows and ``max_pass_tokens`` padded
tokens (a :mod:`mlxd.engine.pooling` pass: a decoder's or an encoder's), so that concurrent requests share passes. MLX work runs on
the device stream (:func:`mlxd.runtime.device.device_stream`), like the batched engine's. Chat requests
(``submit``) are refused with a 400 naming the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from typing import Any

import msgspec
import numpy as np

from mlxd.errors import EngineError, MlxdError, NotReady, Overloaded, RequestError
from mlxd.log import get_logger

log = get_logger("mlxd.engine.embedding")

# Rows of one pass, and padded tokens (rows x the longest input) of one pass.
MAX_PASS_ROWS = 64
MAX_PASS_TOKENS = 16_384


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One ``/v1/embeddings`` body's work: ``texts`` (tokenized on the engine thread) or ``token_ids``, not both."""

    request_id: str
    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    dimensions: int | None = None
    # The body's input was one string or one token list: errors name ``input``, not ``input[0]``.
    single: bool = False


class Embedded(msgspec.Struct, frozen=True):
    """Float32 vectors, one row per input in input order, and the tokens they were pooled from."""

    vectors: Any  # numpy float32 array (num_inputs, dimensions)
    num_tokens: int


class _Pending:
    __slots__ = ("request", "future", "loop", "rows", "vectors", "error")

    def __init__(self, request: EmbeddingRequest, future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        self.request, self.future, self.loop = request, future, loop
        self.rows: list[list[int]] = []
        self.vectors: np.ndarray | None = None
        self.error: MlxdError | None = None


class EmbeddingEngine:
    """Pools a text model's last hidden state; the lifecycle surface (start, stop, status, failure) of an engine."""

    def __init__(self, pool: Any, tokenizer: Any, *, name: str, pooling: str, normalize: bool, truncate: bool,
                 context_length: int, max_waiting: int, gather_s: float = 0.0,
                 max_pass_tokens: int = MAX_PASS_TOKENS, turn: Any = None) -> None:
        """``pool``: :class:`mlxd.engine.pooling.DecoderPool` or ``EncoderPool``; ``pooling`` "auto" is its
        default (``last`` for decoders, ``mean`` for encoders). ``turn``: the device's
        :class:`mlxd.runtime.device_turn.DeviceTurn` when several models share it (each pass and the warm-up take
        it), None for one model."""
        self.pool, self.tokenizer, self.name = pool, tokenizer, name
        self.pooling = pool.default_pooling if pooling == "auto" else pooling
        self.normalize, self.truncate = normalize, truncate
        self.context_length, self.max_waiting, self.gather_s = context_length, max_waiting, gather_s
        self.max_pass_tokens = max(max_pass_tokens, context_length)
        self.max_running = MAX_PASS_ROWS
        self._turn = turn
        self.vocab_size = 0
        self.hidden_size = 0
        self.failure: str | None = None
        self.on_failure: Any = None
        self.totals = {"num_requests": 0, "num_inputs": 0, "num_tokens": 0, "num_passes": 0, "num_failed": 0}
        self._pending: deque[_Pending] = deque()
        self._serving: list[str] = []  # the request ids of the batch being served
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread and warm it up (one pass); returns once it serves, raises if warm-up failed."""
        self._thread = threading.Thread(target=self._run, name="mlxd-embedding", daemon=True)
        self._thread.start()
        self._started.wait()
        if self.failure is not None:
            raise EngineError(f"the embedding engine did not start: {self.failure}")

    def stop(self) -> None:
        """Fail whatever waits (503) and join the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        self.abort_all("the server is shutting down; retry the request")
        if self._thread is not None:
            self._thread.join()

    def abort_all(self, message: str) -> None:
        """End every waiting request with a 503 carrying ``message``; safe from any thread."""
        with self._wake:
            waiting, self._pending = list(self._pending), deque()
        for item in waiting:
            _resolve(item, EngineError(message, status=503))

    @property
    def num_active(self) -> int:
        return len(self._pending) + len(self._serving)

    def retry_after_s(self) -> float:
        return 1.0

    def status(self, prompts: bool = False) -> dict[str, Any]:
        """Waiting and running requests (ids only), limits, totals and MLX memory, for ``/v1/status``."""
        import mlx.core as mx

        with self._wake:
            waiting = [{"request_id": item.request.request_id} for item in self._pending]
        return {"kind": "embedding", "pooling": self.pooling, "normalize": self.normalize,
                "running": [{"request_id": request_id} for request_id in self._serving], "waiting": waiting,
                "limits": {"max_pass_rows": MAX_PASS_ROWS, "max_pass_tokens": self.max_pass_tokens,
                           "max_waiting": self.max_waiting, "context_length": self.context_length},
                "totals": dict(self.totals),
                "memory": {"active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory(),
                           "cache_bytes": mx.get_cache_memory()}}

    def cache_stats(self) -> dict[str, Any]:
        return {}  # no prefix cache: every input runs whole

    def memory_bytes(self) -> dict[str, int]:
        """Beside its weights, nothing that outlives a pass: no KV cache is kept, no prefix cache."""
        return {"kv": 0, "prefix_cache": 0}

    async def clear_prefix_cache(self) -> int:
        return 0

    async def shrink_prefix_cache(self, num_bytes: int) -> None:
        """Nothing to give back: no prefix cache."""

    def submit(self, request: Any) -> Any:
        """Chat and completion requests: refused (400), this model only embeds."""
        raise RequestError(f"model {self.name!r} is an embedding model: it serves POST /v1/embeddings only",
                           param="model")

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Nothing to end: an embedding request's client that left simply never reads its answer."""

    # -- requests -------------------------------------------------------------------------------------------
    async def embed(self, request: EmbeddingRequest) -> Embedded:
        """Queue ``request`` and wait for its vectors. Raises ``RequestError`` (400, naming ``input[i]``) for an
        input it cannot take, ``Overloaded`` when ``max_waiting`` requests wait, ``NotReady`` once stopped."""
        if self._stopping or self.failure is not None:
            raise NotReady(f"the embedding engine is not serving: {self.failure or 'stopped'}")
        loop = asyncio.get_running_loop()
        item = _Pending(request, loop.create_future(), loop)
        with self._wake:
            if len(self._pending) >= self.max_waiting:
                raise Overloaded(f"{len(self._pending)} embedding requests wait (at most {self.max_waiting}); retry "
                                 "shortly")
            self._pending.append(item)
            self._wake.notify()
        return await item.future

    # -- the engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        from mlxd.runtime.device import device_stream

        try:
            with device_stream():
                self._warm_up()
                self._started.set()
                while (batch := self._take()) is not None:
                    self._serve(batch)
        except Exception as e:  # noqa: BLE001 - the engine is gone: every waiter and the daemon are told why
            log.exception("embedding_engine_failed")
            self.failure = f"{type(e).__name__}: {e}"
            self._started.set()
            self.abort_all(f"the embedding engine stopped: {self.failure}")
            if self.on_failure is not None:
                self.on_failure(self.failure)

    def _warm_up(self) -> None:
        """One pass (the vocabulary and hidden size measured from the model's own arrays)."""
        with self._device_turn():
            self.vocab_size = self.pool.vocab_size()
            self.hidden_size = int(self.pool([[0], [0, 0]], self.pooling, self.normalize).shape[-1])

    def _device_turn(self) -> Any:
        return self._turn.held(self.name) if self._turn is not None else contextlib.nullcontext()

    def _take(self) -> list[_Pending] | None:
        """Every waiting request (None once stopping). The first to arrive waits until no other has arrived for
        ``gather_s`` (at most ten times that), so that requests sent together share passes."""
        with self._wake:
            while not self._pending and not self._stopping:
                self._wake.wait()
            deadline = time.monotonic() + 10 * self.gather_s
            while self.gather_s and not self._stopping and time.monotonic() < deadline:
                num_pending = len(self._pending)
                self._wake.wait(min(self.gather_s, max(0.0, deadline - time.monotonic())))
                if len(self._pending) == num_pending:
                    break
            if self._stopping:
                return None
            batch, self._pending = list(self._pending), deque()
            self._serving = [item.request.request_id for item in batch]
            return batch

    def _serve(self, batch: list[_Pending]) -> None:
        """Tokenize and check each request's inputs, run all their rows in shared passes, answer each request."""
        started = time.monotonic()
        for item in batch:
            try:
                item.rows = self._rows(item.request)
            except MlxdError as e:
                item.error = e
            except Exception as e:  # noqa: BLE001 - this request fails (500), logged; the engine goes on
                log.exception("embedding_tokenize_failed", request_id=item.request.request_id)
                item.error = EngineError(f"the inputs could not be tokenized: {type(e).__name__}")
        ready = [item for item in batch if item.error is None]
        try:
            self._pool(ready)
        except Exception as e:  # noqa: BLE001 - these requests fail (500), logged; the engine goes on
            log.exception("embedding_pass_failed", num_requests=len(ready))
            for item in ready:
                item.error = EngineError(f"the embedding pass failed: {type(e).__name__}")
        for item in batch:
            self._finish(item)
        self._serving = []
        log.debug("embedding_batch", num_requests=len(batch), seconds=round(time.monotonic() - started, 4))

    def _rows(self, request: EmbeddingRequest) -> list[list[int]]:
        """The request's inputs as token id lists, checked: not empty, within the vocabulary, within
        ``context_length`` (or cut to it when ``truncate``)."""
        if request.texts is not None:
            rows = [list(self.tokenizer.encode(text)) for text in request.texts]
        else:
            rows = [list(ids) for ids in request.token_ids or []]
        checked = []
        for index, row in enumerate(rows):
            field = "input" if request.single else f"input[{index}]"
            if not row:
                raise RequestError(f"{field} is empty: nothing to embed", param=field)
            if request.token_ids is not None and not all(0 <= token < self.vocab_size for token in row):
                bad = next(token for token in row if not 0 <= token < self.vocab_size)
                raise RequestError(f"{field} holds token id {bad}, outside this model's vocabulary (0 to "
                                   f"{self.vocab_size - 1})", param=field)
            if len(row) > self.context_length:
                if not self.truncate:
                    raise RequestError(f"{field} is {len(row)} tokens, more than this model's {self.context_length} "
                                       "(truncate = true in the model's config cuts inputs to fit)", param=field)
                row = row[: self.context_length]
            checked.append(row)
        return checked

    def _pool(self, items: list[_Pending]) -> None:
        """All the items' rows, shortest first, in passes within the row and token bounds; each item's vectors."""
        flat = [(position, row) for position, row in enumerate(row for item in items for row in item.rows)]
        flat.sort(key=lambda pair: len(pair[1]))
        vectors = np.zeros((len(flat), self.hidden_size), dtype=np.float32)
        start = 0
        while start < len(flat):
            end = start + 1
            while (end < len(flat) and end - start < MAX_PASS_ROWS
                   and (end + 1 - start) * len(flat[end][1]) <= self.max_pass_tokens):
                end += 1
            chunk = flat[start:end]
            with self._device_turn():
                vectors[[position for position, _ in chunk]] = self.pool([row for _, row in chunk], self.pooling,
                                                                         self.normalize)
            self.totals["num_passes"] += 1
            start = end
        offset = 0
        for item in items:
            item.vectors = vectors[offset: offset + len(item.rows)]
            offset += len(item.rows)

    def _finish(self, item: _Pending) -> None:
        from mlxd.engine.pooling import shorten

        self.totals["num_requests"] += 1
        if item.error is not None:
            self.totals["num_failed"] += 1
            _resolve(item, item.error)
            return
        num_tokens = sum(len(row) for row in item.rows)
        self.totals["num_inputs"] += len(item.rows)
        self.totals["num_tokens"] += num_tokens
        vectors = shorten(item.vectors, item.request.dimensions, self.normalize)
        _resolve(item, Embedded(vectors, num_tokens))


def _resolve(item: _Pending, outcome: Embedded | MlxdError) -> None:
    """Hand ``outcome`` to the request's event loop (nothing when its client has gone or the loop is closed)."""

    def deliver() -> None:
        if item.future.done():
            return
        if isinstance(outcome, MlxdError):
            item.future.set_exception(outcome)
        else:
            item.future.set_result(outcome)

    try:
        item.loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # a closed event loop: nobody waits for this answer any more
        return


def make_embedding_engine(model_config: Any, engine_config: Any, loaded: Any, name: str,
                          turn: Any = None) -> EmbeddingEngine:
    """The engine for a ``kind = "embedding"`` model (``model_config``: its ``ModelConfig``; ``loaded``: the
    :class:`mlxd.models.load.LoadedModel`; ``turn``: the device's turn when several models share it)."""
    from mlxd.engine.pooling import make_pool

    return EmbeddingEngine(make_pool(loaded, engine_config.prefill_chunk), loaded.tokenizer, name=name, pooling=model_config.pooling,
                           normalize=model_config.normalize, truncate=model_config.truncate,
                           context_length=loaded.context_length, max_waiting=engine_config.max_waiting,
                           gather_s=engine_config.gather_ms / 1000, turn=turn)
