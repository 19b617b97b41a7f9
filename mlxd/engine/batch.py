"""The MLX side of the batching engine: per-request prompt processing and the batched decode step.

Each request processes its prompt in chunks into a cache of its own (``make_prompt_cache``, what ``generate_step``
uses); short prompts that arrive together go through one left-padded forward pass instead
(:func:`process_prompts`). When its prompt is in, a request's cache joins the :class:`DecodeBatch`, which advances
every decoding request by one token per forward pass.

The batch composes mlx-lm's cache protocol and nothing private: per layer, ``merge`` builds a left-padded batched
cache (``BatchKVCache``, ``BatchRotatingKVCache``, ``ArraysCache`` for recurrent layers), ``extend`` adds a row,
``filter`` drops rows and ``extract`` takes one back out. A batch of one keeps the request's own cache and calls the
model exactly as ``generate_step`` does (no mask, no padding), so a lone stream runs at its speed.

Rows carry their own cache offsets (positions), so rows that need their own positions or input embeddings (vision
prompts) fit the same step: only their prompt processing differs, in :func:`process_prompt`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from mlxd.engine.base import SamplingParams
from mlxd.engine.sampling import make_request_processors, make_request_sampler


@dataclass(slots=True, eq=False)
class Row:
    """One request's sampling state: its sampler, logits processors and (when they need it) token history."""

    request_id: str
    sampler: Any
    sampler_key: tuple
    processors: list
    history: mx.array | None = None
    cache: list[Any] = field(default_factory=list)  # its own cache until it joins the batch

    @classmethod
    def for_request(cls, request_id: str, params: SamplingParams, model: Any, max_kv_size: int,
                    cache: list[Any] | None = None) -> Row:
        """A row for a request; ``cache`` is state to continue from (a prefix-cache hit), else a fresh cache."""
        key = (params.temperature, params.top_p, params.min_p, params.top_k)
        return cls(
            request_id=request_id,
            sampler=make_request_sampler(params),
            sampler_key=key,
            processors=make_request_processors(params),
            cache=cache if cache is not None else make_request_cache(model, max_kv_size),
        )

    def process(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """Apply this row's logits processors; ``tokens`` are the new input tokens (added to the history)."""
        if not self.processors:
            return logits
        self.history = tokens if self.history is None else mx.concatenate([self.history, tokens])
        for processor in self.processors:
            logits = processor(self.history, logits)
        return logits


def make_request_cache(model: Any, max_kv_size: int = 0) -> list[Any]:
    """A request's own cache: the model's, or one ``RotatingKVCache`` per layer when ``max_kv_size`` is set.

    The rotating cache keeps no leading tokens (``keep=0``, where ``generate_step`` keeps 4): mlx-lm's batched
    rotating cache has no such option, and a request must attend to the same tokens alone and in a batch.
    """
    if not max_kv_size or hasattr(model, "make_cache"):
        return make_prompt_cache(model)
    return [RotatingKVCache(max_size=max_kv_size, keep=0) for _ in model.layers]


def process_prompt(model: Any, row: Row, tokens: list[int], *, last: bool) -> mx.array | None:
    """Run one prompt chunk through the model into the row's cache.

    For the last chunk, sample the first generated token and return it (a lazy ``(1,)`` array); otherwise evaluate
    the cache and return ``None``.
    """
    inputs = mx.array(tokens, dtype=mx.uint32)
    logits = model(inputs[None], cache=row.cache)
    if not last:
        if row.processors:
            row.history = inputs if row.history is None else mx.concatenate([row.history, inputs])
        mx.eval([c.state for c in row.cache])
        return None
    logits = row.process(inputs, logits[:, -1, :])
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    first = row.sampler(logprobs)
    mx.async_eval(first)
    return first


# Cache types whose batched form can be left-padded before a first forward pass.
_LEFT_PADDABLE = (KVCache, RotatingKVCache, ArraysCache)


def can_batch_prompts(rows: list[Row]) -> bool:
    """Whether these rows' (empty) caches can be merged into one left-padded batch for :func:`process_prompts`."""
    return len(rows) > 1 and all(isinstance(c, _LEFT_PADDABLE) and c.empty() for row in rows for c in row.cache)


def process_prompts(model: Any, rows: list[Row], prompts: list[list[int]]) -> tuple[list[Any], mx.array]:
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
    logits = model(inputs, cache=cache)[:, -1, :]
    if any(row.processors for row in rows):
        logits = mx.concatenate([row.process(mx.array(p, dtype=mx.uint32), logits[i : i + 1])
                                 for i, (row, p) in enumerate(zip(rows, prompts, strict=True))])
    first = sample(rows, logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    mx.async_eval(first)
    for row in rows:
        row.cache = []
    return cache, first


def sample(rows: list[Row], logprobs: mx.array) -> mx.array:
    """One token per row: one sampler call when the rows sample alike, else one per row."""
    first = rows[0]
    if all(row.sampler_key == first.sampler_key for row in rows):
        return first.sampler(logprobs)
    return mx.concatenate([row.sampler(logprobs[i : i + 1]) for i, row in enumerate(rows)])


class DecodeBatch:
    """The decoding requests, advanced together by :meth:`step`, one token each."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.rows: list[Row] = []
        self.cache: list[Any] = []
        # The tokens each row feeds into the next forward pass: sampled, not necessarily evaluated yet.
        self.inputs: mx.array | None = None

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
            return
        self.add_batch([row], [c.merge([c]) for c in cache], first_token.reshape(1))

    def add_batch(self, rows: list[Row], cache: list[Any], first_tokens: mx.array) -> None:
        """Join rows processed together by :func:`process_prompts` (``cache`` in batched form)."""
        if not self.rows and len(rows) == 1:
            self.cache, self.inputs, self.rows = [c.extract(0) for c in cache], first_tokens, list(rows)
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

    def row_cache(self, request_id: str) -> list[Any]:
        """One row's cache layers at batch size 1 (the batch's own cache when it is the only row, else a copy)."""
        if len(self.rows) == 1:
            return self.cache
        index = self.request_ids.index(request_id)
        return [layer.extract(index) for layer in self.cache]

    def remove(self, request_ids: set[str]) -> None:
        """Drop rows (finished or cancelled); their cache memory is released with them."""
        keep = [i for i, row in enumerate(self.rows) if row.request_id not in request_ids]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
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

    def step(self) -> list[int]:
        """Dispatch the next forward pass, then return the tokens fed into it (one per row, in row order).

        Pipelined like ``generate_step``: the returned tokens were sampled by the previous step (or by prompt
        processing), and evaluating them overlaps with the computation just dispatched.
        """
        inputs = self.inputs
        logits = self.model(inputs[:, None], cache=self.cache)[:, -1, :]
        logits = self._process(inputs, logits)
        if len(self.rows) == 1:
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
        else:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self.inputs = sample(self.rows, logprobs)
        mx.async_eval(self.inputs)
        return inputs.tolist()

    def _process(self, inputs: mx.array, logits: mx.array) -> mx.array:
        if not any(row.processors for row in self.rows):
            return logits
        rows = [row.process(inputs[i : i + 1], logits[i : i + 1]) for i, row in enumerate(self.rows)]
        return mx.concatenate(rows, axis=0)
