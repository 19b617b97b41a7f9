"""The engine interface: submit a request, get a stream of token events, cancel.

Pipeline stages (``prefill``, ``decode``) are thin clients of this interface, so engines can be swapped without
touching the pipeline. Nothing here imports MLX: engines do, on their own thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling settings. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None


class Media(msgspec.Struct, frozen=True, kw_only=True):
    """A request's images, processed for the model by the ``template`` stage; they travel with the token ids.

    ``inputs`` are the processor's outputs besides the token ids (``pixel_values``, ``image_grid_thw``, ...), as
    numpy arrays: the engine turns them into MLX arrays on its own thread. ``digests`` identify each image by its
    bytes (sha256) and ``spans`` give each image's placeholder tokens in the prompt, ``[start, end)``, both in
    prompt order: the prefix cache keys image spans by digest, the feature cache keys features by digest.
    """

    digests: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    inputs: dict[str, Any]


class Plain(msgspec.Struct, frozen=True, kw_only=True):
    """Decode one token per forward pass. ``reason``: why the request is not speculative (shown in its log line
    and ``/v1/status``)."""

    reason: str = "no drafter configured"


class Speculative(msgspec.Struct, frozen=True, kw_only=True):
    """Decode with drafted tokens: each step the row feeds its last token plus up to ``k`` drafted ones and keeps
    the longest prefix the model agrees with (greedy), or what rejection sampling accepts (temperature > 0).
    ``adaptive``: the draft length follows the row's recent acceptance, and the row backs off to plain steps when
    drafting does not pay."""

    drafter: str
    k: int
    adaptive: bool = True


DecodeMode = Plain | Speculative


class EngineRequest(msgspec.Struct, kw_only=True):
    """What a pipeline hands the engine: token ids in, at most ``max_tokens`` token ids out."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()
    prefill_chunk: int = 512
    # Prompt positions worth a prefix-cache snapshot (the end of the last message, before the generation
    # prompt): caches that cannot be trimmed can only hit at positions they were snapshotted at.
    checkpoints: tuple[int, ...] = ()
    # Images (vision requests): their prompt chunks are run with the images' features merged in.
    media: Media | None = None
    # The path the ``route`` stage chose: "vision" (the engine encodes the images and merges their features
    # into the prompt's chunks) or "text". The rendered prompt (chat template applied) is for /v1/status only.
    route: str = "text"
    prompt_text: str = ""
    # Per-request constraints (a grammar, say): a factory the engine calls once per row for a fresh list of mlx-lm
    # style logits processors, ``processor(tokens, logits) -> logits``, applied after the penalties and bias.
    logits_processors: Callable[[], list[Any]] | None = None
    # Log-probabilities of the generated tokens: None for none, else how many top alternatives (0 to 20) too.
    num_logprobs: int | None = None
    # Snapshot the prompt's state into the prefix cache once it is processed: requests with the same prompt
    # submitted next (the other choices of an ``n`` > 1 request) start from it.
    keep_prompt: bool = False
    # How the request decodes: set by the ``route`` stage.
    decode: DecodeMode = Plain()
    # Called on the event loop with the request's last event (``Finished`` or ``Failed``), whether or not anyone
    # still reads its stream: the request log line of a client that left waits for the engine's account.
    on_end: Callable[[Finished | Failed], None] | None = None


class Token(msgspec.Struct, frozen=True):
    """One generated token id (never a stop token); with its log-probability under the raw logits and the top
    alternatives ``(token id, logprob)`` when the request asked for them."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class Tokens(msgspec.Struct, frozen=True):
    """Consecutive :class:`Token` events of one stream that were queued together (paced, or several from one step):
    the pipeline's ``decode`` stage hands them on as one, so later stages make one frame of them."""

    tokens: tuple[Token, ...]


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    """The last event of every stream. ``reason``: ``stop`` (a stop token, or the pipeline ended the request:
    a stop sequence, a parser), ``length``, ``cancelled``."""

    reason: str
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    # How the prefix cache served the prompt: miss, exact, prefix, longer, diverged.
    cache_hit: str = "miss"
    # How it decoded: {"mode": "plain", "reason": ...}, or a speculative request's drafter and counters.
    decode: dict[str, Any] | None = None
    # Prompt tokens this request ran through the model (after its ``num_cached_tokens``): the whole rest of the
    # prompt once a first token came, the chunks it finished when it ended before (cancelled: those stay cached).
    num_prompt_computed: int = 0
    # Seconds from reaching the engine to its first prompt chunk (waiting for admission), and from there to its
    # first token (prompt processing, vision tower included, interleaved with other rows' steps). A request that
    # ended before either counts until its end (never admitted: ``prefill_s`` 0).
    queued_s: float | None = None
    prefill_s: float | None = None


class Failed(msgspec.Struct, frozen=True):
    """The engine could not serve this request; the stream ends here.

    ``message`` is safe to show the client (no exception text, no paths: those go to the log). ``status`` is 500
    for a failure inside the engine, 503 when the request was ended because the server is going away, waited in
    the queue too long, or the engine is gone.
    """

    message: str
    status: int = 500


class Progress(msgspec.Struct, frozen=True):
    """Prompt processing progress; lets streaming clients be kept alive during long prefills."""

    num_processed: int
    num_total: int


EngineEvent = Token | Finished | Failed | Progress
# The events that end a stream, as a tuple: ``isinstance`` against ``Finished | Failed`` would build the union
# again for every token.
LAST_EVENTS = (Finished, Failed)


