"""The one vocabulary of what changes the engine's state: typed commands, applied by :meth:`EngineCore.apply`.

Plain data (msgspec structs, tagged): the event loop puts them in the engine's inbox, the engine thread makes its
own (a request finished, the prefix cache shrunk, the step's prompt plan), and a distributed leader sends those it
applied to the other ranks, which apply them through the same ``apply`` (:mod:`mlxd.engine.distributed`). A
command names requests by id; the request itself travels as a :class:`RequestSpec` (no callables, no images).

Applying the same commands, in the same order, to a fresh engine of the same model gives it the same rows, outputs
and prefix cache (``tests/test_command_replay.py``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from mlxd.engine.base import EngineRequest, SamplingParams


class RequestSpec(msgspec.Struct, array_like=True):
    """What every rank needs of a request to run its rows: no callables, no images (a distributed group serves
    text only; a local engine keeps the whole request beside its spec)."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    prefill_chunk: int
    checkpoints: tuple[int, ...]
    keep_prompt: bool

    @classmethod
    def of(cls, request: EngineRequest) -> RequestSpec:
        return cls(request.request_id, request.prompt, request.max_tokens, request.sampling, request.prefill_chunk,
                   request.checkpoints, request.keep_prompt)

    def request(self) -> EngineRequest:
        return EngineRequest(request_id=self.request_id, prompt=self.prompt, max_tokens=self.max_tokens,
                             sampling=self.sampling, prefill_chunk=self.prefill_chunk,
                             checkpoints=self.checkpoints, keep_prompt=self.keep_prompt)


class Accept(msgspec.Struct, tag=True, array_like=True):
    """Take a submitted request on: its prompt starts after the longest prefix-cache state, then it waits."""

    spec: RequestSpec


class Cancel(msgspec.Struct, tag=True, array_like=True):
    """End a request early: ``cancelled`` (its client left) or ``stop`` (its pipeline has what it needs)."""

    request_id: str
    reason: str = "cancelled"


class Keep(msgspec.Struct, tag=True, array_like=True):
    """Snapshot a decoding request's prompt and generated tokens in the prefix cache (for the next turn)."""

    request_id: str


class Drop(msgspec.Struct, tag=True, array_like=True):
    """Forget a request everywhere (finished, failed, timed out): its row, its queue place, its table entry."""

    request_id: str


class Evict(msgspec.Struct, tag=True, array_like=True):
    """Shrink the prefix cache to at most ``num_bytes`` (least recently used entries go first)."""

    num_bytes: int


class Clear(msgspec.Struct, tag=True, array_like=True):
    """Drop every prefix-cache entry; applying it returns the cache's stats from before."""


class EndAll(msgspec.Struct, tag=True, array_like=True):
    """End every request the engine holds with ``Failed(message, 503)``."""

    message: str = ""


class Stop(msgspec.Struct, tag=True, array_like=True):
    """End every request (the server is shutting down) and the engine's loop."""


class RunStep(msgspec.Struct, tag=True, array_like=True):
    """One step: these prompt chunks, then the decode step of every decoding row, then post-processing."""

    prefill: list[tuple[str, int]]  # (request id, prompt tokens to process), in the scheduler's order
    together: list[list[str]]  # groups of them whose whole prompts share one forward pass each


class ImagesEncoded(msgspec.Struct, tag=True):
    """The encoder thread finished a job (``encoded``: :class:`mlxd.engine.step.encoder.Encoded`). Local only:
    image features are MLX arrays, and a distributed group serves text models only."""

    encoded: Any


Command = Accept | Cancel | Keep | Drop | Evict | Clear | EndAll | Stop | RunStep
"""The commands a distributed leader sends (every command but :class:`ImagesEncoded`)."""
