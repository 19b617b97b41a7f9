"""Speculative rows: how long a row drafts, when it backs off, and how its drafted tokens are verified.

A speculative row feeds its last token plus up to ``k`` drafted tokens in one forward pass and keeps a prefix of them.
:class:`SpecState` is the row's policy and counters (plain Python); :func:`verify` turns the target's logits for the
fed block into the number of drafts accepted and the token that follows them.

Verification keeps the target's distribution exactly. Greedy: a draft is accepted while it equals the target's
argmax, and the token after the accepted drafts is the argmax there, so the output is plain greedy decoding's.
Temperature > 0: standard speculative (rejection) sampling with a deterministic proposal, so the proposal puts
probability 1 on the drafted token: draft ``d`` at a position with target distribution ``p`` is accepted with
probability ``p(d)``; at the first rejection the token is drawn from ``p`` with ``d`` removed (renormalised), and
after ``k`` acceptances from the next position's ``p``. Each emitted token is then distributed as ``p``.
``p`` is what the row's sampler draws from: mlx-lm's top-p, min-p and top-k filters, then the temperature.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlxd.engine.base import SamplingParams, Speculative
from mlxd.engine.step.stepcosts import StepCosts

# Back-off: after a pause the row drafts again; each further back-off doubles the pause, up to this many steps.
_MAX_PAUSE = 256
_FIRST_PAUSE = 8
# Rounds of drafting before a low acceptance rate can pause a row; steps in a row with nothing drafted that pause it.
_MIN_ROUNDS = 2
_MAX_EMPTY = 4


@dataclass(slots=True, eq=False)
class SpecState:
    """One speculative row: its drafter, its draft length, its back-off and its counters.

    ``tokens`` is the row's sequence so far (prompt and every emitted token); ``remaining`` how many tokens it may
    still emit (drafts never run past ``max_tokens``). With ``adaptive``, ``k`` grows by two after a round that
    accepted every draft and shrinks by one otherwise (between 1 and ``k_max``), and the row pauses (plain steps,
    a number that doubles with each pause, back to the first after a round that kept every draft) when drafting
    does not pay: when the tokens a verify step is expected to emit (from the recent acceptance rate, an exponential
    average) are fewer than the plain steps it costs on this engine (:class:`StepCosts`), or, before both costs
    are measured, when the acceptance rate falls under ``min_acceptance``; and after 4 steps in a row with nothing
    drafted. Whatever ``adaptive`` says, a step whose batch would verify more than ``max_step_tokens`` positions
    shortens the drafts to fit, down to none (``reason`` says so).
    """

    drafter: Any
    k_max: int
    adaptive: bool
    tokens: list[int]
    remaining: int
    min_acceptance: float = 0.3
    max_step_tokens: int = 64
    k: int = 0
    acceptance: float = 1.0  # exponential average of accepted / drafted
    pause: int = 0  # plain steps left before drafting again
    next_pause: int = _FIRST_PAUSE
    reason: str = ""  # why the row last decoded plain, for its log line
    # Counters: rounds that drafted, tokens drafted and accepted, tokens emitted by speculative steps, drafter time.
    rounds: int = 0
    empty: int = 0  # steps in a row in which the drafter had nothing
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    steps: int = 0
    plain_steps: int = 0
    backoffs: int = 0
    drafter_s: float = 0.0

    @classmethod
    def for_request(cls, mode: Speculative, drafter: Any, prompt: list[int], max_tokens: int, *,
                    min_acceptance: float, max_step_tokens: int) -> SpecState:
        return cls(drafter=drafter, k_max=mode.k, adaptive=mode.adaptive, tokens=list(prompt),
                   remaining=max_tokens, k=mode.k, min_acceptance=min_acceptance, max_step_tokens=max_step_tokens)

    def draft_length(self, batch_size: int, costs: StepCosts | None = None) -> int:
        """How many tokens to draft this step (0: decode plain), counting the pause down. With ``adaptive``, a
        row whose drafts are expected to gain less than a verify step costs (``costs``) backs off."""
        if self.pause:
            self.pause -= 1
            return 0
        fits = self.max_step_tokens // max(batch_size, 1) - 1
        k = min(self.k, self.remaining - 1, fits)
        if fits < 1:
            self.reason = f"a batch of {batch_size} rows would verify more than {self.max_step_tokens} positions"
        if k > 0 and self.adaptive and self.rounds >= _MIN_ROUNDS and (reason := self._not_paying(batch_size, k,
                                                                                                 costs)):
            self.back_off(reason)
            return 0
        return max(k, 0)

    def _not_paying(self, batch_size: int, k: int, costs: StepCosts | None) -> str | None:
        ratio = costs.ratio(batch_size, 1 + k) if costs is not None else None
        gain = self.expected_gain(k)
        if ratio is not None:
            return f"a verify step costs {ratio:.2f} plain steps; drafts gain {gain:.2f}" if gain < ratio else None
        if self.acceptance < self.min_acceptance:
            return f"acceptance {self.acceptance:.2f} below {self.min_acceptance}"
        return None

    def expected_gain(self, k: int) -> float:
        """Tokens a verify step of ``k`` drafts is expected to emit, from the recent acceptance rate."""
        return sum(self.acceptance**i for i in range(k + 1))

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        """After a step in which the row drafted ``drafted`` tokens and the model kept ``accepted`` of them."""
        self.emitted += emitted
        self.remaining -= emitted
        if drafted == 0:
            self.plain_steps += 1
            return
        self.steps += 1
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.acceptance = 0.7 * self.acceptance + 0.3 * (accepted / drafted)
        self.empty = 0
        if self.adaptive:
            self.k = min(self.k_max, self.k + 2) if accepted == drafted else max(1, self.k - 1)
            if accepted == drafted:
                self.next_pause = _FIRST_PAUSE

    def record_empty(self) -> None:
        """The drafter had nothing to propose (a step that drafts nothing costs the pipelining of plain steps)."""
        self.empty += 1
        if self.adaptive and self.empty >= _MAX_EMPTY:
            self.back_off(f"the drafter found nothing to propose {self.empty} steps in a row")

    def back_off(self, reason: str) -> None:
        self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, _MAX_PAUSE)
        self.reason = reason
        self.backoffs += 1
        self.acceptance = max(self.acceptance, 0.5)  # a fresh start after the pause
        self.rounds = self.empty = 0

    def summary(self) -> dict[str, Any]:
        """For the request's log line and /v1/status."""
        return {
            "mode": "speculative",
            "drafter": self.drafter.name,
            "k": self.k,
            "acceptance": round(self.accepted / self.drafted, 3) if self.drafted else None,
            "tokens_per_step": round(self.emitted / (self.steps + self.plain_steps), 2)
            if self.steps + self.plain_steps else None,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "steps": self.steps + self.plain_steps,
            "emitted": self.emitted,
            "backoffs": self.backoffs,
            "drafter_ms": round(1000 * self.drafter_s, 1),
            **({"backoff_reason": self.reason} if self.reason else {}),
        }


