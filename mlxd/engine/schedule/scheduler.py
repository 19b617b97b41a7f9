"""The scheduler: which requests run in the next engine step, and how much of each prompt they process.

Plain Python over token counts. The engine keeps each request's MLX state (caches, samplers) in its own store,
keyed by request id; this module never imports MLX, so it is unit-tested without a model.

A request waits in ``waiting`` until a running slot is free, then runs in two phases: ``prefill`` (its prompt, in
chunks of its ``prefill_chunk`` tokens) and ``decode`` (one token per step, batched with every other decoding
request). Each step spends at most ``step_token_budget`` tokens: every decoding request gets its token, prompt chunks
take what is left (the first chunk of a step always goes, so a prompt is never starved by a full decode batch).
Chunks are never split by the budget, so an n-token prompt takes exactly ceil(n / chunk) forward passes. A burst of
whole text prompts at the head of the queue may start together beyond the budget, up to ``max_pass_tokens`` (0: off),
in one pass beside the decode step, while that pass's transient bytes (``pass_bytes_per_token`` times its padded
tokens) and every reservation, the burst's own included, fit ``kv_budget_bytes`` together. Nothing is preempted.

Memory: each request carries ``num_kv_bytes``, what its KV cache can grow to (prompt + ``max_tokens``), and the
running requests may reserve at most ``kv_budget_bytes`` together. In the decode batch every row is left-padded to
the longest one, so ``num_running`` requests reserve ``row_width(num_running) x`` the largest ``num_kv_bytes`` among
them, not the sum (``row_width``: the rows the batch occupies, filler rows of a padded bucket included). The head of the queue is admitted only when it fits; nothing overtakes it (FIFO), so a large request waits
for room instead of being starved by small ones. Reservations end when a request is removed.

A request whose images are still being encoded (``encoding``, beside the engine's steps) waits in the queue without
being its head: the requests behind it go first, and it is admitted once its images are in.

Several models under one memory budget (``[server] models_memory_bytes``): the scheduler's ``shared`` (a
:class:`SharedKV`, the registry's) also has to grant each admission's reservation beside the other models' weights
and reservations; the head that it refuses waits, as it does when its own budget is full, until another model's
rows end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Phase = Literal["waiting", "prefill", "decode"]


@dataclass(slots=True, eq=False)
class SequenceState:
    """What the scheduler knows about one request: counts and timings, no tensors."""

    request_id: str
    num_prompt_tokens: int
    prefill_chunk: int
    max_tokens: int
    # Bytes its KV cache can grow to (prompt + max_tokens): what admission reserves for it.
    num_kv_bytes: int = 0
    phase: Phase = "waiting"
    num_prefilled: int = 0
    num_generated: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    # How the prefix cache served the prompt.
    cache_hit: str = "miss"
    num_cached_tokens: int = 0
    route: str = "text"  # the path the ``route`` stage chose: "text" or "vision"
    encoding: bool = False  # its images are being encoded: it may not start yet
    prompt_text: str = ""  # the rendered prompt, shown (clipped) in /v1/status
    # Tokens it feeds a decode step: 1, or 1 + its drafts when speculative (what the step token budget counts).
    num_feeding: int = 1
    # How it decodes, for /v1/status: {"mode": "plain", "reason": ...} or the speculative row's live counters.
    decode: Any = None

    @classmethod
    def for_request(cls, request: Any) -> SequenceState:
        """The state of an engine request (``EngineRequest``) as it is submitted."""
        return cls(request_id=request.request_id, num_prompt_tokens=len(request.prompt),
                   prefill_chunk=request.prefill_chunk, max_tokens=request.max_tokens, route=request.route,
                   prompt_text=request.prompt_text)

    @property
    def vision(self) -> bool:
        """Whether the request takes the vision path (its images encoded and merged into its prompt): the ``route``
        stage's decision, the one place the engine reads it from."""
        return self.route == "vision"

    @property
    def num_prompt_remaining(self) -> int:
        return self.num_prompt_tokens - self.num_prefilled

    def next_chunk(self) -> int:
        return min(self.prefill_chunk, self.num_prompt_remaining)

    def snapshot(self, prompt: bool = False) -> dict[str, Any]:
        """The JSON-able view ``GET /v1/status`` shows for this request; its rendered prompt (clipped) only when
        ``prompt`` asks for it."""
        now = time.monotonic()
        first = self.first_token_at
        elapsed = now - first if first is not None else 0.0
        return {
            "request_id": self.request_id,
            "phase": "encoding" if self.encoding else self.phase,
            "route": self.route,
            **({"prompt": _clip(self.prompt_text)} if prompt else {}),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_prefilled_tokens": self.num_prefilled,
            "cache_hit": {"kind": self.cache_hit, "num_tokens": self.num_cached_tokens},
            "num_generated_tokens": self.num_generated,
            "kv_reserved_bytes": self.num_kv_bytes,
            "decode": self.decode() if callable(self.decode) else self.decode,
            "tokens_per_s": round((self.num_generated - 1) / elapsed, 2) if elapsed > 0 else None,
            "ttft_s": round(first - self.submitted_at, 4) if first is not None else None,
            "age_s": round(now - self.submitted_at, 3),
        }


