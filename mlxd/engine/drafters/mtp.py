"""Multi-token-prediction heads as a drafter: Qwen3.5's MTP layer, composed from mlx-vlm 0.7.10.

:func:`make_mtp_drafter` loads the head from the served checkpoint; the engine gets the hidden states it reads from
the vision wrapper's ``forward_hidden`` (prompt chunks, plain steps) and ``verify_forward`` (verify steps), through
:mod:`mlxd.engine.step.target`.

What the head computes. For sequence position ``t`` it takes a pair: the target's final hidden state at ``t``
(``h_t``, after the model's final RMSNorm) and the embedding of the token at ``t + 1``; ``fc`` mixes the two, one
attention layer (with its own KV cache, RoPE position ``t``) and a norm follow, and the target's LM head reads the
token at ``t + 2`` off the result. Each further draft feeds the head its own output as the next pair's hidden state.
This is what mlx-vlm's own MTP loop does (``Qwen3_5MTPDraftModel.prefill_from_target_hidden`` / ``draft_block``).

Per request the drafter keeps the head's KV cache (one entry per pair, positions ascending, gaps allowed) and the
pairs it drafted last. A row's ``hidden`` is ``(m, H)``, ``(1, H)`` or ``(H,)``: the target's post-norm hidden
states at the row's last ``m`` kept positions, the last of them the position just before ``tokens[-1]`` (from
``forward_hidden`` or ``verify_forward``, at index ``accepted`` of a verified row). Positions
before those get the head's own hidden state where the row accepted drafts (the approximation mlx-vlm makes for
its kept draft entries) and are skipped otherwise; an engine that passes every newly kept position (the prompt's
at the first step) gives the head exact context.

mlx-vlm pieces used, pinned to mlx-vlm==0.7.10 (``tests/test_mtp_drafter.py`` checks the public ones,
``tests/test_upstream_privates.py`` the private ones):

- public: ``speculative.drafters.load_drafter`` (splits a checkpoint's ``mtp.*`` tensors in memory),
  ``validate_drafter_compatibility``, ``Qwen3_5MTPDraftModel.bind`` / ``make_cache``, ``models.cache.KVCache`` /
  ``BatchKVCache`` (``merge``, ``prepare(right_padding=)``, ``finalize``, ``extract``), and the Qwen3.5 language
  model's ``return_hidden=True`` and ``speculative_verify=True`` call options;
- private: ``Qwen3_5MTPDraftModel._forward_hidden`` (fc, MTP layers and norm over a cache at given positions),
  ``._greedy_token`` (the target LM head's argmax), and ``._input_embed`` / ``._input_embed_scale`` set by ``bind``.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxd.engine.drafters.base import DraftRow
from mlxd.errors import ConfigError


def _language_model(model: Any) -> Any:
    return getattr(model, "language_model", model)


@dataclass(slots=True, eq=False)
class _Drafts:
    """Tokens drafted for positions ``start + 1``, ``start + 2``...; ``hidden[j]`` (H,) is the head state that
    drafted ``tokens[j]``: once the model keeps that token, it stands in for the target's hidden state at
    ``start + j``, which the next proposal may not be given."""

    start: int
    tokens: list[int]
    hidden: mx.array

    def first(self, n: int) -> _Drafts:
        return _Drafts(self.start, self.tokens[:n], self.hidden[:n])


@dataclass(slots=True, eq=False)
class _Feed:
    """The pairs a proposal runs through the head before drafting: a position, the token after it, a hidden state."""

    positions: list[int]
    tokens: list[int]
    hidden: mx.array  # (len(positions), H)


@dataclass(slots=True, eq=False)
class _RowState:
    cache: list[Any]  # the head's KVCache per MTP layer
    positions: list[int] = field(default_factory=list)  # the sequence position of each cache entry, ascending
    drafted: _Drafts | None = None  # the last proposal
    accepted: _Drafts | None = None  # the part of it the model kept, until the next proposal


def make_mtp_drafter(model: Any, folder: Path | str) -> MTPDrafter:
    """The drafter for ``[engine.speculative] drafter = "mtp"``: the MTP head of the checkpoint in ``folder`` (its
    ``mtp.*`` tensors, or a folder split by ``mlx_vlm.split_mtp``), bound to ``model``, the model served from it.
    ``ConfigError`` when the folder has no Qwen3.5 MTP head or ``model`` cannot verify its drafts."""
    from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Qwen3_5MTPDraftModel

    field_name = '[engine.speculative] drafter = "mtp"'
    lm = _language_model(model)
    if not callable(getattr(lm, "speculative_verify_hidden", None)):
        raise ConfigError(f"{field_name} needs a Qwen3.5-family model served through mlx-vlm; this one is "
                          f"{type(lm).__module__}")
    try:
        head, kind = load_drafter(str(folder), kind="mtp")
        validate_drafter_compatibility(model, head, kind)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{field_name}: no usable MTP head in {folder}: {e}") from e
    if not isinstance(head, Qwen3_5MTPDraftModel):
        raise ConfigError(f"{field_name}: {folder} holds a {type(head).__name__}, not a Qwen3.5 MTP head")
    return MTPDrafter(head, model)


class MTPDrafter:
    """Drafts with a Qwen3.5-family MTP head bound to its target (the :class:`~mlxd.engine.drafters.base.Drafter`
    protocol); built by :func:`make_mtp_drafter`. Rows of one :meth:`propose` run through the head as one batch."""

    name = "mtp"
    needs_hidden = True

    def __init__(self, head: Any, target: Any) -> None:
        """``head``: a loaded ``Qwen3_5MTPDraftModel``; ``target``: the model whose hidden states it reads."""
        self._head = head.bind(target)
        self._hidden_size = int(head.fc.weight.shape[0])
        self._rows: dict[str, _RowState] = {}

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        """At most ``row.k`` greedy drafts per row; a row the target has not run yet (one token) gets none."""
        live = [row for row in rows if len(row.tokens) > 1]
        drafted = dict(zip((id(r) for r in live), self._draft(live), strict=True)) if live else {}
        return [drafted.get(id(row), []) for row in rows]

    def commit(self, request_id: str, num_accepted: int) -> None:
        state = self._state(request_id)
        num_drafted = len(state.drafted.tokens) if state.drafted else 0
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"{request_id}: {num_accepted} accepted of {num_drafted} drafted tokens")
        state.accepted = state.drafted.first(num_accepted) if state.drafted else None
        state.drafted = None

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    # ---- internals ----

    def _state(self, request_id: str) -> _RowState:
        if request_id not in self._rows:
            self._rows[request_id] = _RowState(cache=self._head.make_cache())
        return self._rows[request_id]

    def _draft(self, rows: list[DraftRow]) -> list[list[int]]:
        states = [self._state(row.request_id) for row in rows]
        feeds = [self._feed(state, row) for state, row in zip(states, rows, strict=True)]
        caches, head_hidden = self._run_feeds(states, feeds)
        ends = mx.array([f.positions[-1] + 1 for f in feeds])  # the position of each row's last token
        tokens, chain = self._chain(caches, head_hidden, ends, max(row.k for row in rows))
        mx.eval(tokens, chain, [cache.state for state in states for cache in state.cache])
        proposals = []
        for i, (state, row) in enumerate(zip(states, rows, strict=True)):
            k = max(row.k, 0)
            state.drafted = _Drafts(int(ends[i].item()), tokens[i, :k].tolist(), chain[i, :k])
            proposals.append(state.drafted.tokens)
        return proposals

    def _feed(self, state: _RowState, row: DraftRow) -> _Feed:
        """The pairs not yet in the row's cache, ending at the position just before its last token."""
        end = len(row.tokens) - 1
        exact = _hidden_rows(row.hidden, self._hidden_size, row.request_id)[-end:]
        first_exact = end - exact.shape[0]
        start = min(state.positions[-1] + 1 if state.positions else 0, end - 1)
        self._trim(state, start)  # only a repeated proposal redoes a pair
        kept, state.accepted = state.accepted or _Drafts(start, [], exact[:0]), None
        num_kept = 0  # the kept drafts still in the row, at positions that need a pair and have no exact state
        while (num_kept < len(kept.tokens) and start <= kept.start + num_kept < first_exact
               and row.tokens[kept.start + num_kept + 1] == kept.tokens[num_kept]):
            num_kept += 1
        skip = max(start - first_exact, 0)
        positions = [*range(kept.start, kept.start + num_kept), *range(first_exact + skip, end)]
        hidden = mx.concatenate([kept.hidden[:num_kept], exact[skip:]])
        return _Feed(positions, [row.tokens[p + 1] for p in positions], hidden)

    @staticmethod
    def _trim(state: _RowState, position: int) -> None:
        keep = bisect_left(state.positions, position)
        if keep < len(state.positions):
            for cache in state.cache:
                cache.trim(len(state.positions) - keep)
            del state.positions[keep:]

    def _run_feeds(self, states: list[_RowState], feeds: list[_Feed]) -> tuple[list[Any], mx.array]:
        """Run the rows' feeds as one batch; returns the batch cache and the head's output at each row's last pair.

        The rows' own caches are merged into a left-padded batch as mlx-lm batches them; ragged feeds are
        right-padded, and finalize() rolls that padding into left padding before each row's cache is copied back
        out. (The copies cost O(context) per row and step, small for one MTP layer.)"""
        lengths = [len(f.positions) for f in feeds]
        width = max(lengths)
        pad = [width - n for n in lengths]
        tokens = mx.array([f.tokens + [0] * p for f, p in zip(feeds, pad, strict=True)], dtype=mx.int32)
        positions = mx.array([f.positions + [*range(f.positions[-1] + 1, f.positions[-1] + 1 + p)]
                              for f, p in zip(feeds, pad, strict=True)])
        hidden = mx.stack([mx.pad(f.hidden, [(0, p), (0, 0)]) for f, p in zip(feeds, pad, strict=True)])
        caches = [type(layer[0]).merge(list(layer)) for layer in zip(*(s.cache for s in states), strict=True)]
        for cache in caches:
            cache.prepare(right_padding=pad)
        out = self._forward(tokens, hidden, caches, positions)
        for cache in caches:
            cache.finalize()
        for i, (state, feed) in enumerate(zip(states, feeds, strict=True)):
            state.cache = [cache.extract(i) for cache in caches]
            state.positions += feed.positions
        return caches, out[mx.arange(len(feeds)), mx.array(lengths) - 1][:, None, :]

    def _chain(self, caches: list[Any], head_hidden: mx.array, ends: mx.array, k: int) -> tuple[mx.array, mx.array]:
        """``k`` greedy tokens per row (B, k) and the head states that drafted them (B, k, H): each token after the
        first is the head's prediction from that token and its own previous output, at the positions from the row's
        last token on (in the batch cache only, which is dropped after)."""
        steps = [(self._head._greedy_token(head_hidden), head_hidden)]
        for step in range(k - 1):
            head_hidden = self._forward(steps[-1][0], head_hidden, caches, ends[:, None] + step)
            steps.append((self._head._greedy_token(head_hidden), head_hidden))
        return mx.concatenate([t for t, _ in steps], axis=1), mx.concatenate([h for _, h in steps], axis=1)

    def _forward(self, tokens: mx.array, hidden: mx.array, caches: list[Any], positions: mx.array) -> mx.array:
        head = self._head
        embeds = head._input_embed(tokens) * head._input_embed_scale
        return head._forward_hidden(embeds, hidden.astype(embeds.dtype), caches, positions)


def _hidden_rows(hidden: Any, size: int, request_id: str) -> mx.array:
    if hidden is None:
        raise ValueError(f"{request_id}: the mtp drafter needs the target's hidden state (DraftRow.hidden)")
    rows = hidden.reshape(-1, hidden.shape[-1]) if hidden.ndim <= 2 or hidden.shape[0] == 1 else None
    if rows is None or rows.shape[-1] != size or rows.shape[0] == 0:
        raise ValueError(f"{request_id}: hidden must be (m, {size}), (1, m, {size}) or ({size},); got {hidden.shape}")
    return rows
