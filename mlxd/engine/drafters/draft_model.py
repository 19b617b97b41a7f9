"""A small mlx-lm model as the drafter, batched across the rows that draft in a step.

Each row keeps its own cache of the draft model, holding a prefix of the row's tokens. A step first feeds every
row's missing tokens (its whole prompt the first time, alone and in chunks; afterwards the one or two tokens since
its last draft) and then drafts greedily, ``k`` tokens, with all asking rows in one batched cache (mlx-lm's
``merge`` of the rows' caches; ``extract`` gives each back). After verification, :meth:`commit` trims the row's
cache to the drafts the target kept.

The draft model must share the served model's tokenizer (its ids mean the same tokens); its logits may be narrower
(a padded embedding on either side is fine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_vlm.speculative.cache_state import start_speculative_cache

from mlxd.engine.drafters.base import DraftRow

_CHUNK = 512  # prompt tokens per forward pass when a row first catches up


@dataclass(slots=True, eq=False)
class _Row:
    cache: list[Any]
    held: int = 0  # the row's tokens the cache holds
    drafted: int = 0  # tokens fed while drafting last time, beyond ``held`` (the drafts except the last)


@dataclass(slots=True, eq=False)
class DraftModelDrafter:
    model: Any
    name: str = "draft_model"
    needs_hidden: bool = False
    _rows: dict[str, _Row] = field(default_factory=dict)

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        states = [self._rows.setdefault(row.request_id, _Row(make_prompt_cache(self.model))) for row in rows]
        for row, state in zip(rows, states, strict=True):
            self._catch_up_prompt(row, state)
        cache = _merge([state.cache for state in states])
        tails = [row.tokens[state.held :] for row, state in zip(rows, states, strict=True)]
        logits = _feed_ragged(self.model, cache, tails)
        k = max(row.k for row in rows)
        drafts = [mx.argmax(logits, axis=-1)]
        for _ in range(k - 1):
            drafts.append(mx.argmax(self.model(drafts[-1][:, None], cache=cache)[:, -1, :], axis=-1))
        tokens = mx.stack(drafts, axis=1).tolist()
        for i, (row, state) in enumerate(zip(rows, states, strict=True)):
            state.cache = _extract(cache, i, len(rows))
            state.held, state.drafted = len(row.tokens), k - 1
        return [t[: row.k] for t, row in zip(tokens, rows, strict=True)]

    def _catch_up_prompt(self, row: DraftRow, state: _Row) -> None:
        """Feed all but the last few missing tokens alone, in chunks (a row's first draft: its prompt)."""
        end = len(row.tokens) - 2
        while end - state.held > 0:
            chunk = row.tokens[state.held : min(end, state.held + _CHUNK)]
            self.model(mx.array(chunk, dtype=mx.uint32)[None], cache=state.cache)
            mx.eval([c.state for c in state.cache])
            state.held += len(chunk)

    def commit(self, request_id: str, num_accepted: int) -> None:
        """The cache fed the last draft's first ``k - 1`` tokens: keep the accepted ones."""
        state = self._rows.get(request_id)
        if state is None:
            return
        keep = min(num_accepted, state.drafted)
        for layer in state.cache:
            layer.trim(state.drafted - keep)
        state.held += keep
        state.drafted = 0

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)


def _feed_ragged(model: Any, cache: list[Any], tails: list[list[int]]) -> mx.array:
    """Feed each row its own tokens (1 to a few), right-padded to the longest, keeping only real positions in the
    cache; the logits after each row's last real token, ``(B, V)``."""
    width = max(len(t) for t in tails)
    inputs = mx.array([t + [0] * (width - len(t)) for t in tails], dtype=mx.uint32)
    transaction = start_speculative_cache(cache, width)
    logits = model(inputs, cache=cache)
    transaction.commit([len(t) for t in tails])
    last = mx.array([len(t) - 1 for t in tails])
    return mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0, :]


def _merge(caches: list[list[Any]]) -> list[Any]:
    if len(caches) == 1:
        return caches[0]
    return [layers[0].merge(list(layers)) for layers in zip(*caches, strict=True)]


def _extract(cache: list[Any], index: int, size: int) -> list[Any]:
    if size == 1:
        return cache
    return [layer.extract(index) for layer in cache]