class DraftTimer:
    """Adds the wall time of a ``with`` block to each row's ``drafter_s``, shared equally (one batched call)."""

    def __init__(self, states: list[SpecState]) -> None:
        self.states = states

    def __enter__(self) -> DraftTimer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        share = (time.perf_counter() - self.start) / max(len(self.states), 1)
        for state in self.states:
            state.drafter_s += share


def target_logprobs(params: SamplingParams, logprobs: mx.array) -> mx.array:
    """The log-distribution a row's sampler draws from, per position: mlx-lm's filters on normalised logprobs
    ``(L, V)``, then the temperature."""
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    scaled = logprobs * (1.0 / params.temperature)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def verify(params: SamplingParams, logits: mx.array, drafts: list[int], key: mx.array | None) -> tuple[mx.array,
                                                                                                      mx.array]:
    """Verify ``drafts`` against the target's processed ``logits`` for the fed block, ``(len(drafts) + 1, V)``.

    Returns, lazily, ``accepted`` (``(k,)`` booleans: draft ``i`` passes on its own) and ``candidates``
    (``(k + 1,)``: the token to emit after ``i`` accepted drafts). The caller accepts the leading run of true
    values, ``a``, and emits ``drafts[:a] + [candidates[a]]``. ``key``: the row's own random key (seeded rows),
    else MLX's global random state.
    """
    k = len(drafts)
    # The log-probabilities plain decoding samples from, computed as it computes them (in the model's dtype): in
    # bfloat16, near-tied logits round to equal log-probabilities, and greedy decoding takes the first of them,
    # which is not always the raw logits' argmax.
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if params.temperature == 0:
        best = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
        return best[:k] == mx.array(drafts, dtype=mx.uint32), best
    logprobs = target_logprobs(params, logprobs)
    keys = mx.random.split(key, 2) if key is not None else (None, None)
    draft_ids = mx.array(drafts, dtype=mx.int32)
    if k:
        p_draft = mx.exp(mx.take_along_axis(logprobs[:k], draft_ids[:, None], axis=-1)[:, 0])
        accepted = mx.random.uniform(shape=(k,), key=keys[0]) < p_draft
        # After a rejection of d: p with d removed (renormalised by the categorical draw).
        residual = mx.put_along_axis(logprobs[:k], draft_ids[:, None], mx.array(-mx.inf, logprobs.dtype), axis=-1)
        logprobs = mx.concatenate([residual, logprobs[k:]])
    else:
        accepted = mx.zeros((0,), dtype=mx.bool_)
    candidates = mx.random.categorical(logprobs, key=keys[1]).astype(mx.uint32)
    return accepted, candidates


def num_accepted(accepted: list[bool]) -> int:
    """The length of the leading run of accepted drafts."""
    for i, ok in enumerate(accepted):
        if not ok:
            return i
    return len(accepted)
