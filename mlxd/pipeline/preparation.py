"""The threads that prepare requests, apart from everything else that runs on threads.

A request's preparation (the stages' ``prepare``: rendering the chat template, tokenizing, decoding images) is
blocking work of a size the client chooses. It runs here, on ``[server] prepare_workers`` threads of its own, never
on the event loop's default executor: whatever clients send, the loop's own threads (and so ``/health``,
``/metrics``, ``/v1/status``) are never taken. Requests waiting for a worker or in one are counted
(:attr:`Preparation.num_preparing`): the daemon turns newcomers away beyond its bound and waits for them when it
drains.

The workers are daemon threads and :meth:`Preparation.close` does not join them: a worker stuck in a single long
call (one tokenizer call, one image decode) cannot keep the process from exiting. Each task runs in the submitting
request's context (its log bindings) with the request's :class:`~mlxd.runtime.cancel.CancelFlag` current, so the
work stops at its next check once the client has left.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mlxd.runtime.cancel import CancelFlag, Cancelled, cancel_scope

# Weight of the newest preparation time in the running mean (for ``Retry-After``).
_MEAN_WEIGHT = 0.2


class Preparation:
    """A fixed pool of ``num_workers`` daemon threads, started on first use, and the count of tasks not finished."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        # Each unfinished task's flag → the loop and future of the request waiting for it.
        self._tasks: dict[CancelFlag, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._closed = False
        self.mean_s: float | None = None

    @property
    def num_preparing(self) -> int:
        """Tasks submitted and not finished: waiting for a worker or running on one."""
        with self._lock:
            return len(self._tasks)

    def estimate_s(self) -> float:
        """Seconds until a newcomer would start: the tasks ahead of it over the workers, times the mean task."""
        return self.num_preparing / self.num_workers * (self.mean_s or 1.0)

    def submit(self, fn: Callable[..., Any], *args: Any, flag: CancelFlag) -> asyncio.Future:
        """Run ``fn(*args)`` on a worker, in the caller's context, with ``flag`` as the current cancel flag; the
        future gets its result or exception. Call from the event loop. A task whose flag is set before a worker
        takes it is not run (it raises :class:`~mlxd.runtime.cancel.Cancelled`)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the preparation workers are closed")
            self._tasks[flag] = (loop, future)
            if len(self._threads) < self.num_workers:
                thread = threading.Thread(target=self._work, name=f"mlxd-prepare-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        self._queue.put((loop, future, contextvars.copy_context(), fn, args, flag))
        return future

    def cancel_all(self, reason: str, status: int = 503) -> int:
        """Set the flag of every unfinished task and answer its request with
        :class:`~mlxd.runtime.cancel.Cancelled` at once, without waiting for a worker that may be stuck in a call
        that never checks (it stays counted until it returns); returns how many."""
        with self._lock:
            tasks = list(self._tasks.items())
        for flag, (loop, future) in tasks:
            flag.set(reason, status)
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(_settle, future, (False, Cancelled(flag.reason, status=flag.status)))
        return len(tasks)

    def close(self) -> None:
        """Cancel what is left and let the workers end; never waits for one (see the module docstring)."""
        with self._lock:
            self._closed = True
            num_threads = len(self._threads)
        self.cancel_all("the server is shutting down; retry shortly")
        for _ in range(num_threads):
            self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            loop, future, context, fn, args, flag = item
            started = time.monotonic()
            try:
                outcome = (True, context.run(_scoped, flag, fn, args))
            except BaseException as e:  # noqa: BLE001 - handed to the request waiting for it, which raises it
                outcome = (False, e)
            with self._lock:
                self._tasks.pop(flag, None)
                seconds = time.monotonic() - started
                self.mean_s = seconds if self.mean_s is None else (
                    (1 - _MEAN_WEIGHT) * self.mean_s + _MEAN_WEIGHT * seconds)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, outcome)
            # A worker waiting for its next task must not keep its last one alive: ``fn`` is a pipeline's bound
            # ``prepare``, which holds that model's engine and weights (an unloaded model would never be freed).
            del item, loop, future, context, fn, args, flag, outcome


def _scoped(flag: CancelFlag, fn: Callable[..., Any], args: tuple) -> Any:
    flag.check()
    with cancel_scope(flag):
        return fn(*args)


def _settle(future: asyncio.Future, outcome: tuple[bool, Any]) -> None:
    if future.done():  # cancelled, or answered already by cancel_all
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
