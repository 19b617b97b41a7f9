"""The speculative decode step: rows feed their last token plus drafted ones in one batched forward pass.

Each row's block is ``[last token, d1 .. dn]``, right-padded to the longest block of the step (a row that drafts
nothing feeds one token and padding). The cache records the step as a transaction (mlx-vlm's
``start_speculative_cache``): after verification each row keeps ``1 + accepted`` positions. Attention caches are
trimmed (a ragged tail becomes left padding: mlx-lm's ``BatchKVCache.prepare(right_padding=...)`` and
``finalize``); recurrent layers of mlx-vlm's hybrid models restore the state recorded after the last kept position.
Rows with logits processors (penalties, bias, a grammar) have them applied position by position, with the history
each position would have had in plain decoding, then rolled back to what was kept.

Unlike the plain step this one is not pipelined: drafting needs the last token's value, and the next step's input
depends on how many drafts were kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_vlm.speculative.cache_state import iter_leaf_caches

from mlxd.config.schema import EngineConfig
from mlxd.engine.drafters.base import DraftRow
from mlxd.engine.speculative.state import DraftTimer, num_accepted, verify
from mlxd.engine.step.batchcache import extract_row
from mlxd.engine.step.logprobs import block_logprobs, read_logprobs
from mlxd.engine.step.stepcosts import StepCosts
from mlxd.engine.step.target import verify as verify_forward
from mlxd.errors import ConfigError

if TYPE_CHECKING:
    from mlxd.engine.step.row import Row


@dataclass(slots=True)
class Verified:
    """What a verify step gives back to the decode batch."""

    emitted: list[list[int]]  # each row's fed token and the drafts it kept
    inputs: mx.array  # each row's next input: the token after its emitted ones
    kept: list[int]  # positions each row kept (1 + accepted drafts)
    hidden: mx.array | None  # the pass's hidden states, for rows that draft from them
    logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]]  # rows that asked, one per emitted token
    waited_s: float  # spent waiting for the device


class SpeculativeStep:
    """The decode batch's speculative step: drafts for the rows that speculate, and one verification pass.

    It reads the rows and the batch's cache it is handed and returns what the pass gave (:class:`Verified`); the
    decode batch (:class:`mlxd.engine.step.batch.DecodeBatch`) owns it and updates its own state from that."""

    def __init__(self, model: Any, costs: StepCosts) -> None:
        self.model = model
        self.costs = costs  # what plain and verify steps cost, shared with the batch's plain steps
        self._ragged = 0  # left padding ragged steps have added since the batched cache was last compacted

    def compact_if_ragged(self, cache: list[Any], emitted: list[list[int]]) -> list[Any]:
        """Rows that kept fewer positions than others in a verify step leave left padding behind (their rejected
        tail rolled to the front). Once that waste averages 64 positions a row, the batched cache is rebuilt with
        each row's padding at its minimum (one copy of the cache); else ``cache`` comes back as it is."""
        if len(emitted) < 2:
            return cache
        longest = max(len(e) for e in emitted)
        self._ragged += sum(longest - len(e) for e in emitted)
        if self._ragged < 64 * len(emitted):
            return cache
        self._ragged = 0
        rows = [extract_row(cache, i) for i in range(len(emitted))]
        return [layers[0].merge(list(layers)) for layers in zip(*rows, strict=True)]

    def draft_lengths(self, rows: list[Row]) -> list[int] | None:
        """How many tokens each row drafts this step (0 for plain rows and rows that pause: this counts their
        pause down), or None when no row drafts or the batch's expected gain does not pay for a verify step
        (:func:`batch_pays`). Needs no token of the step: a batch that will not verify keeps its pipelined plain
        step (reading the fed tokens back first would stall it)."""
        lengths = [row.spec.draft_length(len(rows), self.costs) if row.spec is not None else 0 for row in rows]
        return lengths if any(lengths) and batch_pays(rows, self.costs, lengths) else None

    def draft(self, rows: list[Row], fed: list[int], lengths: list[int]) -> list[list[int]]:
        """Each row's drafted tokens for this step (``lengths`` from :meth:`draft_lengths`), one drafter call per
        drafter; drafts a grammar would refuse are cut where it refuses."""
        drafts: list[list[int]] = [[] for _ in rows]
        asking: dict[Any, list[tuple[int, DraftRow]]] = {}
        for i, (row, k) in enumerate(zip(rows, lengths, strict=True)):
            if k > 0:
                asking.setdefault(row.spec.drafter, []).append(
                    (i, DraftRow(row.request_id, [*row.spec.tokens, fed[i]], k, row.take_hidden())))
        for drafter, entries in asking.items():
            with DraftTimer([rows[i].spec for i, _ in entries]):
                proposals = drafter.propose([entry for _, entry in entries])
            for (i, entry), proposal in zip(entries, proposals, strict=True):
                drafts[i] = _grammatical(rows[i], fed[i], list(proposal[: entry.k]))
                if not drafts[i]:
                    rows[i].spec.record_empty()
                    drafter.commit(entry.request_id, 0)
        return drafts

    def verify(self, rows: list[Row], cache: list[Any], fed: list[int], drafts: list[list[int]],
               positions: dict[str, mx.array]) -> Verified:
        """Run one verification pass for every row over ``cache`` (``positions``: the batch's position inputs);
        each row keeps its fed token and the drafts the model accepts, and the cache keeps their positions."""
        width = 1 + max(len(d) for d in drafts)
        self.costs.tick(len(rows), width)
        blocks = [[token, *d] for token, d in zip(fed, drafts, strict=True)]
        inputs = mx.array([b + [0] * (width - len(b)) for b in blocks], dtype=mx.uint32)
        previous = {row.request_id: row.pending_logprobs for row in rows if row.pending_logprobs is not None}
        raw, hidden, transaction = verify_forward(self.model, inputs, cache, **positions)
        try:
            checks = [_verify_row(row, raw[i, : len(blocks[i])], blocks[i]) for i, row in enumerate(rows)]
            started = time.perf_counter()
            mx.eval(checks)
            waited_s = time.perf_counter() - started
        except BaseException:
            transaction.abort()
            raise
        kept = [num_accepted(accepted.tolist()) for accepted, _ in checks]
        transaction.commit([1 + a for a in kept])
        candidates = [candidate.tolist() for _, candidate in checks]
        emitted = [blocks[i][: 1 + a] for i, a in enumerate(kept)]
        logprobs = {}
        for i, row in enumerate(rows):
            _settle(row, len(blocks[i]) - 1, kept[i], emitted[i])
            if row.num_logprobs is not None:
                rest = block_logprobs(raw[i, : kept[i] + 1], [*emitted[i][1:], candidates[i][kept[i]]], row)
                first = [read_logprobs(previous[row.request_id])] if row.request_id in previous else []
                logprobs[row.request_id] = first + rest
        return Verified(emitted=emitted,
                        inputs=mx.array([c[a] for c, a in zip(candidates, kept, strict=True)], dtype=mx.uint32),
                        kept=[1 + a for a in kept], hidden=hidden, logprobs=logprobs, waited_s=waited_s)