class RequestHandle:
    """The event-loop side of one submitted request.

    The engine thread calls :meth:`push_all`; the event loop iterates :meth:`events`. :meth:`cancel`
    asks the engine (on its own thread) to abort the request and release its memory.

    Events wait in a deque; a stream waiting for the next one awaits one future. The keepalive timer is not made and
    cancelled for every event: it is armed when a wait starts with none armed, and when it fires during a wait that
    began later, it re-arms itself for the rest of that wait. A stream of tokens then costs the event loop one timer
    per ``keepalive_s``, not one per token.
    """

    def __init__(self, request_id: str, engine: Engine, loop: asyncio.AbstractEventLoop,
                 on_end: Callable[[Finished | Failed], None] | None = None) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._on_end = on_end  # the request's ``on_end``: told its last event, read or not
        self._events: deque[EngineEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None  # what a stream waiting for an event awaits
        self._waiting_since = 0.0  # loop time the current wait began
        self._timer: asyncio.TimerHandle | None = None  # the keepalive timer, armed while a stream may wait
        self.done = False

    @staticmethod
    def push_all(events: list[tuple[RequestHandle, EngineEvent]]) -> None:
        """Thread-safe: hand many events over with one wake-up of each event loop (one per engine step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, EngineEvent]]] = {}
        for handle, event in events:
            by_loop.setdefault(handle._loop, []).append((handle, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # a closed event loop: nobody is listening to these requests any more
                continue

    def _deliver(self, event: EngineEvent) -> None:
        """On the event loop: queue ``event`` and wake the stream waiting for it; a last event also goes to
        ``on_end``."""
        self._events.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._on_end is not None and isinstance(event, LAST_EVENTS):
            on_end, self._on_end = self._on_end, None
            on_end(event)

    def cancel(self, reason: str = "cancelled") -> None:
        """End the request early: ``cancelled`` (the client went away) or ``stop`` (the pipeline has what it needs:
        a stop sequence matched, a parser ended the response)."""
        if not self.done:
            self.done = True
            self._engine.cancel(self.request_id, reason)

    def take_tokens(self) -> list[Token]:
        """The :class:`Token` events queued now, up to the first event of another kind (taken off the queue)."""
        taken: list[Token] = []
        events = self._events
        while events and type(events[0]) is Token:
            taken.append(events.popleft())
        return taken

    async def events(self, keepalive_s: float | None = None) -> AsyncIterator[EngineEvent | None]:
        """Yield engine events until the stream ends; yield ``None`` after ``keepalive_s`` of silence."""
        try:
            while True:
                if not self._events and not await self._wait(keepalive_s):
                    yield None
                    continue
                event = self._events.popleft()
                if isinstance(event, LAST_EVENTS):
                    self.done = True
                    yield event
                    return
                yield event
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    async def _wait(self, keepalive_s: float | None) -> bool:
        """Wait for an event: True once one is queued, False after ``keepalive_s`` of waiting without one. A plain
        future is awaited, so a cancellation of the waiting task (the client gone) propagates as it should."""
        self._waiter = waiter = self._loop.create_future()
        self._waiting_since = self._loop.time()
        if keepalive_s is not None and self._timer is None:
            self._timer = self._loop.call_later(keepalive_s, self._check_silence, keepalive_s)
        try:
            await waiter
        finally:
            self._waiter = None
        return bool(self._events)

    def _check_silence(self, keepalive_s: float) -> None:
        """The keepalive timer: wake the waiting stream with nothing once it has waited ``keepalive_s``; if it
        started waiting later than that (events came meanwhile), fire again when it will have."""
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return  # not waiting now: the next wait arms the timer
        left = self._waiting_since + keepalive_s - self._loop.time()
        if left > 0.001:
            self._timer = self._loop.call_later(left, self._check_silence, keepalive_s)
        else:
            self._waiter.set_result(None)


def _deliver_all(items: list[tuple[RequestHandle, EngineEvent]]) -> None:
    for handle, event in items:
        handle._deliver(event)


class Engine(Protocol):
    """What every engine provides. All MLX work happens on the engine's own thread."""

    def start(self) -> None:
        """Start the engine thread and warm up; returns when the engine is ready to serve."""

    # Why the engine thread ended on its own (None while it serves or after stop()); ``on_failure``, when set, is
    # called with that reason from the engine thread as it ends.
    failure: str | None
    on_failure: Callable[[str], None] | None
    # The model's logits width, known once started: token ids at or above it are outside the vocabulary.
    vocab_size: int

    def stop(self) -> None:
        """Abort everything and join the engine thread."""

    def submit(self, request: EngineRequest) -> RequestHandle:
        """Queue a request. Call from the event loop. Raises ``Overloaded`` (with ``retry_after``) when the queue
        is full, ``NotReady`` once the engine has stopped or failed."""

    def abort_all(self, message: str) -> None:
        """End every request the engine holds with ``Failed(message, status=503)``; safe from any thread."""

    @property
    def num_active(self) -> int:
        """Requests submitted and not ended yet (pending, waiting, running); safe from any thread."""

    def retry_after_s(self) -> float:
        """Seconds a client turned away now should wait, estimated from the queue (at least 1)."""

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """End a request early with ``reason`` (``cancelled`` or ``stop``); safe to call from any thread, any
        number of times. Only ``cancelled`` counts as a cancellation in the status totals."""

    def status(self) -> dict:
        """A JSON-able snapshot: running and waiting requests, totals, memory."""
