"""Snapshots of model caches, kept within a byte budget.

A snapshot holds the ``state`` (and ``meta_state``, where the cache class has one) of every layer of an mlx-lm
prompt cache; a layer comes back through its class's ``from_state``, so any cache that follows mlx-lm's protocol
(KVCache, RotatingKVCache, QuantizedKVCache, ArraysCache, CacheList, ...) is stored the same way.

Copies are cheap because MLX arrays are immutable values: what looks like an in-place write
(``keys[..., i:j, :] = x``) makes a new array and rebinds the Python object, and reuses the old buffer only when
nothing else refers to it. So a snapshot and every cache handed out from it share buffers until one of them is
written to, and the writer copies what it writes into (once; later writes reuse its own copy). What must not be
shared are the Python objects (array handles, lists, cache instances), and those are always new.

Bytes are counted from shapes and dtypes (``array.nbytes``). For that count to be what is held, a snapshot
compacts views: an array that is a slice of a larger buffer (a recurrent model's conv state often is a slice of
the whole chunk it just processed) is copied out of it; whole buffers are shared as they are.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The state of every layer of a prompt cache, and the bytes its arrays hold."""

    layers: tuple[tuple[type, Any, Any], ...]  # (cache class, state, meta_state or None)
    num_bytes: int
    trimmable: bool


def _map_arrays(fn, tree: Any) -> Any:
    if isinstance(tree, mx.array):
        return fn(tree)
    if isinstance(tree, list | tuple):
        return type(tree)(_map_arrays(fn, x) for x in tree)
    if isinstance(tree, dict):
        return {k: _map_arrays(fn, v) for k, v in tree.items()}
    return tree


def _arrays(tree: Any) -> list[mx.array]:
    found: list[mx.array] = []
    _map_arrays(found.append, tree)
    return found


def _meta_state(layer: Any) -> Any:
    # Newer mlx-lm releases split scalars out of ``state`` into ``meta_state``; older ones keep them in ``state``.
    return layer.meta_state if hasattr(type(layer), "meta_state") else None


def take_snapshot(cache: Sequence[Any]) -> Snapshot:
    """A snapshot of ``cache`` (a list of mlx-lm cache layers, batch size 1), independent of it.

    The caller may go on writing to ``cache``. Evaluates the snapshot's arrays: a no-op when the cache was
    evaluated already (as after every prefill chunk), and needed so that compacted views let go of their buffers.
    """
    layers = []
    for layer in cache:
        state = _map_arrays(mx.contiguous, layer.state)
        layers.append((type(layer), state, copy.deepcopy(_meta_state(layer))))
    arrays = _arrays([state for _, state, _ in layers])
    mx.eval(arrays)
    trimmable = all(layer.is_trimmable() for layer in cache)
    return Snapshot(tuple(layers), sum(a.nbytes for a in arrays), trimmable)


def restore(snapshot: Snapshot, num_to_trim: int = 0) -> list[Any]:
    """New cache layers holding the snapshot's state, minus its last ``num_to_trim`` tokens.

    The layers are the caller's to extend in place; the snapshot is unaffected. Trimming needs a trimmable
    snapshot.
    """
    if num_to_trim and not snapshot.trimmable:
        raise ValueError(f"cannot trim {num_to_trim} tokens from a snapshot that is not trimmable")
    layers = []
    for cls, state, meta in snapshot.layers:
        state = _map_arrays(copy.copy, state)  # new handles, shared buffers
        layer = cls.from_state(state) if meta is None else cls.from_state(state, copy.deepcopy(meta))
        if num_to_trim:
            layer.trim(num_to_trim)
        layers.append(layer)
    return layers


class SnapshotStore:
    """Snapshots by entry id, holding at most ``budget_bytes``; evicts in the order the caller gives.

    ``on_evict(entry_id, snapshot)`` is called for each snapshot ``put`` evicts (a lower tier may keep it)."""

    def __init__(self, budget_bytes: int, on_evict: Callable[[int, Snapshot], None] | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict
        self.num_bytes = 0
        self._snapshots: dict[int, Snapshot] = {}

    def __len__(self) -> int:
        return len(self._snapshots)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._snapshots

    def put(self, entry_id: int, snapshot: Snapshot, victims: Iterable[int] = ()) -> tuple[bool, list[int]]:
        """Store ``snapshot`` under ``entry_id``, evicting ``victims`` (in order) until it fits the budget.

        Returns whether it was stored and the ids evicted (the caller forgets them elsewhere). A snapshot that
        does not fit once every victim is gone is not stored, and nothing is evicted for it.
        """
        if entry_id in self._snapshots:
            raise ValueError(f"entry {entry_id} is already stored")
        excess = self.num_bytes + snapshot.num_bytes - self.budget_bytes
        evicted: list[int] = []
        freeable = 0
        for victim in victims:
            if excess - freeable <= 0:
                break
            if victim in self._snapshots and victim != entry_id:
                evicted.append(victim)
                freeable += self._snapshots[victim].num_bytes
        if excess - freeable > 0:
            return False, []
        for victim in evicted:
            popped = self.pop(victim)
            if self.on_evict is not None:
                self.on_evict(victim, popped)
        self._snapshots[entry_id] = snapshot
        self.num_bytes += snapshot.num_bytes
        return True, evicted

    def checkout(self, entry_id: int, num_to_trim: int = 0) -> list[Any]:
        """An independent copy of a stored snapshot as cache layers (see ``restore``)."""
        return restore(self._snapshots[entry_id], num_to_trim)

    def get(self, entry_id: int) -> Snapshot:
        return self._snapshots[entry_id]

    def pop(self, entry_id: int) -> Snapshot:
        """Remove a snapshot and return it."""
        snapshot = self._snapshots.pop(entry_id)
        self.num_bytes -= snapshot.num_bytes
        return snapshot

    def clear(self) -> None:
        self._snapshots.clear()
        self.num_bytes = 0
