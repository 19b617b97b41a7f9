"""The MLX side of the batching engine: per-request prompt processing and the batched decode step.

Each request processes its prompt in chunks into a cache of its own (``make_prompt_cache``, what ``generate_step``
uses); short prompts that arrive together go through one left-padded forward pass instead
(:func:`process_prompts`). When its prompt is in, a request's cache joins the :class:`DecodeBatch`, which advances
every decoding request by one token per forward pass, or, for speculative rows with drafts, by the drafts the
model keeps (:mod:`mlxd.engine.spec_step`).

The batch composes mlx-lm's cache protocol and nothing private: per layer, ``merge`` builds a left-padded batched
cache (``BatchKVCache``, ``BatchRotatingKVCache``, ``ArraysCache`` for recurrent layers), ``extend`` adds a row,
``filter`` drops rows and ``extract`` takes one back out. A batch of one keeps the request's own cache and calls the
model exactly as ``generate_step`` does (no mask, no padding), so a lone stream runs at its speed.

Rows carry their own cache offsets (positions), so rows that need their own positions or input embeddings (vision
prompts) fit the same step: only their prompt processing differs, in :func:`process_prompt`.

Failures stay with their row where they can: ``check_request`` (:mod:`mlxd.engine.row`) keeps token ids outside the
vocabulary away from MLX, and a decode step whose grouped sampling raises samples row by row, recording the rows that
fail again in :attr:`DecodeBatch.errors` for the engine to end. A raising compiled sampler can leave MLX's global
random state pointing at a broken array; ``reset_random_state`` replaces it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlxd.engine.logprobs import capture_logprobs, read_logprobs
from mlxd.engine.row import Row, reset_random_state
from mlxd.engine.spec_step import draft, draft_lengths, speculative_step
from mlxd.engine.stepcosts import StepCosts
from mlxd.engine.target import forward


def same(tokens: mx.array) -> mx.array:
    """Sampled tokens as they are (one process); a distributed group replaces them with rank 0's."""
    return tokens


def process_prompt(model: Any, row: Row, tokens: list[int], *, last: bool, start: int = 0,
                   share: Callable[[mx.array], mx.array] = same) -> mx.array | None:
    """Run one prompt chunk, which starts at prompt position ``start``, through the model into the row's cache.

    For the last chunk, sample the first generated token and return it (a lazy ``(1,)`` array, passed through
    ``share``); otherwise evaluate the cache and return ``None``.
    """
    inputs = mx.array(tokens, dtype=mx.uint32)
    logits, hidden = forward(model, inputs[None], row.cache, hidden=row.wants_hidden,
                             **row.prompt_inputs(start, start + len(tokens)))
    if hidden is not None:
        row.keep_hidden(hidden[0])
    if not last:
        if row.processors:
            row.history = inputs if row.history is None else mx.concatenate([row.history, inputs])
        mx.eval([c.state for c in row.cache])
        return None
    raw = logits[:, -1, :]
    logits = row.process(inputs, raw)
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    first = share(row.sampler(logprobs))
    capture_logprobs([row], raw, first)
    mx.async_eval(first)
    return first


# Cache types whose batched form can be left-padded before a first forward pass.
_LEFT_PADDABLE = (KVCache, RotatingKVCache, ArraysCache)


def can_batch_prompts(rows: list[Row]) -> bool:
    """Whether these rows' (empty) caches can be merged into one left-padded batch for :func:`process_prompts`."""
    return len(rows) > 1 and all(row.vision is None and isinstance(c, _LEFT_PADDABLE) and c.empty()
                                 for row in rows for c in row.cache)


