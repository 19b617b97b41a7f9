"""The device's turn (mlxd/runtime/device_turn.py): one holder at a time, first come first served, so two busy
engines alternate step by step and neither waits more than one of the other's steps."""

from __future__ import annotations

import threading
import time

from mlxd.runtime.device_turn import DeviceTurn


def test_two_busy_holders_alternate_and_never_overlap():
    turn = DeviceTurn()
    order: list[str] = []
    inside = []
    overlaps = []
    started = threading.Barrier(2)

    def engine(name: str) -> None:
        started.wait()
        for _ in range(40):
            with turn.held(name):
                inside.append(name)
                overlaps.append(len(inside))
                order.append(name)
                time.sleep(0.001)  # a step's device work
                inside.remove(name)

    threads = [threading.Thread(target=engine, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert max(overlaps) == 1  # never two holders at once
    assert sorted(order) == ["a"] * 40 + ["b"] * 40
    # While both want the turn (from the second holder's first turn to the first holder's last), they alternate.
    first_a, first_b = order.index("a"), order.index("b")
    start = max(first_a, first_b)
    end = min(len(order) - 1 - order[::-1].index("a"), len(order) - 1 - order[::-1].index("b"))
    both = order[start:end + 1]
    assert all(x != y for x, y in zip(both, both[1:], strict=False)), order
    assert len(both) >= 70


def test_a_burst_of_one_holder_waits_behind_a_waiting_other():
    turn = DeviceTurn()
    order: list[str] = []
    turn.on_turn = order.append
    turn.take("a")
    waiting = threading.Thread(target=lambda: (turn.take("b"), turn.give()))
    waiting.start()
    while turn.num_asked < 2:  # b has asked
        time.sleep(0.001)
    turn.give()
    turn.take("a")  # a asks again at once: b, who asked first, runs first
    turn.give()
    waiting.join(5)
    assert order == ["a", "b", "a"]
