"""The batched engine taking the device's turn (:class:`mlxd.runtime.device_turn.DeviceTurn`) around each step and
its warm-up, for several models on one device (:mod:`mlxd.registry`)."""

from __future__ import annotations

from typing import Any

from mlxd.engine.engine import BatchedEngine
from mlxd.runtime.device_turn import DeviceTurn


class TurnTakingEngine(BatchedEngine):
    """The batched engine, taking the device's turn around each step and around its warm-up (``start`` waits for
    the warm-up on the engine thread; holding the turn meanwhile keeps the other engines' steps off the device)."""

    def __init__(self, model: Any, config: Any, *, turn: DeviceTurn, holder: str, **kwargs: Any) -> None:
        super().__init__(model, config, **kwargs)
        self.turn, self.holder = turn, holder

    def start(self) -> None:
        with self.turn.held(self.holder):
            super().start()

    def step(self) -> None:
        with self.turn.held(self.holder):
            super().step()
