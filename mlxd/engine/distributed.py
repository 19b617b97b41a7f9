"""One model over a tensor-parallel group (``mlx.core.distributed``): rank 0 plans, every rank runs the plan.

Every rank holds a shard of each layer (mlx-lm's ``model.shard(group)``) and must run the same forward passes in
the same order: each pass sums partial results across the group. Rank 0 (:class:`LeaderEngine`) serves HTTP and
runs the scheduler; before each step it broadcasts what changed and what to run (:class:`Message`):

- commands, in the order rank 0 applied them: requests accepted (``Submit``, the request without its callables),
  snapshots kept for later turns (``Keep``), requests let go (``Drop``: finished, cancelled, timed out), the
  prefix cache cleared or shrunk (``Clear``, ``Shrink``: evictions are decided on rank 0), ``EndAll``, ``Stop``;
- the step: which prompt chunks run (and which whole prompts share a pass); every rank then runs its decode step.

The other ranks (:class:`FollowerEngine`) apply the commands and run the step with the same engine code, so their
rows, caches and prefix caches stay identical to rank 0's, shard for shard; a digest of that state travels with
each message and a follower that differs stops. Tokens are sampled on rank 0 and shared inside the step's graph
(:meth:`Channel.share_tokens`), so nothing sampled elsewhere is ever fed. Messages go over the group's own
collectives (:mod:`mlxd.engine.group`): no transport of our own.

Failure: a step that fails on one rank cannot be known to have failed on the others, so any error inside a step
ends the job (the process exits non-zero; launchd or systemd restarts it), except requests refused by checks
every rank makes alike. A peer that dies can leave rank 0 blocked inside a collective: :class:`Watchdog` ends
every request with an error after ``step_timeout_s`` and calls the engine's ``on_failure``. A follower that hears
nothing for longer than that (rank 0 pings while idle) exits non-zero too.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlxd.config.schema import DistributedConfig, EngineConfig
from mlxd.engine.batched import BatchedEngine
from mlxd.engine.front import Submitted
from mlxd.engine.group import (
    DECODE_ONLY,
    Channel,
    Clear,
    Command,
    Drop,
    EndAll,
    Keep,
    Message,
    RequestSpec,
    Shrink,
    Step,
    Stop,
    Submit,
)
from mlxd.engine.schedule.scheduler import SequenceState, StepPlan
from mlxd.engine.step.batch import DecodeBatch
from mlxd.engine.step.row import Refused
from mlxd.errors import DistributedFault
from mlxd.log import get_logger

log = get_logger("mlxd.distributed")


def rank_stats(engine: BatchedEngine) -> list[int]:
    """This rank's numbers for /v1/status, in the order of :data:`mlxd.engine.group.STATS`."""
    prefix = engine.reuse.stats()
    kib = 1024
    return [os.getpid(), mx.get_active_memory() // kib, mx.get_peak_memory() // kib, mx.get_cache_memory() // kib,
            prefix.get("num_entries", 0), prefix.get("num_bytes", 0) // kib, prefix.get("num_hits", 0)]


def state_digest(engine: BatchedEngine) -> tuple[int, ...]:
    """What must be equal on every rank between steps: rows, requests, prefix-cache entries and bytes."""
    return (len(engine.batch), len(engine._requests), len(engine._prefilling), engine.reuse.num_bytes,
            engine.reuse.stats().get("num_entries", 0))


class GroupEngine(BatchedEngine):
    """What every rank's engine does alike: tokens shared from rank 0, no retry a peer could not follow, and a
    failure inside a step ends the job (except refusals every rank makes alike)."""

    _retry_groups = False
    _encode_beside = False  # every rank encodes a step's images in that step

    def __init__(self, model: Any, config: EngineConfig, *, channel: Channel, settings: DistributedConfig,
                 **kwargs: Any) -> None:
        super().__init__(model, config, **kwargs)
        self.channel, self.settings = channel, settings
        self.batch = DecodeBatch(model, share=channel.share_tokens)

    def _fail(self, request_id: str, phase: str, error: Exception) -> None:
        if not isinstance(error, Refused):  # only this rank saw it: the ranks may now disagree
            raise DistributedFault(f"rank {self.channel.rank}: a request failed in the {phase} phase "
                                   f"({type(error).__name__}: {error}); the other ranks cannot follow") from error
        super()._fail(request_id, phase, error)


# ---- rank 0 ----

class LeaderEngine(GroupEngine):
    """The batching engine on rank 0: plans as usual, and broadcasts each step (see the module docstring)."""

    def __init__(self, model: Any, config: EngineConfig, *, channel: Channel, settings: DistributedConfig,
                 **kwargs: Any) -> None:
        super().__init__(model, config, channel=channel, settings=settings, **kwargs)
        self._idle_wait_s = settings.heartbeat_s
        self._commands: list[Command] = []
        self._last_sent = time.monotonic()
        self.peers: list[dict[str, int]] = []
        self.busy_since: float | None = None  # when the current step or message started (the watchdog reads it)
        self.hostname = socket.gethostname()

    def start(self) -> None:
        super().start()
        Watchdog(self).start()

    def stop(self) -> None:
        if self.failure is not None:
            return  # the engine thread may be blocked inside a collective for good: do not wait for it
        super().stop()

    def _warm_up(self) -> None:
        super()._warm_up()
        self._publish(None)  # every rank is up and warm before /health turns 200; their numbers are in

    def _failure_reason(self, error: BaseException) -> str:
        # A collective raises, rather than blocks until the watchdog ends the job, when a peer's connection breaks.
        return (f"{type(error).__name__} on rank 0's engine thread, in a group of {self.channel.size} ranks (a rank "
                "may have died or lost its connection); the job ends so that it can be restarted")

    def _publish(self, step: Step | None) -> None:
        if not self._commands and step is not None and not step.prefill:
            message = DECODE_ONLY  # one small collective: the ranks' state cannot have changed
        else:
            message = Message(self._commands, step, state_digest(self))
        self._commands = []
        _, self.peers = self.channel.exchange(message, rank_stats(self))
        self._last_sent = time.monotonic()

    def _serve(self) -> None:
        super()._serve()
        if self._startup_error is None and self.failure is None:
            self._commands.append(Stop())
            self._publish(None)

    def _idle(self) -> None:
        if self._commands or time.monotonic() - self._last_sent >= self.settings.heartbeat_s:
            self.busy_since = time.monotonic()
            self._publish(None)
            self.busy_since = None
        super()._idle()

    def step(self) -> None:
        self.busy_since = time.monotonic()
        super().step()
        self.busy_since = None

    def _plan_step(self) -> tuple[StepPlan, list[list[SequenceState]]]:
        plan, groups = super()._plan_step()
        self._publish(Step([(state.request_id, n) for state, n in plan.prefill],
                           [[state.request_id for state in group] for group in groups]))
        return plan, groups

    def _make_room(self) -> int | None:
        shrunk = super()._make_room()
        if shrunk is not None:
            self._commands.append(Shrink(shrunk))
        return shrunk

    def _accept(self, submitted: Submitted) -> None:
        with self._lock:
            known = submitted.request.request_id in self._pending
        if known:
            self._commands.append(Submit(RequestSpec.of(submitted.request)))
        super()._accept(submitted)

    def _keep_decoded(self, request_id: str) -> None:
        if request_id in self._requests:
            self._commands.append(Keep(request_id))
        super()._keep_decoded(request_id)

    def _release(self, request_id: str) -> Submitted | None:
        if request_id in self._requests:
            self._commands.append(Drop(request_id))
        return super()._release(request_id)

    def _clear_prefix_cache(self) -> dict[str, Any]:
        self._commands.append(Clear())
        return super()._clear_prefix_cache()

    def _end_all(self, message: str) -> None:
        self._commands.append(EndAll())
        super()._end_all(message)

    def status(self) -> dict[str, Any]:
        status = super().status()
        status["distributed"] = group_status(self)
        return status


def group_status(engine: LeaderEngine) -> dict[str, Any]:
    ranks = [{"rank": i, "role": "leader: HTTP, scheduler, sampling" if i == 0 else "follower: runs rank 0's steps",
              **peer} for i, peer in enumerate(engine.peers)]
    return {"backend": engine.settings.backend, "size": engine.channel.size,
            "tensor_parallel": engine.settings.tensor_parallel, "host": engine.hostname, "ranks": ranks}


class Watchdog(threading.Thread):
    """Rank 0: a step or message blocked longer than ``step_timeout_s`` (a peer died or hangs inside a
    collective) ends every request with an error and the job, through the engine's ``on_failure``."""

    def __init__(self, engine: LeaderEngine) -> None:
        super().__init__(name="mlxd-watchdog", daemon=True)
        self.engine = engine
        self.limit = engine.settings.step_timeout_s

    def run(self) -> None:
        engine = self.engine
        while engine.failure is None:
            time.sleep(min(1.0, self.limit / 4))
            since = engine.busy_since
            if since is None or time.monotonic() - since <= self.limit:
                continue
            reason = (f"rank 0 waited more than {self.limit:g} s for the group (a rank died or hangs); the job "
                      "ends so that it can be restarted")
            log.error("distributed_watchdog", reason=reason)
            with engine._lock:
                engine.failure = reason
            engine._end_all(f"the engine has stopped ({reason})")
            engine._send()
            if engine.on_failure is not None:
                engine.on_failure(reason)
            return


# ---- the other ranks ----

class FollowerEngine(GroupEngine):
    """A rank other than 0: no HTTP, no scheduler decisions; applies rank 0's messages and runs its steps."""

    def __init__(self, model: Any, config: EngineConfig, *, channel: Channel, settings: DistributedConfig) -> None:
        super().__init__(model, config, channel=channel, settings=settings)
        self.last_heard = time.monotonic()

    def run(self) -> int:
        """Serve rank 0 until it says stop (0); raises when the group breaks or the ranks disagree."""
        with mx.stream(generation_stream):
            self._warm_up()
            log.info("follower_ready", rank=self.channel.rank, size=self.channel.size)
            threading.Thread(target=self._watch, name="mlxd-follower-watchdog", daemon=True).start()
            while True:
                message, _ = self.channel.exchange(None, rank_stats(self))
                self.last_heard = time.monotonic()
                if message is None:
                    continue
                if not self._apply(message.commands):
                    return 0
                if message.digest and state_digest(self) != tuple(message.digest):
                    raise DistributedFault(f"rank {self.channel.rank} differs from rank 0: {state_digest(self)} "
                                           f"against {tuple(message.digest)}")
                if message.step is not None:
                    self._run_plan(*self._plan(message.step))

    def _watch(self) -> None:
        limit = self.settings.step_timeout_s + 3 * self.settings.heartbeat_s
        while True:
            time.sleep(1.0)
            if time.monotonic() - self.last_heard > limit:
                log.error("distributed_watchdog", rank=self.channel.rank,
                          reason=f"nothing from rank 0 for {limit:g} s; exiting")
                os._exit(1)

    def _apply(self, commands: list[Command]) -> bool:
        for command in commands:
            if isinstance(command, Submit):
                request = command.spec.request()
                submitted = Submitted(request, None, SequenceState.for_request(request))  # type: ignore[arg-type]
                self._pending[request.request_id] = submitted
                self._accept(submitted)
            elif isinstance(command, Keep):
                self._keep_decoded(command.request_id)
            elif isinstance(command, Drop):
                self.batch.remove({command.request_id})
                self._release(command.request_id)
            elif isinstance(command, Clear):
                self.reuse.clear()
            elif isinstance(command, Shrink):
                self.reuse.shrink(command.num_bytes)
            elif isinstance(command, EndAll):
                self._end_all("")
            elif isinstance(command, Stop):
                return False
        return True

    def _plan(self, step: Step) -> tuple[StepPlan, list[list[SequenceState]]]:
        states = {request_id: self._requests[request_id].state for request_id, _ in step.prefill}
        plan = StepPlan([(states[request_id], n) for request_id, n in step.prefill], [])
        return plan, [[states[request_id] for request_id in group] for group in step.together]

    def _post_process(self, tokens: list[list[int]]) -> None:
        """Record what each row fed (rank 0 decides which rows end, and says so in its next message)."""
        for row, emitted in zip(self.batch.rows, tokens, strict=True):
            self._requests[row.request_id].generated.extend(emitted)

    def _post(self, submitted: Submitted, event: Any) -> None:
        pass  # nobody listens here: rank 0 answers the clients

    def _send(self) -> None:
        pass