def batch_pays(rows: list[Row], costs: StepCosts, lengths: list[int]) -> bool:
    """Whether a verify step with these draft lengths is expected to emit more tokens than the plain steps it costs:
    every row pays for the step's width, the rows that draft nothing too (they gain one token, as in a plain
    step). Unknown costs (not measured yet at this batch size and width) pay, so that they get measured; so does
    a step where a row drafts a fixed ``k`` (``adaptive`` off)."""
    size = len(rows)
    ratio = costs.ratio(size, 1 + max(lengths))
    if ratio is None or any(k and not row.spec.adaptive for row, k in zip(rows, lengths, strict=True)):
        return True  # a row drafting a fixed k (adaptive off) always drafts
    gain = sum(row.spec.expected_gain(k) if k else 1.0 for row, k in zip(rows, lengths, strict=True))
    if gain >= size * ratio:
        return True
    for row, k in zip(rows, lengths, strict=True):
        if k:
            row.spec.reason = (f"the batch's drafts gain {gain / size:.2f} tokens a row; a verify step costs "
                               f"{ratio:.2f} plain steps")
    return False


def _grammatical(row: Row, last: int, proposal: list[int]) -> list[int]:
    """The longest prefix of ``proposal`` that every processor with a grammar allows after ``last``."""
    for processor in row.processors:
        valid_prefix = getattr(processor, "valid_prefix", None)
        if valid_prefix is not None and proposal:
            proposal = proposal[: max(valid_prefix([last, *proposal]) - 1, 0)]
    return proposal


def _verify_row(row: Row, raw: mx.array, block: list[int]) -> tuple[mx.array, mx.array]:
    """The row's verification (lazy): processors applied position by position, then :func:`verify`."""
    logits = raw
    if row.processors:
        logits = mx.concatenate([row.process(mx.array(block[j : j + 1], dtype=mx.uint32), raw[j : j + 1])
                                 for j in range(len(block))])
    next_key = getattr(row.sampler, "next_key", None)
    return verify(row.params, logits, block[1:], next_key() if next_key is not None else None)


def _settle(row: Row, drafted: int, kept: int, emitted: list[int]) -> None:
    """Bring the row's bookkeeping to what was kept: processor history, drafter, counters."""
    if row.processors and drafted > kept:
        row.rollback_history(drafted - kept)
    if row.spec is not None:
        row.spec.tokens.extend(emitted)
        if drafted:
            row.spec.drafter.commit(row.request_id, kept)
        row.spec.record(drafted, kept, len(emitted))


def check_drafter(drafter: Any, model: Any, config: EngineConfig, vocab_size: int) -> None:
    """Refuse, at start-up, speculation the model cannot verify: a rotating KV cache (``max_kv_size``), recurrent
    layers with no recorded states to roll back to (mlx-lm's hybrid models: serve them through mlx-vlm), or a draft
    model whose token ids go past the served model's vocabulary."""
    if config.max_kv_size:
        raise ConfigError("[engine.speculative] cannot be used with [engine] max_kv_size: a rotating KV cache "
                          "cannot roll back rejected drafts")
    for layer in iter_leaf_caches(make_prompt_cache(model)):
        if not (layer.is_trimmable() or callable(getattr(layer, "start_speculation", None))):
            raise ConfigError(f"[engine.speculative] drafter = {drafter.name!r}: this model's "
                              f"{type(layer).__name__} layers cannot roll back rejected drafts")
    draft_model = getattr(drafter, "model", None)
    if draft_model is not None:
        width = draft_model(mx.array([[0]], dtype=mx.uint32), cache=make_prompt_cache(draft_model)).shape[-1]
        if width > vocab_size:
            raise ConfigError(f"[engine.speculative] draft_model produces {width} logits, more than the served "
                              f"model's {vocab_size}: it does not share its tokenizer")
