"""The transport of a tensor-parallel group: rank 0's messages and the sampled tokens, over MLX collectives.

No transport of our own: a message is an ``all_gather`` of a small header (its size, and every rank's counters for
``/v1/status``) and, when it has a body, an ``all_sum`` of its msgpack bytes (the other ranks add zeros). A decode
step with nothing changed is the header alone. What the messages mean: :mod:`mlxd.engine.distributed.leader`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import msgspec
import numpy as np

from mlxd.config.schema import DistributedConfig
from mlxd.engine.commands import Command, RunStep
from mlxd.errors import ModelLoadError


class Message(msgspec.Struct, array_like=True):
    """What rank 0 sends before a step (or while idle): the commands it applied since the last message, in order,
    and the step it runs next (None: no step)."""

    commands: list[Command]
    step: RunStep | None
    digest: tuple[int, ...]  # rank 0's state once the commands are applied (leader.state_digest)


_encoder, _decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Message)
# The most common message, a decode step with nothing changed, travels as its header alone (size -1).
DECODE_ONLY = Message([], RunStep([], []), ())


# ---- the group ----

def init_group(config: DistributedConfig) -> Any:
    """Join the group ``mlx.launch`` (or a hostfile's environment) set up; its size must be ``tensor_parallel``."""
    try:
        group = mx.distributed.init(strict=True, backend=config.backend)
    except (RuntimeError, ValueError) as e:
        raise ModelLoadError(f"[distributed] backend {config.backend!r}: cannot join the group ({e}); start the "
                             "ranks with `mlxd launch --config FILE` or under mlx.launch") from e
    if group.size() != config.tensor_parallel:
        raise ModelLoadError(f"[distributed] tensor_parallel = {config.tensor_parallel}, but the group has "
                             f"{group.size()} ranks: launch as many ranks as tensor_parallel")
    return group


# Per-rank numbers that travel in every message's header (KiB where bytes: int32 everywhere).
STATS = ("pid", "active_kib", "peak_kib", "cache_kib", "prefix_entries", "prefix_kib", "prefix_hits")


class Channel:
    """Rank 0's messages to the group, and the group's sampled tokens, over MLX collectives."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def exchange(self, message: Message | None, stats: list[int]) -> tuple[Message | None, list[dict[str, int]]]:
        """Rank 0 sends ``message`` (the others pass None and get it); every rank's ``stats`` come back to all."""
        bodiless = message is None or message is DECODE_ONLY
        payload = _encoder.encode(message) if self.rank == 0 and not bodiless else b""
        size = -1 if self.rank == 0 and message is DECODE_ONLY else len(payload)
        header = mx.array([[size, *stats]], dtype=mx.int32)
        gathered = mx.distributed.all_gather(header, group=self.group).tolist()
        size = gathered[0][0]
        peers = [dict(zip(STATS, row[1:], strict=True)) for row in gathered]
        if size <= 0:
            return (DECODE_ONLY if size < 0 else None), peers
        words = -(-size // 4)
        if self.rank == 0:
            mine = np.frombuffer(payload.ljust(4 * words, b"\0"), dtype=np.int32)
            data = mx.distributed.all_sum(mx.array(mine), group=self.group)
        else:
            data = mx.distributed.all_sum(mx.zeros((words,), dtype=mx.int32), group=self.group)
        received = np.array(data).tobytes()[:size]
        return (message if self.rank == 0 else _decoder.decode(received)), peers

    def share_tokens(self, tokens: mx.array) -> mx.array:
        """Rank 0's sampled tokens on every rank, lazily, as part of the step's graph. The others' own samples are
        multiplied by zero (not dropped: that keeps their forward pass, and its collectives, in the graph)."""
        mine = tokens.astype(mx.int32)
        if self.rank != 0:
            mine = mine * 0
        return mx.distributed.all_sum(mine, group=self.group).astype(tokens.dtype)