def process_prompts(model: Any, rows: list[Row], prompts: list[list[int]],
                    share: Callable[[mx.array], mx.array] = same) -> tuple[list[Any], mx.array]:
    """Run several whole prompts (rows with empty caches) through the model in one left-padded forward pass.

    Returns the batched cache (rows in order) and the first generated token of each row, sampled lazily.
    """
    lengths = [len(p) for p in prompts]
    padding = [max(lengths) - n for n in lengths]
    inputs = mx.array([[0] * pad + p for p, pad in zip(prompts, padding, strict=True)], dtype=mx.uint32)
    cache = [layer.merge([row.cache[i] for row in rows]) for i, layer in enumerate(rows[0].cache)]
    for layer in cache:
        if isinstance(layer, ArraysCache):
            layer.left_padding = mx.array(padding)
        else:
            layer.prepare(left_padding=padding)
    logits, hidden = forward(model, inputs, cache, hidden=any(row.wants_hidden for row in rows))
    logits = raw = logits[:, -1, :]
    for i, row in enumerate(rows):
        if row.wants_hidden:
            row.keep_hidden(hidden[i, padding[i] :])
    if any(row.processors for row in rows):
        logits = mx.concatenate([row.process(mx.array(p, dtype=mx.uint32), logits[i : i + 1])
                                 for i, (row, p) in enumerate(zip(rows, prompts, strict=True))])
    return cache, first_tokens(rows, raw, logits, share)


