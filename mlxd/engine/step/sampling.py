"""Per-request samplers and logits processors, built from mlx-lm's own factories and filters."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from mlxd.engine.base import SamplingParams


def make_request_sampler(params: SamplingParams):
    """The sampler for a request (greedy at temperature 0).

    Unseeded requests use mlx-lm's sampler, which draws from MLX's global random state (rows that sample alike
    share one call). A seeded request gets a sampler with its own key, derived from its seed and split at every
    draw: its tokens do not depend on what else is in the batch.
    """
    if params.seed is None or params.temperature == 0:
        return make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)
    return make_seeded_sampler(params, mx.random.key(params.seed))


def make_seeded_sampler(params: SamplingParams, key: mx.array) -> SeededSampler:
    """mlx-lm's sampling chain (top-p, min-p, top-k, then a categorical draw at the temperature) with a random key
    of the row's own, split at each draw."""
    return SeededSampler(params, key)


class SeededSampler:
    """A sampler with its own random key: :meth:`next_key` splits it (each draw, speculative verification too)."""

    def __init__(self, params: SamplingParams, key: mx.array) -> None:
        self.filters: list[Callable[[mx.array], mx.array]] = []
        if 0 < params.top_p < 1.0:
            self.filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p != 0.0:
            self.filters.append(lambda x: apply_min_p(x, params.min_p))
        if params.top_k > 0:
            self.filters.append(lambda x: apply_top_k(x, params.top_k))
        self.key = key
        self.scale = 1.0 / params.temperature

    def next_key(self) -> mx.array:
        self.key, draw = mx.random.split(self.key)
        return draw

    def __call__(self, logprobs: mx.array) -> mx.array:
        for apply in self.filters:
            logprobs = apply(logprobs)
        return mx.random.categorical(logprobs * self.scale, key=self.next_key())


def sampler_group(params: SamplingParams, request_id: str) -> tuple:
    """Rows whose groups are equal sample with one call; a seeded row samples alone (with its own key)."""
    if params.seed is not None and params.temperature != 0:
        return ("seeded", request_id)
    return (params.temperature, params.top_p, params.min_p, params.top_k)


def make_request_processors(params: SamplingParams) -> list:
    """mlx-lm logits processors for the request's penalties and logit bias (empty when none are set)."""
    return make_logits_processors(
        logit_bias=params.logit_bias,
        repetition_penalty=params.repetition_penalty or None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )
