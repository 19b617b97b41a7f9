"""Snapshots of mlx-lm caches: round trips for every cache kind, independence of copies, bytes, the budget."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from mlxd.cache.store import SnapshotStore, restore, take_snapshot

HEADS, DIM = 2, 32


def _kv(n: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    return mx.random.normal((1, HEADS, n, DIM), key=key), mx.random.normal((1, HEADS, n, DIM), key=key + 1)


def _filled(layer, n: int):
    if isinstance(layer, ArraysCache):
        layer[0], layer[1] = mx.ones((1, 3, 8)) * n, mx.ones((1, 4, 8, 8)) * n
    elif isinstance(layer, CacheList):
        for sub in layer.caches:
            _filled(sub, n)
    else:
        layer.update_and_fetch(*_kv(n))
    mx.eval(layer.state if not isinstance(layer, CacheList) else [c.state for c in layer.caches])
    return layer


LAYERS = {
    "kv": lambda: KVCache(),
    "rotating": lambda: RotatingKVCache(max_size=64, keep=4),
    "quantized": lambda: QuantizedKVCache(group_size=32, bits=8),
    "arrays": lambda: ArraysCache(size=2),
    "list": lambda: CacheList(KVCache(), ArraysCache(size=2)),
}


def _arrays(layer) -> list[mx.array]:
    leaves: list[mx.array] = []

    def walk(x):
        if isinstance(x, mx.array):
            leaves.append(x)
        elif isinstance(x, list | tuple):
            for y in x:
                walk(y)

    walk(layer.state)
    return leaves


def _same(a, b) -> bool:
    xs, ys = _arrays(a), _arrays(b)
    return len(xs) == len(ys) and all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(xs, ys, strict=True))


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_restore_gives_back_the_same_state_and_type(kind):
    layer = _filled(LAYERS[kind](), 10)
    (copy,) = restore(take_snapshot([layer]))
    assert type(copy) is type(layer)
    assert _same(copy, layer)
    assert getattr(copy, "offset", None) == getattr(layer, "offset", None)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_copies_and_snapshot_are_independent_of_writes(kind):
    original = _filled(LAYERS[kind](), 10)
    snapshot = take_snapshot([original])
    before = restore(snapshot)[0]
    _filled(original, 3)  # the engine goes on writing into the cache it inserted
    (handed_out,) = restore(snapshot)
    _filled(handed_out, 5)  # and into the copy it was handed
    assert _same(restore(snapshot)[0], before)
    assert not _same(handed_out, before)


def test_bytes_count_what_the_arrays_hold():
    kv = _filled(KVCache(), 10)  # one 256-token step is allocated
    arrays = _filled(ArraysCache(size=2), 10)
    snapshot = take_snapshot([kv, arrays])
    assert snapshot.num_bytes == kv.nbytes + arrays.nbytes == 2 * HEADS * 256 * DIM * 4 + (3 * 8 + 4 * 64) * 4
    assert snapshot.trimmable is False
    assert take_snapshot([kv]).trimmable is True


def test_a_view_into_a_large_buffer_is_compacted():
    gc.collect()
    baseline = mx.get_active_memory()
    big = mx.ones((1, 1 << 20, 16))  # 64 MiB, like a conv state sliced out of a whole prefill chunk
    layer = ArraysCache(size=2)
    layer[0], layer[1] = big[:, -3:, :], mx.zeros((1, 2))
    mx.eval(layer.state)
    del big
    snapshot = take_snapshot([layer])
    del layer
    gc.collect()
    assert snapshot.num_bytes == (3 * 16 + 2) * 4
    assert mx.get_active_memory() - baseline < 1 << 20


def test_restore_trims_trimmable_snapshots_only():
    (kv,) = restore(take_snapshot([_filled(KVCache(), 10)]), num_to_trim=4)
    assert kv.offset == 6 and kv.keys_and_values()[0].shape[2] == 6
    with pytest.raises(ValueError, match="not trimmable"):
        restore(take_snapshot([_filled(ArraysCache(size=2), 1)]), num_to_trim=1)


def test_store_evicts_victims_in_order_until_the_snapshot_fits():
    small = take_snapshot([_filled(ArraysCache(size=2), 1)])  # (24 + 256) * 4 bytes
    store = SnapshotStore(budget_bytes=3 * small.num_bytes)
    for entry_id in range(3):
        assert store.put(entry_id, small) == (True, [])
    assert store.num_bytes == 3 * small.num_bytes
    assert store.put(3, small, victims=[2, 0, 1]) == (True, [2])
    assert sorted(store._snapshots) == [0, 1, 3] and store.num_bytes == 3 * small.num_bytes
    store.pop(0)
    assert store.num_bytes == 2 * small.num_bytes and 0 not in store


def test_store_refuses_what_cannot_fit_and_then_evicts_nothing():
    snapshot = take_snapshot([_filled(ArraysCache(size=2), 1)])
    store = SnapshotStore(budget_bytes=2 * snapshot.num_bytes)
    store.put(0, snapshot)
    store.put(1, snapshot)
    assert store.put(2, snapshot, victims=[]) == (False, [])  # every other entry pinned
    assert store.put(3, take_snapshot([_filled(KVCache(), 1)]), victims=[0, 1]) == (False, [])
    assert len(store) == 2
    with pytest.raises(ValueError, match="already stored"):
        store.put(0, snapshot)
    store.clear()
    assert len(store) == 0 and store.num_bytes == 0
