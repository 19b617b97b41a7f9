"""Python's cycle collector in a serving process: what start-up built is frozen, and the pauses left are measured.

A loaded daemon holds a few hundred thousand long-lived Python objects (modules, the tokenizer, the model's
modules, the web framework). Each full collection walks all of them while holding the interpreter lock, so the
engine thread builds no step meanwhile: 36-42 ms on a 2-core x86-64 CPU with the embedded SmolLM2, and one of
198 ms stalled an H100 serving 16 streams (Qwen3-8B shape; `benchmarks/first_passes.py`). ``gc.freeze()`` once
everything is loaded moves those objects out of the collector's reach; the collector then walks only what serving
allocates. Frozen objects are still freed when their last reference goes; only cycles among them are kept.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any


class GcPauses:
    """Counts the collector's passes and how long they held the process, by generation (one instance a process:
    :data:`PAUSES`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._installed = False
        self._started = 0.0
        self.num_collections = [0, 0, 0]
        self.total_s = 0.0
        self.max_s = 0.0

    def install(self) -> None:
        """Start measuring (once a process; later calls do nothing)."""
        with self._lock:
            if not self._installed:
                gc.callbacks.append(self._on_collect)
                self._installed = True

    def _on_collect(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        self.num_collections[info["generation"]] += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)

    def status(self) -> dict[str, Any]:
        return {"num_collections": list(self.num_collections), "pause_ms_total": round(1000 * self.total_s, 1),
                "pause_ms_max": round(1000 * self.max_s, 1), "num_frozen_objects": gc.get_freeze_count()}


PAUSES = GcPauses()


def freeze_loaded_objects() -> int:
    """Collect once, then freeze every object left (see the module's docstring); returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
