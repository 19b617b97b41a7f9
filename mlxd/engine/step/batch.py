"""The MLX side of the batching engine: the batched decode step.

When its prompt is in (:mod:`mlxd.engine.step.prompts`), a request's cache joins the :class:`DecodeBatch`, which advances
every decoding request by one token per forward pass, or, for speculative rows with drafts, by the drafts the
model keeps (:mod:`mlxd.engine.speculative.step`).

The batch composes mlx-lm's cache protocol and nothing private: per layer, ``merge`` builds a left-padded batched
cache (``BatchKVCache``, ``BatchRotatingKVCache``, ``ArraysCache`` for recurrent layers), ``extend`` adds a row,
``filter`` drops rows and ``extract`` takes one back out. A batch of one keeps the request's own cache and calls the
model exactly as ``generate_step`` does (no mask, no padding), so a lone stream runs at its speed.

Failures stay with their row where they can: ``check_request`` (:mod:`mlxd.engine.step.row`) keeps token ids outside the
vocabulary away from MLX, and a decode step whose grouped sampling raises samples row by row, recording the rows that
fail again in :attr:`DecodeBatch.errors` for the engine to end (:func:`~mlxd.engine.step.row.sample_each`).

A padded batch (:mod:`mlxd.engine.step.buckets`) changes its batched cache as little as its rows allow: rows joining
it take filler rows' places in place, and rows leaving it without changing its width leave the others where they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxd.engine.speculative.step import SpeculativeStep
from mlxd.engine.step.batchcache import extract_row, fill_rows, gather_rows
from mlxd.engine.step.buckets import Buckets
from mlxd.engine.step.logprobs import capture_logprobs, read_logprobs
from mlxd.engine.step.penalties import CONTEXT, apply_penalties
from mlxd.engine.step.prompts import same, sample
from mlxd.engine.step.row import Row, sample_each
from mlxd.engine.step.stepcosts import StepCosts
from mlxd.engine.step.target import forward


class DecodeBatch:
    """The decoding requests, advanced together by :meth:`step`, one token each."""

    def __init__(self, model: Any, share: Callable[[mx.array], mx.array] = same,
                 buckets: Buckets | None = None) -> None:
        self.model = model
        # The widths plain steps run at (:mod:`mlxd.engine.step.buckets`); None: the rows' own number. The batched
        # cache then holds ``_filler`` inert rows after the real ones: copies of the first row, fed token 0, whose
        # outputs are dropped.
        self.buckets = buckets
        self._filler = 0
        # Where rows left a padded batch whose bucket stayed the same, their cache rows stay as filler in place
        # (nothing copied): then ``_at`` holds each row's cache row and ``_order`` the cache rows' inputs. None:
        # row i is cache row i, the filler after them.
        self._at: list[int] | None = None
        self._order = self._held = mx.array([])
        # What every sampled token array passes through before it is fed or read (see :func:`same`).
        self.share = share
        self.rows: list[Row] = []
        self.cache: list[Any] = []
        # The tokens each row feeds into the next forward pass: sampled, not necessarily evaluated yet.
        self.inputs: mx.array | None = None
        # Rows whose next token could not be computed in the last step (request id → error); their input is a
        # placeholder. The engine ends them and empties this.
        self.errors: dict[str, Exception] = {}
        # The log-probabilities of the tokens the last step returned, for the rows that asked (request id →
        # [(logprob, top alternatives)], one per token returned).
        self.logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]] = {}
        # Whether any row is speculative (then each step first asks the drafters).
        self.speculative = False
        self.wants_hidden = False
        self._processing: list[int] = []
        # Penalty groups whose rows stay together: (their rows, their windows of the last CONTEXT tokens).
        self._windows: dict[tuple, tuple[tuple[Row, ...], mx.array]] = {}
        self._capturing = False
        self._one_sampler = False  # every row samples alike: one sampler call a step
        # Seconds the last step spent waiting for the device (reading tokens back), for the step breakdown.
        self.waited_s = 0.0
        # What plain and verify steps cost here, for speculative rows to weigh their drafts against.
        self.costs = StepCosts()
        self.speculative_step = SpeculativeStep(model, self.costs)
        # Multimodal RoPE: each row's position offset, (B, 1), rebuilt when rows change.
        self.uses_rope_deltas = getattr(model, "uses_rope_deltas", False)
        self._positions: dict[str, mx.array] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def request_ids(self) -> list[str]:
        return [row.request_id for row in self.rows]

    def add(self, row: Row, first_token: mx.array) -> None:
        """Join a row whose prompt is processed; ``first_token`` is what :func:`~mlxd.engine.step.prompts.process_prompt` sampled."""
        cache, row.cache = row.cache, []
        if not self.rows:
            self.cache, self.inputs, self.rows, self._filler = cache, first_token.reshape(1), [row], 0
            self._rows_changed()
            return
        if row.wants_hidden:
            self._compact()  # hidden states are handed out by row index
        if not self._fill([row], cache, first_token.reshape(1)):
            self.add_batch([row], [c.merge([c]) for c in cache], first_token.reshape(1))

    def add_batch(self, rows: list[Row], cache: list[Any], first_tokens: mx.array) -> None:
        """Join rows processed together by :func:`~mlxd.engine.step.prompts.process_prompts` (``cache`` in batched form)."""
        if not self.rows and len(rows) == 1:
            self.cache, self.inputs, self.rows, self._filler = [c.extract(0) for c in cache], first_tokens, list(rows), 0
            self._rows_changed()
            return
        self._compact()
        if self._fill(rows, cache, first_tokens):
            return
        real, current = list(range(len(rows))), len(rows)
        if not self.rows:
            self.cache, self.inputs = cache, first_tokens
        else:
            if len(self.rows) == 1:
                self.cache = [c.merge([c]) for c in self.cache]
            for mine, theirs in zip(self.cache, cache, strict=True):
                mine.extend(theirs)
            self.inputs = mx.concatenate([self.inputs, first_tokens])
            joined = len(self.rows) + self._filler  # the new rows come after the filler
            real, current = list(range(len(self.rows))) + list(range(joined, joined + len(rows))), joined + len(rows)
        self.rows.extend(rows)
        self._rows_changed()
        self._arrange(real, current, trim=False)

    def _fill(self, rows: list[Row], cache: list[Any], first_tokens: mx.array) -> bool:
        """Plain rows joining a padded batch whose filler rows can hold them take the filler's places, written in
        place (:func:`~mlxd.engine.step.batchcache.fill_rows`): the width stays the bucket it was, and nothing else
        of the batched cache moves; a lone row takes the first free place of a batch holding rows in place. False
        (nothing done) where that does not apply."""
        if len(rows) > self._filler or any(row.spec is not None for row in rows):
            return False
        width, held = len(self.rows) + self._filler, self._at or list(range(len(self.rows)))
        start = len(self.rows) if self._at is None else min(set(range(width)) - set(self._at))
        if (self._at is not None and len(rows) > 1) or not fill_rows(self.cache, start, cache, len(rows)):
            return False
        self.inputs = mx.concatenate([self.inputs, first_tokens])
        self.rows.extend(rows)
        self._rows_changed()
        self._hold(held + list(range(start, start + len(rows))), width)
        return True

    def _rows_changed(self) -> None:
        self._positions = None  # rebuilt at the next step, after the filler is known
        self.speculative = any(row.spec is not None for row in self.rows)
        self.wants_hidden = any(row.wants_hidden for row in self.rows)
        # What every plain step asks of the rows, found once per change of rows rather than once per step.
        self._processing = [i for i, row in enumerate(self.rows) if row.processors]
        self._capturing = any(row.num_logprobs is not None for row in self.rows)
        self._one_sampler = bool(self.rows) and all(row.sampler_key == self.rows[0].sampler_key for row in self.rows)

    def keep_hidden(self, hidden: mx.array, kept: list[int] | None = None) -> None:
        """Hand each row that drafts from hidden states its own, ``(B, L, H)``: the first ``kept[i]`` positions of
        row ``i`` (all of them when ``kept`` is None)."""
        for i, row in enumerate(self.rows):
            if row.wants_hidden:
                row.keep_hidden(hidden[i, : kept[i]] if kept is not None else hidden[i])

    def row_cache(self, request_id: str) -> list[Any]:
        """One row's cache layers at batch size 1 (the batch's own cache when it is the only row, else a copy)."""
        if len(self.rows) == 1:
            return self.cache
        index = self.request_ids.index(request_id)
        return extract_row(self.cache, self._at[index] if self._at is not None else index)

    def clear(self) -> None:
        """Drop every row without touching their caches (which a failed step may have left unusable)."""
        _release_drafts(self.rows)
        self._windows = {}
        self.rows, self.cache, self.inputs, self.errors = [], [], None, {}
        self._filler, self._at = 0, None
        self._rows_changed()

    def remove(self, request_ids: set[str]) -> None:
        """Drop rows (finished or cancelled); their cache memory is released with them."""
        keep = [i for i, row in enumerate(self.rows) if row.request_id not in request_ids]
        if len(keep) == len(self.rows):
            return
        current = len(self.rows) + self._filler
        held = [self._at[i] for i in keep] if self._at is not None else keep
        _release_drafts([row for row in self.rows if row.request_id in request_ids])
        self.rows = [self.rows[i] for i in keep]
        self._rows_changed()
        self._at = None
        if not keep:
            self.cache, self.inputs, self._filler = [], None, 0
            return
        if len(keep) == 1:
            # Back to a plain cache: the lone stream runs unmasked again.
            self.cache = extract_row(self.cache, held[0])
            self._filler = 0
        elif self._bucket(len(keep)) == current and not self.wants_hidden:
            self._hold(held, current)
        else:
            self._arrange(held, current)
        self.inputs = self.inputs[mx.array(keep)]

    def _bucket(self, num_rows: int) -> int:
        """The width ``num_rows`` rows run at (their own number for speculative batches, which are not padded)."""
        if self.buckets is not None and self.buckets.decode and not self.speculative:
            return self.buckets.width(num_rows)
        return num_rows

    def _hold(self, held: list[int], width: int) -> None:
        """Rows stay where they are in the batched cache (rows ``held``), the others are filler: nothing moves."""
        self._filler, self._at = width - len(held), None
        if held == list(range(len(held))):
            return
        self._at, spare = held, iter(range(len(held), width))
        position = dict(zip(held, range(len(held)), strict=True))
        self._order = mx.array([position[c] if c in position else next(spare) for c in range(width)])
        self._held = mx.array(held)

    def _compact(self) -> None:
        """Rows joining a batch that holds rows in place bring the rows together first (one gather)."""
        if self._at is not None:
            held, self._at = self._at, None
            self._arrange(held, len(self.rows) + self._filler)

    def _arrange(self, real: list[int], current: int, trim: bool = True) -> None:
        """Make the batched cache (``current`` rows now) hold the rows at indices ``real`` (in that order), then
        the filler rows that pad them to their bucket, in one gather (none when it holds exactly that already).
        Speculative batches are not padded: their verify passes take any width. ``trim`` (rows left): also drop
        the left padding every remaining row has (:func:`~mlxd.engine.step.batchcache.gather_rows`)."""
        width = self._bucket(len(real))
        indices = real + [real[0]] * (width - len(real))
        if indices != list(range(current)):
            gather_rows(self.cache, mx.array(indices), trim)
        self._filler = width - len(real)

    def step(self) -> list[list[int]]:
        """Advance every row; return each row's emitted tokens, in row order.

        Plain rows emit one token a step: the one fed into the forward pass just dispatched, sampled by the previous
        step (or by prompt processing), so that evaluating it overlaps with the computation (pipelined like
        ``generate_step``). When a speculative row has drafted tokens, the step verifies them instead
        (:class:`mlxd.engine.speculative.step.SpeculativeStep`): each row emits its fed token and the drafts it kept.

        Raises when the shared work fails (the forward pass, evaluating the returned tokens): every row is lost.
        A row whose own logits processing or sampling fails is recorded in :attr:`errors` instead.
        """
        self.waited_s = 0.0
        if self.speculative:
            self._release_windows({})  # a verify step processes every row from its own history
        spec = self.speculative_step
        lengths = spec.draft_lengths(self.rows) if self.speculative else None
        if lengths is not None:
            started = time.perf_counter()
            fed = self.inputs.tolist()
            self.waited_s += time.perf_counter() - started
            drafts = spec.draft(self.rows, fed, lengths)
            if any(drafts):
                verified = spec.verify(self.rows, self.cache, fed, drafts, self.position_inputs())
                self.inputs, self.logprobs = verified.inputs, verified.logprobs
                self.waited_s += verified.waited_s
                if verified.hidden is not None:
                    self.keep_hidden(verified.hidden, verified.kept)
                self.cache = spec.compact_if_ragged(self.cache, verified.emitted)
                return verified.emitted
        if self.speculative:
            self.costs.tick(len(self.rows), 1)
        tokens = self._plain_step()
        if self.speculative:
            for row, token in zip(self.rows, tokens, strict=True):
                if row.spec is not None:
                    row.spec.tokens.append(token)
                    row.spec.record(0, 0, 1)
        return [[token] for token in tokens]

    def _plain_step(self) -> list[int]:
        """One token per row, pipelined (see :meth:`step`); returns the tokens fed in."""
        inputs = self.inputs
        # The log-probabilities of the tokens fed in now, captured when they were sampled.
        previous = ({row.request_id: row.pending_logprobs for row in self.rows if row.pending_logprobs is not None}
                    if self._capturing else {})
        fed = mx.concatenate([inputs, mx.zeros((self._filler,), dtype=inputs.dtype)]) if self._filler else inputs
        if self._at is not None:
            fed = fed[self._order]
        raw, hidden = forward(self.model, fed[:, None], self.cache, hidden=self.wants_hidden,
                              **self.position_inputs())
        if self._at is not None:
            raw = raw[:, -1, :][self._held]
        else:
            raw = raw[: len(self.rows), -1, :] if self._filler else raw[:, -1, :]
        if hidden is not None:
            self.keep_hidden(hidden)
        logits = self._process(inputs, raw)
        if len(self.rows) == 1:
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
        else:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        try:
            sampled = self.rows[0].sampler(logprobs) if self._one_sampler else sample(self.rows, logprobs)
            self.inputs = self.share(sampled)
            # Rows without processors sampled from the raw logits' log-probabilities: the capture reuses them.
            normalized = logprobs if logits is raw and len(self.rows) > 1 else None
            captured = capture_logprobs(self.rows, raw, self.inputs, normalized) if self._capturing else None
            mx.async_eval(self.inputs, *(captured.arrays if captured is not None else ()))
        except Exception:  # noqa: BLE001 - retried row by row: the rows that fail again are recorded, then ended
            self.inputs = self.share(sample_each(self.rows, logprobs, self.errors))
            capture_logprobs(self.rows, raw, self.inputs)
        self.logprobs = {request_id: [read_logprobs(arrays)] for request_id, arrays in previous.items()}
        started = time.perf_counter()
        tokens = inputs.tolist()
        self.waited_s += time.perf_counter() - started
        return tokens

    def position_inputs(self) -> dict[str, mx.array]:
        """Per-row position inputs of the next forward pass (any number of positions a row): multimodal RoPE
        offsets. None are needed when every row's positions are its cache offset and the model takes them from
        the cache (its text twin: :mod:`mlxd.models.text_twin`)."""
        if not self.uses_rope_deltas:
            return {}
        if self._positions is None:
            deltas = [0] * (len(self.rows) + self._filler)
            for i, row in enumerate(self.rows):
                deltas[self._at[i] if self._at is not None else i] = row.rope_delta
            needed = any(deltas) or not getattr(self.model, "has_text_twin", False)
            self._positions = {"rope_deltas": mx.array(deltas, dtype=mx.int32)[:, None]} if needed else {}
        return self._positions

    def _process(self, inputs: mx.array, logits: mx.array) -> mx.array:
        """The rows' logits after their processors: only the rows that have processors are sliced out and
        written back (one scatter), so rows without any cost nothing; rows sharing penalty settings are processed
        together (:mod:`mlxd.engine.step.penalties`). ``logits`` itself is left as it is."""
        if not self._processing:
            self._release_windows({})
            return logits
        groups, alone = self._penalty_groups()
        self._release_windows(groups)
        order, parts = [], []
        for key, members in groups.items():
            order += members
            parts.append(apply_penalties(key, self._group_windows(key, members, inputs), logits[mx.array(members)]))
        for i in alone:
            row = self.rows[i]
            try:
                parts.append(row.process(inputs[i : i + 1], logits[i : i + 1]))
            except Exception as e:  # noqa: BLE001 - recorded in self.errors; the engine ends this row
                self.errors[row.request_id] = e
                parts.append(logits[i : i + 1])
            order.append(i)
        joined = mx.concatenate(parts, axis=0)
        if order == list(range(len(self.rows))):
            return joined
        # A new array (the raw logits stay unprocessed for the log-probabilities), of the dtype joining every row
        # would give.
        out = logits.astype(mx.result_type(logits, joined))
        out[mx.array(order)] = joined
        return out

    def _group_windows(self, key: tuple, members: list[int], inputs: mx.array) -> mx.array:
        """The group's windows ``(m, CONTEXT)``, this step's input tokens appended. While a group keeps its rows,
        its windows roll forward in one operation (its rows' own histories wait, see :meth:`_release_windows`);
        a new group builds them from each row's history."""
        rows = tuple(self.rows[i] for i in members)
        held = self._windows.get(key)
        if held is not None and held[0] == rows:
            windows = mx.concatenate([held[1][:, 1:], inputs[mx.array(members)][:, None]], axis=1)
        else:
            for i in members:
                self.rows[i].history = mx.concatenate([self.rows[i].history, inputs[i : i + 1]])
            windows = mx.stack([self.rows[i].history[-CONTEXT:] for i in members])
        self._windows[key] = (rows, windows)
        return windows

    def _release_windows(self, groups: dict[tuple, list[int]]) -> None:
        """Groups whose rows changed give each row its history back: its window, the last CONTEXT tokens (all the
        penalties read), so that it may be processed alone or in another group."""
        for key, (rows, windows) in list(self._windows.items()):
            if key in groups and tuple(self.rows[i] for i in groups[key]) == rows:
                continue
            for j, row in enumerate(rows):
                row.history = windows[j]
            del self._windows[key]

    def _penalty_groups(self) -> tuple[dict[tuple, list[int]], list[int]]:
        """The rows with processors: groups of two or more sharing penalty settings with a full window of history
        (after this step's token), and the rest, which run their own processors."""
        groups: dict[tuple, list[int]] = {}
        alone = []
        for i in self._processing:
            row = self.rows[i]
            if (row.penalties is not None and row.spec is None and row.history is not None
                    and row.history.size + 1 >= CONTEXT):
                groups.setdefault(row.penalties, []).append(i)
            else:
                alone.append(i)
        for key in [key for key, members in groups.items() if len(members) < 2]:
            alone += groups.pop(key)
        return groups, sorted(alone)

def _release_drafts(rows: list[Row]) -> None:
    for row in rows:
        if row.spec is not None:
            row.spec.drafter.release(row.request_id)
