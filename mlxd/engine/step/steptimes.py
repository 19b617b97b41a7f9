"""Where the engine step's time goes, summed per phase: the breakdown ``/v1/status`` shows (``step_ms``).

``schedule`` (admission, the prefix cache making room, planning), ``prefill`` (prompt chunks: building and running
them), ``decode_build`` (building and dispatching the decode step's graph: Python and MLX work on the engine thread;
for speculative rows, drafting too), ``decode_wait`` (waiting for the device: for a pipelined step, for the
previous step's tokens), ``post_process`` (emitting tokens, finishing rows). A step that waits most of its time is
bound by the device; one that builds most of its time, by the host.
"""

from __future__ import annotations

import time

PHASES = ("schedule", "prefill", "decode_build", "decode_wait", "post_process")


class StepTimes:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        self._mark = 0.0

    def start(self) -> None:
        self._mark = time.perf_counter()
        self.num_steps += 1

    def lap(self, phase: str, waited_s: float = 0.0) -> None:
        """Charge the time since the last mark to ``phase``, less ``waited_s`` (charged to ``decode_wait``)."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._mark - waited_s
        self.seconds["decode_wait"] += waited_s
        self._mark = now

    def status(self) -> dict[str, float]:
        """Milliseconds per step, by phase (means over every step so far)."""
        steps = max(self.num_steps, 1)
        return {phase: round(1000 * seconds / steps, 3) for phase, seconds in self.seconds.items()}
