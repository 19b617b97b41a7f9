"""The vision tower on a thread of its own, beside the engine thread.

The engine thread hands over the images of requests it has just accepted (:meth:`ImageEncoder.submit`, one job
for the images accepted together) and keeps stepping: rows already decoding do not wait for the tower. The encoder
thread runs each job through the vision tower on its own MLX stream (``encode``: the vision prefill's
:meth:`~mlxd.engine.step.vision.VisionPrefill.encode`, the one tower call, several images in one call where the
family allows it) and gives the evaluated features back through ``deliver``, which puts them in the engine's
inbox. On a GPU the tower's kernels then run while the engine builds its decode steps; on a CPU, on another core.

MLX allows this since 0.31.2: every thread evaluates on its own streams, and an array crosses threads only once it
is evaluated (the model's weights one way, the features the other). Everything else stays on the engine thread:
the feature cache, the scheduler, which request waits for which image (:class:`mlxd.engine.step.vision.VisionPrefill`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxd.log import get_logger
from mlxd.runtime.device import device_stream

log = get_logger("mlxd.engine")

# Per image: its processor inputs (numpy) and how many placeholder tokens its features fill.
Job = dict[str, tuple[dict[str, np.ndarray], int]]


@dataclass(slots=True)
class Encoded:
    """A finished job: features per image digest (evaluated), or the error that stopped the tower call."""

    digests: list[str]
    features: list[Any]
    error: Exception | None = None
    seconds: float = 0.0


class ImageEncoder:
    """Runs vision-tower jobs in order on one thread, each through ``encode`` (the job's features, evaluated); each
    result goes to ``deliver`` (called on that thread)."""

    def __init__(self, encode: Callable[[Job], list[Any]], deliver: Callable[[Encoded], None]) -> None:
        self._encode = encode
        self._deliver = deliver
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mlxd-image-encoder", daemon=True)
        self.num_jobs = 0
        self.num_images = 0
        self.busy_s = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the job under way, drop the rest and end the thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout_s)

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def status(self) -> dict[str, Any]:
        return {"num_jobs": self.num_jobs, "num_images": self.num_images, "busy_s": round(self.busy_s, 3)}

    def _run(self) -> None:
        with device_stream():  # the model's device, with a stream of this thread's own
            while (job := self._jobs.get()) is not None:
                encoded = self.run(job)
                self.num_jobs += 1
                self.num_images += len(job)
                self.busy_s += encoded.seconds
                self._deliver(encoded)

    def run(self, job: Job) -> Encoded:
        """One job through ``encode``; an error is handed back, not raised."""
        start = time.perf_counter()
        digests = list(job)
        try:
            features = self._encode(job)
        except Exception as e:  # noqa: BLE001 - handed to the engine: each request then encodes its own images
            log.warning("image_encode_failed", num_images=len(digests), error_type=type(e).__name__, error=str(e))
            return Encoded(digests, [], e, time.perf_counter() - start)
        return Encoded(digests, features, None, time.perf_counter() - start)
