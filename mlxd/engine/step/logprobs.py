"""Log-probabilities of sampled tokens under the raw logits, captured lazily inside the batch step and read once
the step that feeds the token in has been dispatched (so reading them never stalls the pipelined step).

One capture holds the arrays of all its rows; each asking row keeps ``(capture, its index, its number of
alternatives)``. Reading turns a capture's arrays into Python lists once, whatever the number of rows, so a step
costs three reads from the device, not three per row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

Logprobs = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True, eq=False)
class Captured:
    """One capture's arrays, lazy until read: each row's chosen token's log-probability ``(B,)`` and, when any row
    asked for alternatives, the top ``k`` ids and log-probabilities ``(B, k)`` (unsorted)."""

    chosen: mx.array
    top_ids: mx.array | None = None
    top_values: mx.array | None = None
    _lists: tuple[list, list | None, list | None] | None = None

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def lists(self) -> tuple[list, list | None, list | None]:
        if self._lists is None:
            self._lists = (self.chosen.tolist(), *(a.tolist() if a is not None else None
                                                   for a in (self.top_ids, self.top_values)))
        return self._lists


Pending = tuple[Captured, int, int]  # (the capture, the row's index in it, how many alternatives the row asked)


def read_logprobs(pending: Pending) -> Logprobs:
    """What :func:`capture_logprobs` kept for one row, as numbers: the chosen token's log-probability and the top
    alternatives, most likely first."""
    captured, i, n = pending
    chosen, ids, values = captured.lists()
    top = sorted(zip(ids[i][:n], values[i][:n], strict=True), key=lambda t: -t[1]) if n else []
    return chosen[i], top


def capture_logprobs(rows: list[Any], raw: mx.array, tokens: mx.array,
                     normalized: mx.array | None = None) -> Captured | None:
    """Keep, lazily, the log-probabilities of the sampled ``tokens`` under the raw logits (before penalties, bias,
    constraints and temperature: what vLLM reports), with each asking row's top alternatives, in each asking row's
    ``pending_logprobs``. Rows that did not ask cost nothing; when none asked, nothing is computed (None).
    ``normalized``: ``raw - logsumexp(raw, axis=-1)`` when the caller has it already (a step whose rows have no
    processors samples from exactly that), so it is not computed twice."""
    wanted = [i for i, row in enumerate(rows) if row.num_logprobs is not None]
    if not wanted:
        return None
    logprobs = normalized if normalized is not None else raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    captured = Captured(mx.take_along_axis(logprobs, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0])
    k = max(rows[i].num_logprobs for i in wanted)
    if k:
        captured.top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        captured.top_values = mx.take_along_axis(logprobs, captured.top_ids, axis=-1)
    for i in wanted:
        rows[i].pending_logprobs = (captured, i, rows[i].num_logprobs)
    return captured


def block_logprobs(raw: mx.array, tokens: list[int], row: Any) -> list[Logprobs]:
    """A speculative row's emitted tokens after its fed one. ``tokens[:-1]`` (the kept drafts) are read now; the
    last (the row's next input) stays lazy in ``row.pending_logprobs``, as after a plain step. ``raw``: the raw
    logits at the positions that produced ``tokens``, ``(len(tokens), V)``."""
    out = []
    for j, token in enumerate(tokens):
        capture_logprobs([row], raw[j : j + 1], mx.array([token], dtype=mx.uint32))
        if j < len(tokens) - 1:
            out.append(read_logprobs(row.pending_logprobs))
    return out
