"""The engine thread's loop: apply pending commands → plan the step (the scheduler's plan, itself a command) → run
it → post-process (emit tokens, finish requests, free their rows).

The event loop only puts commands in the inbox (accept, cancel, clear, end all, stop: :mod:`mlxd.engine.commands`);
the engine thread takes them between steps and applies them (:meth:`mlxd.engine.core.EngineCore.apply`), so a
cancelled request leaves the batch within one prompt chunk or one decode step. A distributed leader records every
command applied and sends them to the other ranks before each step (:mod:`mlxd.engine.distributed`). Starting and
stopping the thread, and what happens when it ends on an error, is the engine's (:mod:`mlxd.engine.engine`).
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxd.engine.commands import Accept, Command, ImagesEncoded, Stop
from mlxd.engine.core import EngineCore

if TYPE_CHECKING:
    from mlxd.engine.distributed.leader import Leader

Reply = tuple[asyncio.AbstractEventLoop, asyncio.Future]  # where a command's result goes (clear_prefix_cache)

# A burst on an idle engine is gathered for at most this many times [engine] gather_ms, and this many while requests
# are still being prepared (rendered and tokenized on the preparation workers: 64 requests arrive over some 50-80 ms
# on an H200's host, and a first pass of the few that came first would hold the rest back for its whole length).
GATHER_TIMES = 10
GATHER_PREPARING_TIMES = 50

# While the head of its queue waits for room that other models' rows hold (a shared budget) and nothing of its own
# runs, the engine looks again this often, taking commands in between.
SHARED_ROOM_POLL_S = 0.01


class EngineLoop:
    """What the engine thread runs over ``core``: its warm-up, then commands and steps until a command says stop.

    ``held`` is held around each step (the device's turn when several models share it); ``leader``, rank 0's in a
    distributed group, sends what is applied and wakes the idle loop every heartbeat."""

    def __init__(self, core: EngineCore, *, held: Callable[[], AbstractContextManager[Any]],
                 leader: Leader | None = None) -> None:
        self.core, self.held, self.leader = core, held, leader
        self._inbox: queue.SimpleQueue[tuple[Command | ImagesEncoded, Reply | None]] = queue.SimpleQueue()
        # Requests on their way to this engine (being prepared), read while a burst is gathered; the model's slot
        # sets it.
        self.incoming: Callable[[], int] = lambda: 0

    def put(self, command: Command | ImagesEncoded, reply: Reply | None = None) -> None:
        """Queue ``command`` for the engine thread (thread-safe); ``reply`` gets what applying it returns."""
        self._inbox.put((command, reply))

    def warm_up(self) -> None:
        """The core's warm-up; a leader's ranks are all up and warm after it, before /health turns 200."""
        self.core.warm_up()
        if self.leader is not None:
            self.leader.ready()

    def serve(self) -> None:
        """Apply commands and step until a command says stop; what the requests got is sent out after each turn."""
        scheduler, core = self.core.scheduler, self.core
        try:
            # Blocking on the inbox only while idle, the queue-wait check runs every iteration it matters in.
            wait_s = None
            while self._apply_inbox(block=not scheduler.has_work, wait_s=wait_s):
                core.expire_waiting()
                wait_s = self._shared_wait_s()
                if scheduler.has_work and wait_s is None:
                    self.step()
                else:
                    self._idle()
                core.table.send()
        finally:
            core.table.send(flush=True)

    def step(self) -> None:
        """One engine step: plan (the scheduler) → run the plan → post-process (each phase timed)."""
        with self.held():
            self.core.step_times.start()
            plan = self.core.plan()
            self.core.step_times.lap("schedule")
            self.core.apply(plan)
        if self.leader is not None:
            self.leader.stepped()

    def _shared_wait_s(self) -> float | None:
        """:data:`SHARED_ROOM_POLL_S` while nothing of this engine runs and its head waits for room in a budget
        shared with other models (else None): the loop waits for commands that long instead of stepping in vain."""
        scheduler, head = self.core.scheduler, self.core.scheduler.head
        if scheduler.shared is None or scheduler.running or head is None:
            return None
        return None if scheduler.shared.claim(scheduler.num_reserved_bytes_with(head)) else SHARED_ROOM_POLL_S

    def _apply_inbox(self, block: bool, wait_s: float | None = None) -> bool:
        """Apply queued commands; return False once one said stop. Blocks for at most the leader's heartbeat (else
        until a command comes) when ``block``, for at most ``wait_s`` when that is given.

        A request that wakes the idle engine waits for the requests arriving with it: commands are taken until
        none has come for ``gather_ms`` and none is being prepared (:attr:`incoming`), at most
        :data:`GATHER_TIMES` (:data:`GATHER_PREPARING_TIMES` while some are) times ``gather_ms`` in all, so that a
        burst of requests starts in one prompt pass instead of the first few alone and the rest after that pass."""
        gather_s = self.core.config.gather_ms / 1000
        idle_wait_s = self.leader.heartbeat_s if self.leader is not None else None
        if wait_s is not None:
            block, idle_wait_s = True, wait_s
        started = None  # when gathering began
        while True:
            try:
                command, reply = self._inbox.get(block=block or started is not None,
                                                 timeout=idle_wait_s if block else self._gather_wait_s(started,
                                                                                                        gather_s))
            except queue.Empty:
                if started is not None and self._gathering_more(started, gather_s):
                    continue
                if self.core.runner.vision is not None:
                    self.core.runner.vision.flush()  # the images of the requests just taken on, as one job
                return True
            if block and isinstance(command, Accept) and gather_s > 0:
                started = time.monotonic()
            block = False
            if isinstance(command, Accept) and not self.core.table.is_pending(command.spec.request_id):
                continue  # ended before it got here (abort_all)
            result = self.core.apply(command)
            if reply is not None:
                loop, future = reply
                loop.call_soon_threadsafe(future.set_result, result)
            if isinstance(command, Stop):
                return False

    def _gather_wait_s(self, started: float | None, gather_s: float) -> float | None:
        """How long to wait for the next command while gathering a burst (None when not gathering)."""
        if started is None:
            return None
        times = GATHER_PREPARING_TIMES if self.incoming() else GATHER_TIMES
        return max(0.0, min(gather_s, started + times * gather_s - time.monotonic()))

    def _gathering_more(self, started: float, gather_s: float) -> bool:
        """Whether to go on gathering after ``gather_s`` without a command: requests are still being prepared
        and the gathering has not reached :data:`GATHER_PREPARING_TIMES` times ``gather_s``."""
        return bool(self.incoming()) and time.monotonic() < started + GATHER_PREPARING_TIMES * gather_s

    def _idle(self) -> None:
        if self.leader is not None:
            self.leader.idle()
        mx.clear_cache()  # idle: give the freed buffers back