def _clip(text: str, limit: int = 4096) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}…[{len(text) - limit} characters]…{text[-half:]}"


@dataclass(slots=True)
class StepPlan:
    """One step's work: prompt chunks ``(sequence, num_tokens)`` and the sequences that decode one token."""

    prefill: list[tuple[SequenceState, int]]
    decode: list[SequenceState]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_feeding for s in self.decode) + sum(n for _, n in self.prefill)


class SharedKV(Protocol):
    """A memory budget this engine shares with others (:class:`mlxd.models_budget.KVLedger`'s share for one model);
    thread-safe, plain Python."""

    def claim(self, num_bytes: int) -> bool:
        """Whether this engine's running requests may reserve ``num_bytes`` in all beside what the other engines
        hold; when yes, that much is held for it (until the next ``claim`` or ``settle``). Never refuses less
        than what is held already."""
        ...

    def settle(self, num_bytes: int) -> None:
        """What this engine's running requests reserve now (rows ended, or a claim not taken up)."""
        ...

    def fits_alone(self, num_bytes: int) -> bool:
        """Whether ``num_bytes`` of reservations fit beside the loaded models' weights, once no other engine
        reserves anything."""
        ...


class Scheduler:
    """Owns the ``waiting`` and ``running`` queues; :meth:`schedule` plans one step."""

    def __init__(self, *, max_running: int, max_waiting: int, step_token_budget: int,
                 kv_budget_bytes: int | None = None) -> None:
        if min(max_running, max_waiting, step_token_budget) < 1:
            raise ValueError("max_running, max_waiting and step_token_budget must be at least 1")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.step_token_budget = step_token_budget
        # Bytes the running requests' KV caches may reserve together; None: no limit. The engine lowers it by
        # what the prefix cache holds, each step.
        self.kv_budget_bytes = kv_budget_bytes
        # Tokens of whole text prompts one step may start together, in one pass, beyond step_token_budget (a
        # burst); the engine sets it from what memory allows (mlxd.engine.schedule.memory.max_pass_tokens). 0: none.
        self.max_pass_tokens = 0
        # Bytes a prompt pass holds per token while it runs (the engine's measure); 0: a burst is bounded by
        # max_pass_tokens alone.
        self.pass_bytes_per_token = 0
        # The rows a decode batch of n requests occupies: n, or its bucket where the engine pads decode steps.
        self.row_width: Callable[[int], int] = _as_is
        # A budget shared with other models' engines, which must grant each admission too; None: this engine's own.
        self.shared: SharedKV | None = None
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        """Whether a step has anything to run (requests waiting for their images to be encoded do not count)."""
        return bool(self.running) or self.head is not None

    @property
    def head(self) -> SequenceState | None:
        """The request to admit next: the first waiting one that is not ``encoding``."""
        return next((s for s in self.waiting if not s.encoding), None)

    def can_add(self, num_pending: int = 0) -> bool:
        """Whether one more request fits: free running slots first, then ``max_waiting`` places in the queue.

        ``num_pending``: requests accepted elsewhere (another thread) but not added yet.
        """
        return num_pending + len(self.waiting) + len(self.running) < self.max_running + self.max_waiting

    def add(self, sequence: SequenceState) -> None:
        """Queue a request; the caller checks :meth:`can_add` first (the engine answers 429 otherwise)."""
        if not self.can_add():
            raise OverflowError(f"{self.max_running} requests run and {self.max_waiting} wait already")
        sequence.phase = "waiting"
        self.waiting.append(sequence)

    @property
    def num_reserved_bytes(self) -> int:
        """Bytes the running requests reserve: every row padded to the largest reservation among them."""
        return self.num_reserved_bytes_with()

    def num_reserved_bytes_with(self, *sequences: SequenceState) -> int:
        """:attr:`num_reserved_bytes` once ``sequences`` run too (none given: as things are); the decode batch
        holds ``row_width(rows)`` rows (its bucket, filler rows included: :mod:`mlxd.engine.step.buckets`)."""
        rows = [*self.running, *sequences]
        return self.row_width(len(rows)) * max((s.num_kv_bytes for s in rows), default=0)

    def num_bytes_needed(self, budget_bytes: int) -> int:
        """What the requests need of ``budget_bytes`` now: the running ones' reservation, with the head of the
        queue's when it could then be admitted. Others (the prefix cache) may hold the rest."""
        if self._can_admit_head(budget_bytes):
            return self.num_reserved_bytes_with(self.head)
        return self.num_reserved_bytes

    def can_admit(self) -> bool:
        """Whether the head of the queue can start: a free running slot and room for its KV cache."""
        return self._can_admit_head(self.kv_budget_bytes)

    def _can_admit_head(self, budget_bytes: int | None) -> bool:
        head = self.head
        return head is not None and len(self.running) < self.max_running and self._fits(budget_bytes, head)

    def _fits(self, budget_bytes: int | None, *sequences: SequenceState) -> bool:
        """Whether the running requests and ``sequences`` fit ``budget_bytes``, and the shared budget's grant (a
        claim held until the plan settles: the check and the reservation are one step there)."""
        num_bytes = self.num_reserved_bytes_with(*sequences)
        if budget_bytes is not None and num_bytes > budget_bytes:
            return False
        return self.shared is None or self.shared.claim(num_bytes)

    def admit(self) -> SequenceState:
        sequence = self.head
        self.waiting.remove(sequence)
        sequence.phase = "prefill"
        self.running.append(sequence)
        return sequence

    def start(self, sequence: SequenceState) -> None:
        """Run a waiting request now, as a plan made elsewhere says (a distributed leader's, a replayed one);
        one admitted already stays where it is."""
        if sequence.phase == "waiting":
            self.waiting.remove(sequence)
            sequence.phase = "prefill"
            self.running.append(sequence)

    def schedule(self) -> StepPlan:
        """Plan the next step: every decoding sequence, then prompt chunks within the token budget.

        Prompts already started go first, in arrival order; then waiting requests are admitted while running
        slots and budget remain. When the head of the queue does not fit what is left of the budget, whole prompts
        behind it that do fit are admitted (:meth:`_admit_behind`); the head goes first next step.
        """
        decode = [s for s in self.running if s.phase == "decode"]
        budget = self.step_token_budget - sum(s.num_feeding for s in decode)
        prefill: list[tuple[SequenceState, int]] = []
        started = [s for s in self.running if s.phase == "prefill"]
        while started or self.can_admit():
            sequence = started[0] if started else self.head
            num_tokens = sequence.next_chunk()
            if prefill and num_tokens > budget:
                if not started:
                    prefill += self._admit_behind(sequence, budget)
                break
            if started:
                started.pop(0)
            else:
                self.admit()
            prefill.append((sequence, num_tokens))
            budget -= num_tokens
        if self.max_pass_tokens:
            prefill += self._admit_burst(prefill)
        self._settle()
        return StepPlan(prefill, decode)

    def _settle(self) -> None:
        if self.shared is not None:  # what was claimed for the head and not taken up goes back
            self.shared.settle(self.num_reserved_bytes)

    def _admit_burst(self, prefill: list[tuple[SequenceState, int]]) -> list[tuple[SequenceState, int]]:
        """Admit whole text prompts from the head of the queue, in order, while this step's whole prompts hold at
        most ``max_pass_tokens`` tokens together and their pass fits beside the reservations
        (:meth:`_pass_fits`): a burst starts in one pass (:func:`prompts_to_batch` groups them) instead of
        ``step_token_budget`` at a time, while every decoding request still gets its token this step. The rest of
        a prompt that starts from a cached state (a prefix-cache hit: a shared system prompt) is admitted with
        them, in a pass of such rests in the same step: a burst does not stop at it and leave the requests behind
        it a whole pass later."""
        whole = [n for s, n in prefill if _whole_text(s, n)]
        total, rows, longest = sum(whole), len(whole), max(whole, default=0)
        chosen = []
        while self.can_admit():
            head = self.head
            num_tokens = head.next_chunk()
            if (not _whole_text(head, num_tokens) or total + num_tokens > self.max_pass_tokens
                    or not self._pass_fits(rows + 1, max(longest, num_tokens), head)):
                break
            self.admit()
            chosen.append((head, num_tokens))
            total, rows, longest = total + num_tokens, rows + 1, max(longest, num_tokens)
        return chosen

    def _pass_fits(self, rows: int, longest: int, head: SequenceState) -> bool:
        """Whether a pass of ``rows`` prompts padded to ``longest`` tokens fits beside the reservations once
        ``head`` runs too: the pass's bytes are transient, the reservations count what caches may grow to."""
        if not self.pass_bytes_per_token or self.kv_budget_bytes is None:
            return True
        pass_bytes = rows * longest * self.pass_bytes_per_token
        return pass_bytes + self.num_reserved_bytes_with(head) <= self.kv_budget_bytes

    def _admit_behind(self, head: SequenceState, budget: int) -> list[tuple[SequenceState, int]]:
        """Admit whole prompts waiting behind ``head`` (which does not fit ``budget`` this step) that fit, in
        order: a short prompt need not wait a step behind a long one (a text question behind an image prompt).
        Each leaves a running slot and KV room for the head, so that nothing passed makes the head wait longer."""
        chosen = []
        for sequence in [s for s in self.waiting if s is not head and not s.encoding]:
            num_tokens = sequence.next_chunk()
            if num_tokens < sequence.num_prompt_remaining or num_tokens > budget:
                continue
            if len(self.running) + 2 > self.max_running or not self._fits(self.kv_budget_bytes, sequence, head):
                break
            self.waiting.remove(sequence)
            sequence.phase = "prefill"
            self.running.append(sequence)
            chosen.append((sequence, num_tokens))
            budget -= num_tokens
        return chosen

    def on_prefilled(self, sequence: SequenceState, num_tokens: int) -> None:
        """Record a processed chunk; the sequence decodes once its whole prompt is in."""
        sequence.num_prefilled += num_tokens
        if sequence.num_prompt_remaining == 0:
            sequence.phase = "decode"

    def remove(self, request_id: str) -> SequenceState | None:
        """Take a request out of whichever queue holds it (finished, cancelled or failed); its reservation ends."""
        for queue in (self.running, self.waiting):
            for sequence in queue:
                if sequence.request_id == request_id:
                    queue.remove(sequence)
                    self._settle()
                    return sequence
        return None


