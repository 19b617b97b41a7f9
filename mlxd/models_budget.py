"""The memory budget the served models share (``[server] models_memory_bytes``), as plain Python: what a model's load
needs from it (:class:`Room`), and the ledger through which the models' engines admit rows within it
(:class:`KVLedger`, each engine holding a :class:`KVShare`). The registry (:mod:`mlxd.registry`) decides loads and
unloads with these; nothing here loads, unloads or imports MLX."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxd.model_slot import ModelSlot

# A model whose claim the ledger refused claims again at each step of its engine (or every few ms while nothing of it
# runs); one silent this long waits no more (its request ended), and no longer holds the others back.
WAITER_TTL_S = 2.0


@dataclass
class Room:
    """What a load needs from the memory budget and what is held against it."""

    need: int
    held: int
    budget: int

    @property
    def fits(self) -> bool:
        return not self.budget or self.held + self.need <= self.budget


class KVLedger:
    """The models' memory budget as their engines' admission sees it (thread-safe, plain Python): a row starts only
    while the weights of every model that holds memory (loading or ready) and every engine's KV reservations, its
    own included, fit ``budget`` together. Prefix caches are not counted here: they give way to running requests
    (each engine evicts its own; :meth:`mlxd.registry.ModelRegistry.keep_within_budget` the others'). Each engine
    holds a :class:`KVShare` (:class:`mlxd.engine.schedule.scheduler.SharedKV`).

    First come, first served between models: a model whose claim was refused waits, and a claim to grow made by a
    model that started waiting later (or is not waiting) must leave room for what the earlier ones wait for; so a
    busy model whose rows keep ending cannot take the room again and again from a model that waits."""

    def __init__(self, budget: int, slots: list[ModelSlot]) -> None:
        self.budget, self.slots = budget, slots
        self.lock = threading.Lock()  # also held by the registry while it decides that a model may load
        self.reserved: dict[str, int] = {}
        self.waiters: dict[str, Waiter] = {}  # models whose last claim was refused
        self.clock: Callable[[], float] = time.monotonic

    def share(self, name: str) -> KVShare:
        return KVShare(self, name)

    def weight_bytes(self) -> int:
        return sum(s.expected_bytes() for s in self.slots if s.holds_memory)

    def claim(self, name: str, num_bytes: int) -> bool:
        now = self.clock()
        with self.lock:
            self.waiters = {owner: w for owner, w in self.waiters.items() if now - w.seen <= WAITER_TTL_S}
            if num_bytes > self.reserved.get(name, 0):
                waiter = self.waiters.get(name)
                since = waiter.since if waiter is not None else now
                others = sum(n for owner, n in self.reserved.items() if owner != name)
                ahead = sum(max(0, w.num_bytes - self.reserved.get(owner, 0)) for owner, w in self.waiters.items()
                            if owner != name and w.since < since)
                if self.weight_bytes() + others + ahead + num_bytes > self.budget:
                    self.waiters[name] = Waiter(num_bytes, since, now)
                    return False
            self.reserved[name] = num_bytes
            self.waiters.pop(name, None)
            return True

    def settle(self, name: str, num_bytes: int) -> None:
        with self.lock:
            self.reserved[name] = num_bytes

    def forget(self, name: str) -> None:
        """An unloaded model reserves nothing."""
        with self.lock:
            self.reserved.pop(name, None)
            self.waiters.pop(name, None)

    def num_reserved_bytes(self) -> int:
        with self.lock:
            return sum(self.reserved.values())


@dataclass(frozen=True)
class Waiter:
    """A model whose claim was refused: the bytes it claimed in all, since when it waits, when it last claimed."""

    num_bytes: int
    since: float
    seen: float


@dataclass(frozen=True)
class KVShare:
    """One model's side of the :class:`KVLedger` (what its engine's scheduler claims and settles)."""

    ledger: KVLedger
    name: str

    def claim(self, num_bytes: int) -> bool:
        return self.ledger.claim(self.name, num_bytes)

    def settle(self, num_bytes: int) -> None:
        self.ledger.settle(self.name, num_bytes)

    def fits_alone(self, num_bytes: int) -> bool:
        return self.ledger.weight_bytes() + num_bytes <= self.ledger.budget