def first_tokens(rows: list[Row], raw: mx.array, logits: mx.array, share: Callable[[mx.array], mx.array]) -> mx.array:
    """Each row's first generated token, sampled lazily from ``logits`` (the rows' processors applied to ``raw``,
    one row of logits each), with its log-probabilities captured from ``raw``. The rows' own caches are dropped:
    the batched cache now holds them."""
    first = share(sample(rows, logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
    capture_logprobs(rows, raw, first)
    mx.async_eval(first)
    for row in rows:
        row.cache = []
    return first


def can_continue_together(rows: list[Row]) -> bool:
    """Whether these rows, each holding a cached prefix of its prompt (attention layers only), can run the rest of
    their prompts in one pass (:func:`process_continuations`)."""
    return len(rows) > 1 and all(row.vision is None and not row.processors and not row.wants_hidden
                                 and all(type(c) is KVCache and not c.empty() for c in row.cache) for row in rows)


def process_continuations(model: Any, rows: list[Row], suffixes: list[list[int]],
                          share: Callable[[mx.array], mx.array] = same) -> tuple[list[Any], mx.array]:
    """Run the rest of several prompts in one forward pass, each row's cache already holding the prompt's start
    (a prefix-cache hit; lengths may differ): :func:`right_padded_pass`."""
    return right_padded_pass(model, rows, suffixes, share)


# The per-prompt inputs a vision row's prompt may carry and still share a pass (Qwen-VL positions, deepstack).
_PADDABLE_EXTRAS = frozenset({"position_ids", "visual_pos_masks", "deepstack_visual_embeds"})


def can_batch_vision_prompts(rows: list[Row]) -> bool:
    """Whether these vision rows (fresh attention caches, whole prompts) can share one pass
    (:func:`process_vision_prompts`)."""
    if len(rows) < 2 or any(row.vision is None for row in rows):
        return False
    keys = rows[0].vision.extras.keys()
    return keys <= _PADDABLE_EXTRAS and all(
        row.vision.extras.keys() == keys and not row.processors and not row.wants_hidden
        and all(type(c) is KVCache and c.empty() for c in row.cache) for row in rows)


def process_vision_prompts(model: Any, rows: list[Row], prompts: list[list[int]],
                           share: Callable[[mx.array], mx.array] = same) -> tuple[list[Any], mx.array]:
    """Run several whole image prompts in one forward pass: their merged embeddings and position inputs
    right-padded to the longest (:func:`right_padded_pass`). Each row keeps its own multimodal positions."""
    right = _right_padding(prompts)
    embeds = mx.concatenate([mx.pad(row.vision.embeds, [(0, 0), (0, pad), (0, 0)])
                             for row, pad in zip(rows, right, strict=True)])
    extras = _padded_extras([row.vision.extras for row in rows], right)
    return right_padded_pass(model, rows, prompts, share, embeds=embeds, **extras)


def _padded_extras(extras: list[dict[str, Any]], right: list[int]) -> dict[str, Any]:
    """One batch's position inputs from each row's (1-row) ones, right-padded (padding positions are never
    attended to); the deepstack features, compact per row, joined row after row."""
    def padded(name: str, axis: int) -> mx.array:
        parts = []
        for e, pad in zip(extras, right, strict=True):
            widths = [(0, 0)] * e[name].ndim
            widths[-1] = (0, pad)
            parts.append(mx.pad(e[name], widths))
        return mx.concatenate(parts, axis=axis)

    out: dict[str, Any] = {}
    if "position_ids" in extras[0]:
        out["position_ids"] = padded("position_ids", 1)  # (3, B, L)
    if "visual_pos_masks" in extras[0]:
        out["visual_pos_masks"] = padded("visual_pos_masks", 0)  # (B, L)
    if "deepstack_visual_embeds" in extras[0]:
        layers = zip(*(e["deepstack_visual_embeds"] for e in extras), strict=True)
        out["deepstack_visual_embeds"] = [mx.concatenate(layer) for layer in layers]
    return out


def _right_padding(prompts: list[list[int]]) -> list[int]:
    longest = max(len(p) for p in prompts)
    return [longest - len(p) for p in prompts]


def right_padded_pass(model: Any, rows: list[Row], prompts: list[list[int]],
                      share: Callable[[mx.array], mx.array] = same, **inputs: Any) -> tuple[list[Any], mx.array]:
    """Run ``prompts`` (each the next tokens of its row: a whole prompt into an empty cache, or the rest after a
    cached start) in one forward pass, with the model ``inputs`` given (already right-padded).

    The rows' caches are merged left-padded (cached lengths may differ); the prompts go in right-padded, and mlx-lm's
    ``BatchKVCache`` then rolls each row's right padding to its left (``prepare(right_padding=...)``,
    ``finalize``), so that the batch joins the decode step left-padded like any other. Causal attention keeps a
    row's real positions from seeing its right padding. Returns the batched cache and each row's first generated
    token, sampled lazily from the logits at its last real position.
    """
    right = _right_padding(prompts)
    tokens = mx.array([p + [0] * pad for p, pad in zip(prompts, right, strict=True)], dtype=mx.uint32)
    cache = [layer.merge([row.cache[i] for row in rows]) for i, layer in enumerate(rows[0].cache)]
    for layer in cache:
        layer.prepare(right_padding=right)
    logits, _ = forward(model, tokens, cache, **inputs)
    raw = logits[mx.arange(len(rows)), mx.array([len(p) - 1 for p in prompts])]
    for layer in cache:
        layer.finalize()
    return cache, first_tokens(rows, raw, raw, share)


def sample(rows: list[Row], logprobs: mx.array) -> mx.array:
    """One token per row: one sampler call when the rows sample alike, else one per row."""
    first = rows[0]
    if all(row.sampler_key == first.sampler_key for row in rows):
        return first.sampler(logprobs)
    return mx.concatenate([row.sampler(logprobs[i : i + 1]) for i, row in enumerate(rows)])


class DecodeBatch:
    """The decoding requests, advanced together by :meth:`step`, one token each."""

    def __init__(self, model: Any, share: Callable[[mx.array], mx.array] = same) -> None:
        self.model = model
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
        # Whether any row is speculative (then each step first asks the drafters), and the left padding that
        # ragged speculative steps have added since the batched cache was last compacted.
        self.speculative = False
        self.wants_hidden = False
        self._ragged = 0
        # Seconds the last step spent waiting for the device (reading tokens back), for the step breakdown.
        self.waited_s = 0.0
        # What plain and verify steps cost here, for speculative rows to weigh their drafts against.
        self.costs = StepCosts()
        # Multimodal RoPE: each row's position offset, (B, 1), rebuilt when rows change.
        self.uses_rope_deltas = getattr(model, "uses_rope_deltas", False)
        self._positions: dict[str, mx.array] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def request_ids(self) -> list[str]:
        return [row.request_id for row in self.rows]

    def add(self, row: Row, first_token: mx.array) -> None:
        """Join a row whose prompt is processed; ``first_token`` is what :func:`process_prompt` sampled."""
        cache, row.cache = row.cache, []
        if not self.rows:
            self.cache, self.inputs, self.rows = cache, first_token.reshape(1), [row]
            self._rows_changed()
            return
        self.add_batch([row], [c.merge([c]) for c in cache], first_token.reshape(1))

    def add_batch(self, rows: list[Row], cache: list[Any], first_tokens: mx.array) -> None:
        """Join rows processed together by :func:`process_prompts` (``cache`` in batched form)."""
        if not self.rows and len(rows) == 1:
            self.cache, self.inputs, self.rows = [c.extract(0) for c in cache], first_tokens, list(rows)
            self._rows_changed()
            return
        if not self.rows:
            self.cache, self.inputs = cache, first_tokens
        else:
            if len(self.rows) == 1:
                self.cache = [c.merge([c]) for c in self.cache]
            for mine, theirs in zip(self.cache, cache, strict=True):
                mine.extend(theirs)
            self.inputs = mx.concatenate([self.inputs, first_tokens])
        self.rows.extend(rows)
        self._rows_changed()

    def _rows_changed(self) -> None:
        self._positions = None
        self.speculative = any(row.spec is not None for row in self.rows)
        self.wants_hidden = any(row.wants_hidden for row in self.rows)

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
        return [layer.extract(index) for layer in self.cache]

    def clear(self) -> None:
        """Drop every row without touching their caches (which a failed step may have left unusable)."""
        _release_drafts(self.rows)
        self.rows, self.cache, self.inputs, self.errors = [], [], None, {}
        self._rows_changed()

    def remove(self, request_ids: set[str]) -> None:
        """Drop rows (finished or cancelled); their cache memory is released with them."""
        keep = [i for i, row in enumerate(self.rows) if row.request_id not in request_ids]
        if len(keep) == len(self.rows):
            return
        _release_drafts([row for row in self.rows if row.request_id in request_ids])
        self.rows = [self.rows[i] for i in keep]
        self._rows_changed()
        if not keep:
            self.cache, self.inputs = [], None
            return
        if len(keep) == 1:
            # Back to a plain cache: the lone stream runs unmasked again.
            self.cache = [c.extract(keep[0]) for c in self.cache]
        else:
            for c in self.cache:
                c.filter(mx.array(keep))
        self.inputs = self.inputs[mx.array(keep)]

    def step(self) -> list[list[int]]:
        """Advance every row; return each row's emitted tokens, in row order.

        Plain rows emit one token a step: the one fed into the forward pass just dispatched, sampled by the previous
        step (or by prompt processing), so that evaluating it overlaps with the computation (pipelined like
        ``generate_step``). When a speculative row has drafted tokens, the step verifies them instead
        (:func:`mlxd.engine.spec_step.speculative_step`): each row emits its fed token and the drafts it kept.

        Raises when the shared work fails (the forward pass, evaluating the returned tokens): every row is lost.
        A row whose own logits processing or sampling fails is recorded in :attr:`errors` instead.
        """
        lengths = draft_lengths(self) if self.speculative else None
        if lengths is not None:
            started = time.perf_counter()
            fed = self.inputs.tolist()
            self.waited_s += time.perf_counter() - started
            drafts = draft(self, fed, lengths)
            if any(drafts):
                emitted = speculative_step(self, fed, drafts)
                self._compact_if_ragged(emitted)
                return emitted
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
        previous = {row.request_id: row.pending_logprobs for row in self.rows if row.pending_logprobs is not None}
        raw, hidden = forward(self.model, inputs[:, None], self.cache, hidden=self.wants_hidden,
                              **self.position_inputs())
        raw = raw[:, -1, :]
        if hidden is not None:
            self.keep_hidden(hidden)
        logits = self._process(inputs, raw)
        if len(self.rows) == 1:
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
        else:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        try:
            self.inputs = self.share(sample(self.rows, logprobs))
            capture_logprobs(self.rows, raw, self.inputs)
            mx.async_eval(self.inputs, *(row.pending_logprobs for row in self.rows if row.pending_logprobs))
        except Exception:  # noqa: BLE001 - retried row by row: the rows that fail again are recorded, then ended
            self.inputs = self.share(self._sample_each(logprobs))
            capture_logprobs(self.rows, raw, self.inputs)
        self.logprobs = {request_id: [read_logprobs(arrays)] for request_id, arrays in previous.items()}
        started = time.perf_counter()
        tokens = inputs.tolist()
        self.waited_s += time.perf_counter() - started
        return tokens

    def _compact_if_ragged(self, emitted: list[list[int]]) -> None:
        """Rows that kept fewer positions than others in a speculative step leave left padding behind (their
        rejected tail rolled to the front). Once that waste averages 64 positions a row, rebuild the batched cache
        with each row's padding at its minimum (one copy of the cache)."""
        if len(self.rows) < 2:
            return
        longest = max(len(e) for e in emitted)
        self._ragged += sum(longest - len(e) for e in emitted)
        if self._ragged < 64 * len(self.rows):
            return
        self._ragged = 0
        rows = [[layer.extract(i) for i in range(len(self.rows))] for layer in self.cache]
        self.cache = [layer[0].merge(layer) for layer in rows]

    def position_inputs(self) -> dict[str, mx.array]:
        """Per-row position inputs of the next forward pass (any number of positions a row): multimodal RoPE
        offsets. None are needed when every row's positions are its cache offset and the model takes them from
        the cache (its text twin: :mod:`mlxd.models.text_twin`)."""
        if not self.uses_rope_deltas:
            return {}
        if self._positions is None:
            deltas = [row.rope_delta for row in self.rows]
            needed = any(deltas) or not getattr(self.model, "has_text_twin", False)
            self._positions = {"rope_deltas": mx.array(deltas, dtype=mx.int32)[:, None]} if needed else {}
        return self._positions

    def _sample_each(self, logprobs: mx.array) -> mx.array:
        """Sample row by row, evaluating each token, so a failure lands on its own row (the slow path)."""
        reset_random_state()
        mx.eval(logprobs)  # raises when the forward pass itself failed: that is every row's loss
        tokens = []
        for i, row in enumerate(self.rows):
            try:
                token = row.sampler(logprobs[i : i + 1])
                mx.eval(token)
            except Exception as e:  # noqa: BLE001 - recorded in self.errors; the engine ends this row
                reset_random_state()
                self.errors[row.request_id] = e
                token = mx.zeros((1,), dtype=mx.uint32)
            tokens.append(token.astype(mx.uint32))
        return mx.concatenate(tokens)

    def _process(self, inputs: mx.array, logits: mx.array) -> mx.array:
        if not any(row.processors for row in self.rows):
            return logits
        rows = []
        for i, row in enumerate(self.rows):
            try:
                rows.append(row.process(inputs[i : i + 1], logits[i : i + 1]))
            except Exception as e:  # noqa: BLE001 - recorded in self.errors; the engine ends this row
                self.errors[row.request_id] = e
                rows.append(logits[i : i + 1])
        return mx.concatenate(rows, axis=0)


def _release_drafts(rows: list[Row]) -> None:
    for row in rows:
        if row.spec is not None:
            row.spec.drafter.release(row.request_id)