def _as_is(num_rows: int) -> int:
    return num_rows


def _whole_text(sequence: SequenceState, num_tokens: int) -> bool:
    """Whether this chunk is the whole of a text prompt still to run: from its start (what a group pass of fresh
    prompts takes), or from a cached state on (what a group pass of rests takes)."""
    return num_tokens == sequence.num_prompt_remaining and not sequence.vision


def prompts_to_batch(chunks: list[tuple[SequenceState, int]]) -> list[list[SequenceState]]:
    """Of a step's prompt chunks, the groups worth one forward pass each: whole text prompts (one chunk each), whole
    image prompts, and the rests of text prompts that start from a cached state (prefix-cache hits, one chunk each).
    Of each kind the shortest ones, as many as keep the padded batch within twice their real tokens (no group of
    fewer than two)."""
    fresh = [(s, n) for s, n in chunks if s.num_prefilled == 0 and n == s.num_prompt_tokens]
    rests = [(s, n) for s, n in chunks if s.num_prefilled > 0 and n == s.num_prompt_remaining and not s.vision]
    kinds = ([c for c in fresh if not c[0].vision], [c for c in fresh if c[0].vision], rests)
    return [group for group in map(_worth_one_pass, kinds) if group]


def _worth_one_pass(chunks: list[tuple[SequenceState, int]]) -> list[SequenceState]:
    ordered = sorted(chunks, key=lambda chunk: chunk[1])
    total, count = 0, 0
    for i, (_, num_tokens) in enumerate(ordered):
        total += num_tokens
        if (i + 1) * num_tokens <= 2 * total:
            count = i + 1
    return [state for state, _ in ordered[:count]] if count > 1 else []
