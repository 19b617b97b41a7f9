"""The transport of a tensor-parallel group: rank 0's messages on a control connection, the sampled tokens on
the device.

Rank 0's messages travel over TCP (:mod:`.control`), read by the host as soon as they arrive: not over a
collective, which would queue behind the step running on the device and keep rank 0 from planning step n+1 while
step n runs. The other ranks' counters (for ``/v1/status``) come back on the same connections, now and then, not
with every step. The one collective a decode step adds to the model's own is :meth:`Channel.share_tokens`, part of
the step's graph. What the messages mean: :mod:`mlxd.engine.distributed.leader`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import msgspec

from mlxd.config.schema import DistributedConfig
from mlxd.engine.commands import Command, RunStep, Stop
from mlxd.engine.distributed.control import ControlClient, ControlServer
from mlxd.errors import DistributedFault, ModelLoadError


class Message(msgspec.Struct, array_like=True):
    """What rank 0 sends before a step (or while idle): the commands it applied since the last message, in order,
    and the step it runs next (None: no step)."""

    commands: list[Command]
    step: RunStep | None
    digest: tuple[int, ...]  # rank 0's state once the commands are applied (leader.state_digest)


_encoder, _decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Message)
# The most common message, a decode step with nothing changed: no digest (nothing changed), encoded once.
DECODE_ONLY = Message([], RunStep([], []), ())
_DECODE_ONLY_FRAME = _encoder.encode(DECODE_ONLY)


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


# Per-rank numbers for /v1/status (KiB where bytes).
STATS = ("pid", "active_kib", "peak_kib", "cache_kib", "prefix_entries", "prefix_kib", "prefix_hits")


class Channel:
    """Rank 0's messages to the group (a control connection per rank, :meth:`connect` first), the other ranks'
    counters back, and the group's sampled tokens, shared on the device."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self._server: ControlServer | None = None
        self._client: ControlClient | None = None

    def connect(self, timeout_s: float, port: int = 0) -> None:
        """Set up the control connections: every rank calls it at the same point (it runs one collective). Rank 0
        listens on ``port`` (0: an ephemeral one)."""
        if self.size == 1:
            return
        if self.rank == 0:
            self._server = ControlServer(self.group, timeout_s, port=port)
        else:
            self._client = ControlClient(self.group, timeout_s)

    # ---- rank 0 ----

    @property
    def lost(self) -> str | None:
        """Rank 0: why another rank's connection ended while the job ran (None: none did)."""
        return self._server.lost if self._server is not None else None

    def send(self, message: Message) -> None:
        """Rank 0: ``message`` to every other rank, without waiting for the device or for them."""
        if self._server is None:
            return
        if any(isinstance(command, Stop) for command in message.commands):
            self._server.expect_close()
        self._server.send(_DECODE_ONLY_FRAME if message is DECODE_ONLY else _encoder.encode(message))

    def wait_reported(self, timeout_s: float) -> None:
        """Rank 0: until every other rank has reported its counters once (it is warm and listening)."""
        if self._server is not None:
            self._server.wait_reported(timeout_s)

    def peer_stats(self) -> list[dict[str, int] | None]:
        """Rank 0: each other rank's last reported counters (None: not heard yet), in rank order from rank 1."""
        if self._server is None:
            return []
        return [dict(zip(STATS, s, strict=True)) if s is not None else None for s in self._server.stats[1:]]

    # ---- the other ranks ----

    def receive(self) -> Message:
        """A rank other than 0: rank 0's next message (blocks on the host until it comes)."""
        if self._client is None:
            raise DistributedFault(f"rank {self.rank}: the control connection is not set up")
        return _decoder.decode(self._client.receive())

    def report(self, stats: list[int]) -> None:
        """A rank other than 0: send rank 0 this rank's counters (:data:`STATS`)."""
        if self._client is not None:
            self._client.report(stats)

    def close(self, wait_s: float = 0.0) -> None:
        """Close the control connections (rank 0: after waiting up to ``wait_s`` for the others to close theirs)."""
        if self._server is not None:
            self._server.close(wait_s)
        if self._client is not None:
            self._client.close()

    # ---- on the device ----

    def share_tokens(self, tokens: mx.array) -> mx.array:
        """Rank 0's sampled tokens on every rank, lazily, as part of the step's graph. The others' own samples are
        multiplied by zero (not dropped: that keeps their forward pass, and its collectives, in the graph)."""
        mine = tokens.astype(mx.int32)
        if self.rank != 0:
            mine = mine * 0
        return mx.distributed.all_sum(mine, group=self.group).astype(tokens.dtype)
