"""Log-probabilities of sampled tokens under the raw logits, captured lazily inside the batch step and read once
the step that feeds the token in has been dispatched (so reading them never stalls the pipelined step)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def read_logprobs(arrays: tuple[mx.array, mx.array, mx.array]) -> tuple[float, list[tuple[int, float]]]:
    """What :func:`capture_logprobs` kept for one row, as numbers: the chosen token's log-probability and the top
    alternatives, most likely first."""
    chosen, top_ids, top_values = arrays
    return chosen.item(), sorted(zip(top_ids.tolist(), top_values.tolist(), strict=True), key=lambda t: -t[1])


def capture_logprobs(rows: list[Any], raw: mx.array, tokens: mx.array) -> None:
    """Keep, lazily, the log-probabilities of the sampled ``tokens`` under the raw logits (before penalties, bias,
    constraints and temperature: what vLLM reports), with each asking row's top alternatives. Rows that did not
    ask cost nothing; when none asked, nothing is computed."""
    wanted = [i for i, row in enumerate(rows) if row.num_logprobs is not None]
    if not wanted:
        return
    logprobs = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
    k = max(rows[i].num_logprobs for i in wanted)
    if k:
        top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
    for i in wanted:
        row, n = rows[i], rows[i].num_logprobs
        ids, values = (top_ids[i, :n], top_values[i, :n]) if n else (mx.array([], mx.int32), mx.array([]))
        row.pending_logprobs = (chosen[i], ids, values)


def block_logprobs(raw: mx.array, tokens: list[int], row: Any) -> list[tuple[float, list[tuple[int, float]]]]:
    """A speculative row's emitted tokens after its fed one. ``tokens[:-1]`` (the kept drafts) are read now; the
    last (the row's next input) stays lazy in ``row.pending_logprobs``, as after a plain step. ``raw``: the raw
    logits at the positions that produced ``tokens``, ``(len(tokens), V)``."""
    out = []
    for j, token in enumerate(tokens):
        capture_logprobs([row], raw[j : j + 1], mx.array([token], dtype=mx.uint32))
        if j < len(tokens) - 1:
            out.append(read_logprobs(row.pending_logprobs))
    return out
