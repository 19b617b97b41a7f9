"""RequestHandle: the event loop's side of a request. Events come in order, silence gives keepalives after
``keepalive_s`` (never while tokens flow), a busy stream costs no timer per token, and a cancelled consumer is
cancelled, not left waiting."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mlxd.engine.base import Finished, RequestHandle, Token


class _Engine:
    def __init__(self) -> None:
        self.cancelled: list[tuple[str, str]] = []

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self.cancelled.append((request_id, reason))


async def _collect(handle: RequestHandle, keepalive_s: float | None) -> list[tuple[float, object]]:
    start, seen = time.monotonic(), []
    async for event in handle.events(keepalive_s):
        seen.append((time.monotonic() - start, event))
    return seen


def _push_from_thread(handle: RequestHandle, schedule: list[tuple[float, object]]) -> threading.Thread:
    """Push each event at its time (seconds from now) from another thread, as the engine thread does."""
    def run() -> None:
        start = time.monotonic()
        for at, event in schedule:
            time.sleep(max(0.0, at - (time.monotonic() - start)))
            RequestHandle.push_all([(handle, event)])

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _finished() -> Finished:
    return Finished(reason="length", num_prompt_tokens=3)


def test_events_come_in_order_and_the_stream_ends_at_finished():
    async def main():
        handle = RequestHandle("r", _Engine(), asyncio.get_running_loop())
        thread = _push_from_thread(handle, [(0.01 * i, Token(i)) for i in range(20)] + [(0.2, _finished())])
        seen = await _collect(handle, 5.0)
        thread.join()
        return handle, [event for _, event in seen]

    handle, events = asyncio.run(main())
    assert events == [Token(i) for i in range(20)] + [_finished()]
    assert handle.done and handle._timer is None


def test_silence_gives_a_keepalive_every_keepalive_s():
    async def main():
        handle = RequestHandle("r", _Engine(), asyncio.get_running_loop())
        thread = _push_from_thread(handle, [(0.0, Token(1)), (0.7, _finished())])
        seen = await _collect(handle, 0.2)
        thread.join()
        return seen

    seen = asyncio.run(main())
    assert [event for _, event in seen][0] == Token(1) and seen[-1][1] == _finished()
    keepalives = [at for at, event in seen if event is None]
    assert 2 <= len(keepalives) <= 3, seen  # at about 0.2, 0.4 and 0.6 s
    gaps = [b - a for a, b in zip([0.0, *keepalives], keepalives, strict=False)]
    assert all(0.18 <= gap <= 0.3 for gap in gaps), seen


def test_a_busy_stream_gets_no_keepalive_and_no_timer_per_token():
    async def main():
        loop = asyncio.get_running_loop()
        timers = []
        call_at = loop.call_at

        def counting_call_at(when, callback, *args, **kwargs):
            timers.append(when)
            return call_at(when, callback, *args, **kwargs)

        loop.call_at = counting_call_at  # every timer, call_later's included, goes through call_at
        handle = RequestHandle("r", _Engine(), loop)
        schedule = [(0.02 * i, Token(i)) for i in range(50)] + [(1.0, _finished())]
        thread = _push_from_thread(handle, schedule)
        seen = await _collect(handle, 0.25)
        thread.join()
        return seen, timers

    seen, timers = asyncio.run(main())
    assert [event for _, event in seen] == [Token(i) for i in range(50)] + [_finished()]
    assert len(timers) <= 8, timers  # about one per 0.25 s over 1 s of tokens, not one per token (50)


def test_the_keepalive_counts_from_the_start_of_the_wait_not_from_the_first_token():
    async def main():
        handle = RequestHandle("r", _Engine(), asyncio.get_running_loop())
        tokens = [(0.03 * i, Token(i)) for i in range(10)]  # tokens until 0.27 s, then silence
        thread = _push_from_thread(handle, [*tokens, (0.7, _finished())])
        seen = await _collect(handle, 0.2)
        thread.join()
        return seen

    seen = asyncio.run(main())
    last_token = max(at for at, event in seen if isinstance(event, Token))
    keepalives = [at for at, event in seen if event is None]
    assert keepalives, seen
    assert keepalives[0] >= last_token + 0.2 - 0.02, seen


def test_a_cancelled_consumer_is_cancelled_and_its_timer_goes():
    async def main():
        handle = RequestHandle("r", _Engine(), asyncio.get_running_loop())
        consumer = asyncio.ensure_future(_collect(handle, 0.3))
        await asyncio.sleep(0.05)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        return handle

    handle = asyncio.run(main())
    assert handle._timer is None and handle._waiter is None
