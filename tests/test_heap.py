"""What ``/v1/status`` reports of Python's collector costs no walk of the objects start-up froze: Python counts
frozen objects by walking them all under the interpreter lock, which stalls the engine thread while the status page
polls every second."""

from __future__ import annotations

import gc

from mlxd.runtime.heap import GcPauses, freeze_loaded_objects


def test_status_reports_the_frozen_count_taken_at_freezing_without_counting_again(monkeypatch):
    pauses = GcPauses()
    assert pauses.status()["num_frozen_objects"] is None  # nothing frozen: nothing to report
    try:
        frozen = freeze_loaded_objects(pauses)
        assert frozen == gc.get_freeze_count() > 1000  # this test process's modules at least
    finally:
        gc.unfreeze()

    def walk() -> int:
        raise AssertionError("status counted the frozen objects again")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    assert pauses.status()["num_frozen_objects"] == frozen


def test_the_daemons_freeze_sets_the_count_that_the_status_endpoint_reports(monkeypatch):
    from mlxd.runtime.heap import PAUSES

    monkeypatch.setattr(PAUSES, "num_frozen_objects", None)  # restored after the test
    monkeypatch.setattr(gc, "collect", lambda: 0)
    monkeypatch.setattr(gc, "freeze", lambda: None)
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 1234)
    assert freeze_loaded_objects() == 1234 and PAUSES.status()["num_frozen_objects"] == 1234
