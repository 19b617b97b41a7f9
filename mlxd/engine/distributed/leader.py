"""Rank 0 of a tensor-parallel group: the engine's part that records the commands it applies and sends them to the
other ranks before each step (see :mod:`mlxd.engine.distributed`), and the watchdog that ends the job when the
group stops answering or a rank's control connection ends."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxd.config.schema import DistributedConfig, EngineConfig
from mlxd.engine.commands import Command, RunStep
from mlxd.engine.distributed.channel import DECODE_ONLY, STATS, Channel, Message
from mlxd.errors import DistributedFault
from mlxd.log import get_logger

if TYPE_CHECKING:
    from mlxd.engine.core import EngineCore
    from mlxd.engine.engine import BatchedEngine

log = get_logger("mlxd.distributed")


def make_leader_engine(model: Any, config: EngineConfig, *, channel: Channel,
                       settings: DistributedConfig) -> BatchedEngine:
    """Rank 0's engine: the batching engine, sharing its sampled tokens over ``channel``, with a :class:`Leader`."""
    from mlxd.engine.engine import BatchedEngine

    return BatchedEngine(model, config, channel=channel, leader=Leader(channel, settings))


def rank_stats(core: EngineCore) -> list[int]:
    """This rank's numbers for /v1/status, in the order of :data:`mlxd.engine.distributed.channel.STATS`."""
    prefix = core.reuse.stats()
    kib = 1024
    return [os.getpid(), mx.get_active_memory() // kib, mx.get_peak_memory() // kib, mx.get_cache_memory() // kib,
            prefix.get("num_entries", 0), prefix.get("num_bytes", 0) // kib, prefix.get("num_hits", 0)]


def state_digest(core: EngineCore) -> tuple[int, ...]:
    """What must be equal on every rank between steps: rows, requests, prefix-cache entries and bytes."""
    return (len(core.runner.batch), len(core.table), len(core.runner.prefilling), core.reuse.num_bytes,
            core.reuse.stats().get("num_entries", 0))


class Leader:
    """Records what rank 0's engine applies and sends it: with each step, and while idle every ``heartbeat_s``.

    Sending does not wait for the device or for the other ranks (:mod:`.channel`): rank 0 plans and sends step
    n+1 while step n runs. The other ranks' counters arrive on their own, answering idle messages."""

    def __init__(self, channel: Channel, settings: DistributedConfig) -> None:
        self.channel, self.settings = channel, settings
        self.heartbeat_s = settings.heartbeat_s  # the idle engine wakes this often
        self.busy_since: float | None = None  # when the current step or message started (the watchdog reads it)
        self.hostname = socket.gethostname()
        self._commands: list[Command] = []
        self._last_sent = time.monotonic()
        self._engine: BatchedEngine | None = None

    def attach(self, engine: BatchedEngine) -> None:
        self._engine = engine

    def record(self, command: Command) -> None:
        """A command the engine is about to apply; a step is sent at once, with what was recorded before it."""
        if isinstance(command, RunStep):
            self.busy_since = time.monotonic()
            self._publish(command)
        else:
            self._commands.append(command)

    def ready(self) -> None:
        """The engine is warm: the control connections are set up (every rank is warm by then: it takes a
        collective), and every rank has reported, before /health turns 200."""
        self.channel.connect(self.settings.step_timeout_s, self.settings.control_port)
        self._publish(None)
        self.channel.wait_reported(self.settings.step_timeout_s)

    def stepped(self) -> None:
        self.busy_since = None

    def idle(self) -> None:
        """While idle, what was applied goes out at once, and a ping every ``heartbeat_s``."""
        if self._commands or time.monotonic() - self._last_sent >= self.heartbeat_s:
            self.busy_since = time.monotonic()
            self._publish(None)
            self.busy_since = None

    def stopped(self) -> None:
        """The engine's loop ended (a stop it applied): the other ranks hear it."""
        self._publish(None)
        self.channel.close(wait_s=5.0)  # the ranks close their ends once they have read stop

    def start(self) -> None:
        Watchdog(self, self._engine).start()

    def failure_reason(self, error: BaseException) -> str:
        # A collective raises, rather than blocks until the watchdog ends the job, when a peer's connection breaks.
        lost = f" ({self.channel.lost})" if self.channel.lost else ""
        return (f"{type(error).__name__} on rank 0's engine thread, in a group of {self.channel.size} ranks (a rank "
                f"may have died or lost its connection){lost}; the job ends so that it can be restarted")

    def status(self) -> dict[str, Any]:
        peers = [dict(zip(STATS, rank_stats(self._engine.core), strict=True)), *self.channel.peer_stats()]
        ranks = [{"rank": i, "role": "leader: HTTP, scheduler, sampling" if i == 0 else "follower: runs rank 0's steps",
                  **(peer or {})} for i, peer in enumerate(peers)]
        return {"backend": self.settings.backend, "size": self.channel.size,
                "tensor_parallel": self.settings.tensor_parallel, "host": self.hostname, "ranks": ranks}

    def _publish(self, step: RunStep | None) -> None:
        if self.channel.lost is not None:  # a rank's connection ended: its next collective cannot complete
            raise DistributedFault(self.channel.lost)
        if not self._commands and step is not None and not step.prefill:
            message = DECODE_ONLY  # the ranks' state cannot have changed
        else:
            message = Message(self._commands, step, state_digest(self._engine.core))
        self._commands = []
        self.channel.send(message)
        self._last_sent = time.monotonic()


_LOST_GRACE_S = 1.0


class Watchdog(threading.Thread):
    """Rank 0: a step or message blocked longer than ``step_timeout_s`` (a peer died or hangs inside a
    collective), or for a second once a rank's control connection ended, ends every request with an error and
    the job, through the engine's ``on_failure``."""

    def __init__(self, leader: Leader, engine: BatchedEngine) -> None:
        super().__init__(name="mlxd-watchdog", daemon=True)
        self.leader, self.engine = leader, engine
        self.limit = leader.settings.step_timeout_s

    def run(self) -> None:
        while self.engine.failure is None:
            time.sleep(min(0.25, self.limit / 4))
            since, lost = self.leader.busy_since, self.leader.channel.lost
            # A rank whose connection ended cannot answer the step's collectives: a second is enough to know.
            if since is None or time.monotonic() - since <= (min(self.limit, _LOST_GRACE_S) if lost else self.limit):
                continue
            reason = (f"{lost}; the job ends so that it can be restarted" if lost else
                      f"rank 0 waited more than {self.limit:g} s for the group (a rank died or hangs); the job "
                      "ends so that it can be restarted")
            log.error("distributed_watchdog", reason=reason)
            self.engine.halt(reason, f"the engine has stopped ({reason})")
            return
