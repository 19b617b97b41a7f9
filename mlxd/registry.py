"""The models a daemon serves, one slot each: its state (``unloaded`` → ``loading`` → ``ready``, or ``failed``), its
engine, pipeline and memory, and its requests. The API resolves a request's ``model`` here
(:meth:`ModelRegistry.acquire`), which loads a model on its first request and unloads idle ones to make room;
nothing else knows how many models there are. MLX is imported only inside the loading and unloading steps."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.config.models import ServedModel
from mlxd.errors import ModelNotFound, NotReady
from mlxd.log import get_logger
from mlxd.model_slot import ModelSlot, SlotHooks
from mlxd.models_budget import KVLedger, Room

log = get_logger("mlxd.registry")

# How long making room waits for a loaded model's engine to evict prefix-cache entries (between two of its steps).
SHRINK_WAIT_S = 30.0


class ModelRegistry:
    """Every configured model (:func:`mlxd.config.models.served_models`), in config order.

    ``gate()`` is called first by :meth:`admit` (the daemon's own readiness: loading, draining). ``budget``: bytes
    the loaded models may hold together, weights, KV and prefix cache (``[server] models_memory_bytes``; 0: no
    bound)."""

    def __init__(self, served: list[ServedModel], hooks: SlotHooks, *, first_pipeline: Any = None,
                 budget: int = 0, gate: Callable[[], None] | None = None) -> None:
        self.slots = [ModelSlot(s, hooks, pipeline=first_pipeline if i == 0 else None) for i, s in enumerate(served)]
        self.budget = budget
        # Rows of several models' engines start within the budget too (one model: its own admission suffices).
        self.ledger = KVLedger(budget, self.slots) if budget and len(self.slots) > 1 else None
        for slot in self.slots:
            slot.kv_share = self.ledger.share(slot.name) if self.ledger is not None else None
        self.gate = gate
        self._room: asyncio.Lock | None = None
        self._reaper: asyncio.Task | None = None
        self._over_budget = False  # told in the log, until the models fit the budget again

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
        """The ready slot for a request's ``model``, loaded first when it is not (the request waits): what
        :meth:`admit` finds, once loaded."""
        slot, loaded = await self.admit(requested)
        return slot if loaded is None else await loaded

    async def admit(self, requested: str) -> tuple[ModelSlot, asyncio.Future | None]:
        """The slot for a request's ``model``, with its load started when it is not ready: ``(slot, None)`` for a
        ready model, else ``(slot, loaded)``, a future that gives the slot once it is ready (``NotReady`` when its
        load fails). The slot given counts as busy until its request reaches preparation.

        What can be known before a response starts is raised here: ``ModelNotFound`` (404), and ``NotReady`` (503
        with ``Retry-After``) when the model does not fit the memory budget even after least recently used idle,
        unpinned models are unloaded and the others' prefix caches shrunk to make room, so that a streaming request
        may wait for the load with keep-alive frames once this returns."""
        if self.gate is not None:
            self.gate()
        slot = self.resolve(requested)
        if slot.state == "ready":
            slot.lease()
            return slot, None
        await self._start_load(slot)
        return slot, _settled(asyncio.ensure_future(self._loaded(slot)))

    async def _start_load(self, slot: ModelSlot) -> None:
        """Start ``slot``'s load (unless it is loading) once room is made for it; ``NotReady`` when none can be."""
        if slot.loading is not None:
            return
        if slot.admitting is None:
            slot.admitting = _settled(asyncio.ensure_future(self._admit(slot)))
            slot.admitting.add_done_callback(lambda _: setattr(slot, "admitting", None))
        await asyncio.shield(slot.admitting)

    async def _admit(self, slot: ModelSlot) -> None:
        async with self._room_lock():  # one decision about memory at a time
            if slot.state == "ready" or slot.loading is not None:
                return
            await self._make_room(slot)
            with self.ledger.lock if self.ledger is not None else contextlib.nullcontext():
                room = self.room_for(slot)  # again, while no engine may start a row
                if not room.fits:
                    raise self._no_room(slot, room)
                slot.state = "loading"
            slot.loading = asyncio.ensure_future(asyncio.to_thread(slot.load_safely))  # records a failure in state
            slot.loading.add_done_callback(lambda _: setattr(slot, "loading", None))

    async def _loaded(self, slot: ModelSlot) -> ModelSlot:
        for _ in range(3):  # another request's load may unload it again before this one resumes
            if slot.loading is not None:
                await asyncio.shield(slot.loading)
            if slot.state == "ready":
                slot.lease()
                return slot
            if slot.state == "failed":
                raise NotReady(f"model {slot.name!r} could not be loaded: {slot.error}", retry_after=5.0)
            await self._start_load(slot)
        raise NotReady(f"model {slot.name!r} was unloaded again (for other models) while this request waited for "
                       "it; retry shortly", retry_after=1.0)

    def _room_lock(self) -> asyncio.Lock:
        if self._room is None:
            self._room = asyncio.Lock()
        return self._room

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
        if not room.fits:  # the models that stay (busy, pinned) give back prefix-cache entries, least recent first
            others = sorted((s for s in self.slots if s is not slot), key=lambda s: s.last_used)
            await self._shrink_caches(others, room.held + room.need - room.budget, for_model=slot.name)
            room = self.room_for(slot)
        if not room.fits:
            raise self._no_room(slot, room)

    def _no_room(self, slot: ModelSlot, room: Room) -> NotReady:
        busy = [s.name for s in self.slots if s is not slot and s.holds_memory]
        retry_after = max([s.engine.retry_after_s() for s in self.slots if s.state == "ready"] or [5.0])
        return NotReady(f"model {slot.name!r} ({room.need} bytes) does not fit [server] models_memory_bytes = "
                        f"{room.budget} beside the loaded models {busy} ({room.held} bytes of weights, KV and "
                        "prefix cache), which are busy or pinned; retry shortly", retry_after=retry_after)

    def room_for(self, slot: ModelSlot) -> Room:
        """What loading ``slot`` needs (its weights) and what the other models hold (weights, KV, prefix cache)."""
        held = sum(s.held_bytes() for s in self.slots if s is not slot)
        return Room(need=slot.expected_bytes(), held=held, budget=self.budget)

    def held_bytes(self) -> int:
        """Bytes every model that holds memory (loading or ready) holds: weights, KV and prefix cache."""
        return sum(s.held_bytes() for s in self.slots)

    def _evictable(self, slot: ModelSlot) -> list[ModelSlot]:
        return [s for s in self.slots if s is not slot and s.state == "ready" and not s.served.pin and not s.busy()]

    async def unload(self, slot: ModelSlot, reason: str, **fields: Any) -> None:
        """Unload ``slot`` (ready → unloaded) and wait until its memory is given back."""
        before, held = slot.active_bytes, slot.memory()
        freed = await asyncio.to_thread(free_engine, [slot.detach()])  # no other reference while it is freed
        if self.ledger is not None:
            self.ledger.forget(slot.name)
        log.info("model_unloaded", model=slot.name, reason=reason, freed_bytes=freed, loaded_bytes=before,
                 **{f"{kind}_bytes": value for kind, value in held.items()}, **fields)

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
        """From a task on the running event loop: unload idle models (``idle_unload_s``), and under a memory budget
        keep the loaded models within it as their caches grow. Neither needed: nothing."""
        idle = [s.served.idle_unload_s for s in self.slots if s.served.idle_unload_s > 0 and not s.served.pin]
        if (idle or self.budget) and self._reaper is None:
            tick_s = min(1.0, max(0.05, min(idle) / 4)) if idle else 1.0
            self._reaper = asyncio.get_running_loop().create_task(self._reap(tick_s))

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
                    async with self._room_lock():
                        if slot.state == "ready" and not slot.busy():
                            await self.unload(slot, reason="idle", idle_unload_s=slot.served.idle_unload_s)
            await self.keep_within_budget()

    async def keep_within_budget(self) -> None:
        """Loaded models' KV and prefix caches grow after their load: while all of them hold more than the budget,
        unload the least recently used idle, unpinned models, never the most recently used one (whose requests
        made the caches grow); then, still over, evict prefix-cache entries, the least recently used model's
        first."""
        if not self.budget or self.held_bytes() <= self.budget:
            self._over_budget = False
            return
        async with self._room_lock():
            loaded = [s for s in self.slots if s.holds_memory]
            if not loaded:
                return
            newest = max(loaded, key=lambda s: s.last_used)
            for victim in sorted(self._evictable(newest), key=lambda s: s.last_used):
                held = self.held_bytes()
                if held <= self.budget:
                    break
                if victim.state == "ready" and not victim.busy():
                    await self.unload(victim, reason="budget", held_bytes=held, budget_bytes=self.budget)
            # Still over (the rest busy or pinned): prefix-cache entries go, the least recently used model's first.
            await self._shrink_caches(sorted(loaded, key=lambda s: s.last_used), self.held_bytes() - self.budget)
        held = self.held_bytes()
        if held > self.budget and not self._over_budget:  # once until it fits again
            log.warning("models_over_budget", held_bytes=held, budget_bytes=self.budget,
                        models={s.name: s.memory() for s in self.slots if s.holds_memory},
                        detail="prefix caches that busy or pinned models keep could not be shrunk within the budget")
        self._over_budget = held > self.budget

    async def _shrink_caches(self, slots: list[ModelSlot], excess: int, **fields: Any) -> None:
        """Evict prefix-cache entries of the ready ``slots``, in order, until ``excess`` bytes are given back; each
        engine evicts on its own thread, between steps. Nothing when their prefix caches together hold less than
        ``excess``: evicting them would cost later prompts their reuse and still not fit (the KV that running
        requests reserve is what is over)."""
        if excess <= 0 or sum(s.memory()["prefix_cache"] for s in slots if s.state == "ready") < excess:
            return
        for slot in slots:
            engine, held = slot.engine, slot.memory()["prefix_cache"]
            if excess <= 0:
                return
            if slot.state != "ready" or engine is None or held <= 0:
                continue
            shrink = asyncio.ensure_future(engine.shrink_prefix_cache(held - excess))
            try:
                await asyncio.wait_for(asyncio.shield(shrink), SHRINK_WAIT_S)
            except TimeoutError:
                log.warning("prefix_cache_shrink_timeout", model=slot.name, wait_s=SHRINK_WAIT_S)
                continue
            freed = held - slot.memory()["prefix_cache"]
            excess -= freed
            log.info("prefix_cache_shrunk", model=slot.name, freed_bytes=freed, prefix_cache_bytes=held - freed,
                     **fields)

    def loaded_engines(self) -> list[tuple[str, Any]]:
        """Each ready model's name and engine, in config order (what ``/metrics`` reads at scrape time)."""
        return [(slot.name, slot.engine) for slot in self.slots if slot.state == "ready" and slot.engine is not None]

    def describe(self) -> list[dict[str, Any]]:
        """Each model's state, memory and requests (``/v1/status``, ``/v1/models``, ``/metrics``)."""
        return [slot.describe() for slot in self.slots]


def _settled(future: asyncio.Future) -> asyncio.Future:
    """``future``, its outcome marked as read: a request that stopped waiting for it (its client left) must not
    leave an unread exception to be logged at exit; whoever still waits gets the outcome."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


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
