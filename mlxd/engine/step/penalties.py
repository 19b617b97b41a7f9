"""Penalties and logit bias for many rows at once: what mlx-lm's logits processors (``make_logits_processors``) do to
one row, done to every row of a group that shares the same settings, in one gather and one scatter per processor.

A row whose processors are exactly the ones its sampling settings make (no constraint of its own) and whose token
history holds at least :data:`CONTEXT` tokens is processed here with its group; any other row runs its own
processors. Each element goes through the same arithmetic as in mlx-lm's processors (the same multiply, divide, add
or subtract of the same numbers, in the same order), so a row's logits are bit for bit those of its own processors:
a token repeated in the window is written twice with one value (repetition, presence) or subtracted once per
occurrence (frequency), as there.
"""

from __future__ import annotations

import inspect

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from mlxd.engine.base import SamplingParams

# The tokens each penalty looks back over: mlx-lm's default, which make_request_processors leaves in place.
_DEFAULTS = inspect.signature(make_logits_processors).parameters
CONTEXT = _DEFAULTS["repetition_context_size"].default
assert CONTEXT == _DEFAULTS["presence_context_size"].default == _DEFAULTS["frequency_context_size"].default

PenaltyKey = tuple


def penalty_key(params: SamplingParams) -> PenaltyKey | None:
    """The settings that make a row's processors (rows with equal keys are processed together); None: none."""
    key = (tuple((params.logit_bias or {}).items()), params.repetition_penalty or None,
           params.presence_penalty or None, params.frequency_penalty or None)
    return None if key == ((), None, None, None) else key


def apply_penalties(key: PenaltyKey, windows: mx.array, logits: mx.array) -> mx.array:
    """``logits`` ``(B, V)`` after the processors of ``key``, each row's penalties over its window of the last
    :data:`CONTEXT` tokens, ``windows`` ``(B, CONTEXT)``."""
    bias, repetition, presence, frequency = key
    if bias:
        logits = logits.at[:, mx.array([t for t, _ in bias])].add(mx.array([v for _, v in bias]))
    if repetition:
        selected = mx.take_along_axis(logits, windows, axis=-1)
        selected = mx.where(selected < 0, selected * repetition, selected / repetition)
        logits = mx.put_along_axis(logits, windows, selected, axis=-1)
    if presence:
        logits = mx.put_along_axis(logits, windows, mx.take_along_axis(logits, windows, axis=-1) - presence, axis=-1)
    if frequency:
        rows = mx.broadcast_to(mx.arange(logits.shape[0])[:, None], windows.shape)
        logits = logits.at[rows, windows].subtract(frequency)
    return logits
