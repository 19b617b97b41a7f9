"""The process's heap while serving: Python's cycle collector (what start-up built is frozen, and the pauses left
are measured) and glibc's free memory, given back after request bursts (:class:`HeapTrimmer`).

A loaded daemon holds a few hundred thousand long-lived Python objects (modules, the tokenizer, the model's
modules, the web framework). Each full collection walks all of them while holding the interpreter lock, so the
engine thread builds no step meanwhile: 36-42 ms on a 2-core x86-64 CPU with the embedded SmolLM2, and one of
198 ms stalled an H100 serving 16 streams (Qwen3-8B shape; `benchmarks/first_passes.py`). ``gc.freeze()`` once
everything is loaded moves those objects out of the collector's reach; the collector then walks only what serving
allocates. Frozen objects are still freed when their last reference goes; only cycles among them are kept.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.log import get_logger

log = get_logger("mlxd.heap")


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
        # How many objects start-up froze (:func:`freeze_loaded_objects`). Counted then, not per status: Python
        # counts frozen objects by walking them all, holding the interpreter lock (a /v1/status call took 15.6 ms
        # with the embedded model's 141,000 frozen objects on a 2-core x86-64 CPU, 0.8 ms without the walk), and
        # the status page asks every second.
        self.num_frozen_objects: int | None = None

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
                "pause_ms_max": round(1000 * self.max_s, 1), "num_frozen_objects": self.num_frozen_objects}


PAUSES = GcPauses()


def freeze_loaded_objects(pauses: GcPauses = PAUSES) -> int:
    """Collect once, then freeze every object left (see the module's docstring); returns how many are frozen, which
    ``pauses`` reports from then on."""
    gc.collect()
    gc.freeze()
    pauses.num_frozen_objects = gc.get_freeze_count()
    return pauses.num_frozen_objects


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc_function(name: str, argtypes: list, restype: Any) -> Callable | None:
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


_MALLOC_TRIM = _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)  # glibc; not macOS or musl
_MALLINFO2 = _libc_function("mallinfo2", [], _Mallinfo2)  # glibc 2.33 and later


def free_heap_bytes() -> int | None:
    """Bytes glibc holds free in its heaps, every arena together (``mallinfo2``), or ``None`` where unknown."""
    return None if _MALLINFO2 is None else _MALLINFO2().fordblks


def rss_bytes() -> int | None:
    """This process's resident set size, or ``None`` where ``/proc`` is missing."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """Gives memory that requests freed back to the system, on glibc.

    glibc keeps freed memory inside its heaps for reuse: after six concurrent 9 MB chat bodies (each decoded,
    rendered and tokenized into millions of small objects, then refused for their length) the daemon stayed at
    5.9 GB, from 152 MB before and 10.6 GB at the peak; ``malloc_trim(0)`` gives the free pages of every heap back.
    It walks the heaps holding their locks (1.1 s for 4 GB), so it runs on a thread of its own, ``delay_s`` after a
    request ends (the requests of one burst are trimmed together), at most once per ``min_interval_s``, and only
    when the resident size or the free memory in glibc's heaps (``mallinfo2``, where there is one) grew by
    ``min_growth_bytes`` since the last trim: the free memory still counts the pages a trim gave back, so it alone
    would trim every time, and the resident size alone misses memory freed after a trim in the middle of a burst.
    """

    def __init__(self, *, delay_s: float = 1.0, min_interval_s: float = 5.0, min_growth_bytes: int = 64 << 20,
                 trim: Callable[[int], int] | None = _MALLOC_TRIM,
                 free_bytes: Callable[[], int | None] = free_heap_bytes) -> None:
        self.delay_s = delay_s
        self.min_interval_s = min_interval_s
        self.min_growth_bytes = min_growth_bytes
        self._trim = trim
        self._free_bytes = free_bytes
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._last = -min_interval_s
        self._rss_floor = rss_bytes() or 0
        self._free_floor = free_bytes() or 0
        self.num_trims = 0

    def start(self) -> None:
        """Start the trimming thread (does nothing where there is no ``malloc_trim``)."""
        if self._trim is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxd-heap-trim", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def request_ended(self) -> None:
        """Any thread, cheap: a request ended; trim soon if the heap grew."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            if self._stopped:
                return
            time.sleep(max(self.delay_s, self._last + self.min_interval_s - time.monotonic()))
            self._wake.clear()
            given_back = self.trim_if_grown()
            if given_back is not None and given_back >= self.min_growth_bytes:
                self._wake.set()  # a burst may still be freeing what it held: look again after the interval

    def trim_if_grown(self) -> int | None:
        """Trim now if the resident size, or the free memory glibc holds, grew by ``min_growth_bytes`` since the
        last trim (or since the lowest seen after it); the bytes given back, or ``None`` when it did not trim."""
        rss, free = rss_bytes(), self._free_bytes()
        if self._trim is None or rss is None:
            return None
        self._rss_floor = min(self._rss_floor, rss)
        self._free_floor = min(self._free_floor, free if free is not None else self._free_floor)
        freed = free is not None and free - self._free_floor >= self.min_growth_bytes
        if rss - self._rss_floor < self.min_growth_bytes and not freed:
            return None
        started = time.monotonic()
        self._trim(0)
        self._last = time.monotonic()
        after = rss_bytes() or rss
        self._rss_floor, self._free_floor = after, self._free_bytes() or 0
        self.num_trims += 1
        log.info("heap_trimmed", rss_before_mb=rss >> 20, rss_after_mb=after >> 20,
                 trim_ms=round(1000 * (self._last - started), 1))
        return rss - after
