"""A rank other than 0 of a tensor-parallel group: no HTTP, no scheduler decisions; it applies rank 0's commands
through the same :meth:`~mlxd.engine.core.EngineCore.apply` and runs its steps (see :mod:`mlxd.engine.distributed`)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from mlxd.config.schema import DistributedConfig, EngineConfig
from mlxd.engine.commands import Stop
from mlxd.engine.core import EngineCore
from mlxd.engine.distributed.channel import Channel
from mlxd.engine.distributed.leader import rank_stats, state_digest
from mlxd.engine.step.sampling import make_request_sampler
from mlxd.errors import DistributedFault
from mlxd.log import get_logger
from mlxd.runtime.device import device_stream

log = get_logger("mlxd.distributed")


# A rank's counters go to rank 0 when a message carries no step (the idle pings among them), and every this many
# steps while it is busy: a few bytes on the host, not a collective.
REPORT_EVERY_STEPS = 256


class Follower:
    """Serves rank 0: warms up, then applies each message's commands and runs its step.

    It waits on the host for rank 0's next message, never on the device for it: the message of step n+1 arrives
    (and its work is queued) while step n still runs."""

    def __init__(self, model: Any, config: EngineConfig, *, channel: Channel, settings: DistributedConfig) -> None:
        self.core = EngineCore(model, config, make_sampler=make_request_sampler, channel=channel, follower=True)
        self.channel, self.settings = channel, settings
        self.last_heard = time.monotonic()

    def run(self) -> int:
        """Serve rank 0 until it says stop (0); raises when the group breaks or the ranks disagree."""
        core, channel = self.core, self.channel
        with device_stream():  # the device the shard was loaded on, a stream of this thread's own
            core.warm_up()
            channel.connect(self.settings.step_timeout_s)
            channel.report(rank_stats(core))
            log.info("follower_ready", rank=channel.rank, size=channel.size)
            self.last_heard = time.monotonic()
            threading.Thread(target=self._watch, name="mlxd-follower-watchdog", daemon=True).start()
            try:
                return self._serve()
            finally:
                channel.close()

    def _serve(self) -> int:
        core, channel, num_steps = self.core, self.channel, 0
        while True:
            message = channel.receive()
            self.last_heard = time.monotonic()
            for command in message.commands:
                core.apply(command)
                if isinstance(command, Stop):
                    return 0
            if message.digest and state_digest(core) != tuple(message.digest):
                raise DistributedFault(f"rank {channel.rank} differs from rank 0: {state_digest(core)} "
                                       f"against {tuple(message.digest)}")
            if message.step is None:
                channel.report(rank_stats(core))
                continue
            core.apply(message.step)
            num_steps += 1
            if num_steps % REPORT_EVERY_STEPS == 0:
                channel.report(rank_stats(core))

    def _watch(self) -> None:
        limit = self.settings.step_timeout_s + 3 * self.settings.heartbeat_s
        while True:
            time.sleep(1.0)
            if time.monotonic() - self.last_heard > limit:
                log.error("distributed_watchdog", rank=self.channel.rank,
                          reason=f"nothing from rank 0 for {limit:g} s; exiting")
                os._exit(1)
