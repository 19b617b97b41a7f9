"""Per-request samplers and logits processors, built from mlx-lm's own factories."""

from __future__ import annotations

from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlxd.engine.base import SamplingParams


def make_request_sampler(params: SamplingParams):
    """The mlx-lm sampler for a request (greedy at temperature 0)."""
    return make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)


def make_request_processors(params: SamplingParams) -> list:
    """mlx-lm logits processors for the request's penalties and logit bias (empty when none are set)."""
    return make_logits_processors(
        logit_bias=params.logit_bias,
        repetition_penalty=params.repetition_penalty or None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )
