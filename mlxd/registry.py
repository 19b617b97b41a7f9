"""The models a daemon serves, one slot each: its state (``unloaded`` → ``loading`` → ``ready``, or ``failed``), its
engine, pipeline and memory, and its requests. The API resolves a request's ``model`` here
(:meth:`ModelRegistry.acquire`), which loads a model on its first request and unloads idle ones to make room;
nothing else knows how many models there are. MLX is imported only inside the loading and unloading steps."""

from __future__ import annotations

import asyncio
import fnmatch
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.config.models import ServedModel
from mlxd.errors import ModelNotFound, NotReady
from mlxd.log import get_logger
from mlxd.model_slot import ModelSlot, SlotHooks

log = get_logger("mlxd.registry")


@dataclass
class Room:
    """What a load needs from the memory budget and what is held against it."""

    need: int
    held: int
    budget: int

    @property
    def fits(self) -> bool:
        return not self.budget or self.held + self.need <= self.budget


class ModelRegistry:
    """Every configured model (:func:`mlxd.config.models.served_models`), in config order.

    ``gate()`` is called first by :meth:`acquire` (the daemon's own readiness: loading, draining). ``budget``: bytes
    of weights the loaded models may hold together (``[server] models_memory_bytes``; 0: no bound)."""

    def __init__(self, served: list[ServedModel], hooks: SlotHooks, *, first_pipeline: Any = None,
                 budget: int = 0, gate: Callable[[], None] | None = None) -> None:
        self.slots = [ModelSlot(s, hooks, pipeline=first_pipeline if i == 0 else None) for i, s in enumerate(served)]
        self.budget = budget
        self.gate = gate
        self._room: asyncio.Lock | None = None
        self._reaper: asyncio.Task | None = None

    @property
    def first(self) -> ModelSlot:
        """The first configured model: what single-model views (``/health``'s ``model``) name."""
        return self.slots[0]

    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    def resolve(self, requested: str) -> ModelSlot:
        """The slot a request's ``model`` names: a served name, a model's ``source``, or one of its alias patterns
        (models in config order); else ``ModelNotFound`` (404) listing what is served."""
        for slot in self.slots:
            if requested == slot.name:
                return slot
        for slot in self.slots:
            model = slot.config.model
            if requested == model.source or any(fnmatch.fnmatchcase(requested, p) for p in model.aliases):
                return slot
        shown = requested if len(requested) <= 64 else requested[:64] + "…"  # never echo a huge value back
        aliases = [p for slot in self.slots for p in slot.config.model.aliases]
        names = ", ".join(repr(name) for name in self.names())
        raise ModelNotFound(f"model {shown!r} is not served here; use {names}"
                            + (f" or a name matching {aliases}" if aliases else ""), param="model")

    async def acquire(self, requested: str) -> ModelSlot:
        """The ready slot for a request's ``model``: loaded first when it is not (the request waits), after
        unloading least recently used idle, unpinned models when it does not fit the budget. ``NotReady`` (503
        with ``Retry-After``) when it cannot fit now or its load failed; ``ModelNotFound`` (404)."""
        if self.gate is not None:
            self.gate()
        slot = self.resolve(requested)
        for _ in range(3):  # another request's load may unload it again before this one resumes
            if slot.state == "ready":
                slot.lease()
                return slot
            await self._load_on_request(slot)
        raise NotReady(f"model {slot.name!r} was unloaded again (for other models) while this request waited for "
                       "it; retry shortly", retry_after=1.0)

    async def _load_on_request(self, slot: ModelSlot) -> None:
        if slot.loading is None:
            slot.loading = asyncio.ensure_future(self._load(slot))
            slot.loading.add_done_callback(lambda _: setattr(slot, "loading", None))
        await asyncio.shield(slot.loading)
        if slot.state == "failed":
            raise NotReady(f"model {slot.name!r} could not be loaded: {slot.error}", retry_after=5.0)

    async def _load(self, slot: ModelSlot) -> None:
        if self._room is None:
            self._room = asyncio.Lock()
        async with self._room:  # one decision about memory at a time
            await self._make_room(slot)
            slot.state = "loading"
        await asyncio.to_thread(slot.load_safely)

    async def _make_room(self, slot: ModelSlot) -> None:
        room = self.room_for(slot)
        if room.budget and room.need > room.budget:
            raise NotReady(f"model {slot.name!r} ({room.need} bytes) does not fit [server] models_memory_bytes = "
                           f"{room.budget} even alone", retry_after=60.0)
        for victim in sorted(self._evictable(slot), key=lambda s: s.last_used):
            if room.fits:
                break
            if victim.state == "ready" and not victim.busy():  # still, after the previous unload's wait
                await self.unload(victim, reason="room", for_model=slot.name)
            room = self.room_for(slot)
        if not room.fits:
            busy = [s.name for s in self.slots if s is not slot and s.holds_memory]
            retry_after = max([s.engine.retry_after_s() for s in self.slots if s.state == "ready"] or [5.0])
            raise NotReady(f"model {slot.name!r} ({room.need} bytes) does not fit [server] models_memory_bytes = "
                           f"{room.budget} beside the loaded models {busy} ({room.held} bytes), which are busy or "
                           "pinned; retry shortly", retry_after=retry_after)

    def room_for(self, slot: ModelSlot) -> Room:
        held = sum(s.expected_bytes() for s in self.slots if s is not slot and s.holds_memory)
        return Room(need=slot.expected_bytes(), held=held, budget=self.budget)

    def _evictable(self, slot: ModelSlot) -> list[ModelSlot]:
        return [s for s in self.slots if s is not slot and s.state == "ready" and not s.served.pin and not s.busy()]

    async def unload(self, slot: ModelSlot, reason: str, **fields: Any) -> None:
        """Unload ``slot`` (ready → unloaded) and wait until its memory is given back."""
        before = slot.active_bytes
        freed = await asyncio.to_thread(free_engine, [slot.detach()])  # no other reference while it is freed
        log.info("model_unloaded", model=slot.name, reason=reason, freed_bytes=freed, loaded_bytes=before, **fields)

    def load_at_start(self) -> None:
        """Load the models whose policy is ``at_start``, in order (blocking; a failure raises)."""
        for slot in self.slots:
            if slot.served.load != "at_start":
                continue
            slot.state = "loading"
            try:
                slot.load()
            except BaseException as e:
                slot.state, slot.error = "failed", str(e)
                raise

    def start_reaper(self) -> None:
        """Unload idle models (``idle_unload_s``) from a task on the running event loop; none needed: nothing."""
        idle = [s.served.idle_unload_s for s in self.slots if s.served.idle_unload_s > 0 and not s.served.pin]
        if idle and self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap(min(1.0, max(0.05, min(idle) / 4))))

    def stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    async def _reap(self, tick_s: float) -> None:
        while True:
            await asyncio.sleep(tick_s)
            for slot in self.slots:
                if slot.state != "ready" or slot.served.pin or slot.served.idle_unload_s <= 0:
                    continue
                if slot.busy():
                    slot.touch()
                elif time.monotonic() - slot.last_used >= slot.served.idle_unload_s:
                    if self._room is None:
                        self._room = asyncio.Lock()
                    async with self._room:
                        if slot.state == "ready" and not slot.busy():
                            await self.unload(slot, reason="idle", idle_unload_s=slot.served.idle_unload_s)

    def describe(self) -> list[dict[str, Any]]:
        """Each model's state, memory and requests (``/v1/status``, ``/v1/models``, ``/metrics``)."""
        return [slot.describe() for slot in self.slots]


def free_engine(box: list[Any]) -> int:
    """Stop an unloaded model's engine (the one item of ``box``, which holds the last reference to it) and give its
    memory back; returns the MLX active bytes freed."""
    import mlx.core as mx

    before = mx.get_active_memory()
    engine = box.pop()
    if engine is not None:
        engine.stop()
    del engine
    gc.collect()
    mx.clear_cache()
    return max(0, before - mx.get_active_memory())


def pipeline_path(base_dir: Path | None) -> Path:
    """A stand-in for the config file when only its folder is known: pipelines named by path are relative to it."""
    return (base_dir or Path.cwd()) / "mlxd.toml"
