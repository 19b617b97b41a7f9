"""The prefix cache: a token index and a snapshot store behind ``lookup`` and ``insert``.

Engine-agnostic; what an engine does with it, per request:

1. Before prefill, ``hit = cache.lookup(prompt)``; on a hit, start from ``hit.cache`` at token ``hit.num_cached``
   (at most ``len(prompt) - 1``) instead of a fresh ``make_prompt_cache(model)``.
2. After each prefill chunk (its state evaluated), ``cache.insert(prompt[:end], layers)``. On a trimmable cache
   the previous chunk's snapshot is dropped as the longer one lands, so at most one is held per request; with
   chunks of 256 tokens or more the layers' next write allocates a new buffer anyway, so a snapshot costs no extra copy.
3. End the prefill at ``checkpoint_length(len(prompt))`` (all tokens but the last, as mlx-lm's ``generate_step``
   does), insert there, then process the last token. For caches that cannot be trimmed (recurrent layers) this is
   the snapshot that lets a resent prompt hit.
4. When the request finishes, insert its own layers once more with ``prompt + generated[:-1]`` (the last sampled
   token was never fed to the model): the next turn of a conversation extends exactly that. From a batched cache,
   take the row out first (``[layer.extract(i) for layer in batch_cache]``); snapshots hold batch size 1.

The first write into a cache that shares buffers with a snapshot (a handed-out cache, or the engine's own cache
right after ``insert``) copies the buffer it writes into; later writes do not. Call from one thread at a time or
many: every method takes a lock.

With a disk tier attached (``attach_disk``, :mod:`mlxd.cache.disk`), entries evicted for the budget are queued for
writing, a lookup that the disk serves better than memory reads the file (on the caller's thread: the engine's)
and brings the entry back into memory, and ``persist`` writes what memory still holds (a clean stop).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from mlxd.cache.index import Match, PrefixIndex
from mlxd.cache.store import Snapshot, SnapshotStore, restore, take_snapshot
from mlxd.log import get_logger

if TYPE_CHECKING:
    from mlxd.cache.disk import DiskTier

log = get_logger("mlxd.cache")

HitKind = Literal["exact", "prefix", "longer", "diverged", "miss"]


@dataclass(frozen=True, slots=True)
class Hit:
    """What ``lookup`` found: cache layers holding the prompt's first ``num_cached`` tokens, or a miss.

    ``cache`` is None on a miss (``num_cached == 0``); otherwise it is the caller's own to extend in place.
    ``entry``: the tokens of the entry it came from (``discard`` drops it), empty on a miss.
    """

    cache: list[Any] | None
    num_cached: int
    kind: HitKind
    entry: tuple[int, ...] = ()


MISS = Hit(None, 0, "miss")


def checkpoint_length(num_prompt_tokens: int) -> int:
    """Where to snapshot a prompt: all tokens but the last, the state a prefill reaches before producing logits.

    That state serves both the next turn of a conversation (which extends the prompt) and an exact resend of
    the same prompt, even for caches that cannot be trimmed; a snapshot of the whole prompt serves only the first.
    """
    return max(0, num_prompt_tokens - 1)


def _as_tokens(tokens: Sequence[int] | Any) -> tuple[int, ...]:
    if hasattr(tokens, "tolist"):  # an mx.array or numpy array
        tokens = tokens.tolist()
    return tuple(int(t) for t in tokens)


def _check_holds(cache: Sequence[Any], num_tokens: int) -> None:
    """Refuse a cache whose position-tracking layers do not hold exactly ``num_tokens`` tokens."""
    for layer in cache:
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int) and offset != num_tokens:
            raise ValueError(f"a cache layer holds {offset} tokens but {num_tokens} tokens were given")


class PrefixCache:
    """Reusable prompt state for one model, within ``budget_bytes`` of snapshots.

    ``lookup`` never returns a state holding tokens the prompt lacks, and always leaves at least one prompt
    token for the model to process. ``insert`` stores an independent snapshot; strict prefixes that a longer
    trimmable entry can stand in for are dropped, and least recently used entries are evicted to fit the budget.
    """

    def __init__(self, budget_bytes: int) -> None:
        self._index = PrefixIndex()
        self._store = SnapshotStore(budget_bytes, on_evict=self._spill)
        self._lock = threading.Lock()
        self._hits: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._disk: DiskTier | None = None

    def attach_disk(self, disk: DiskTier | None) -> None:
        """Keep evicted entries in ``disk`` (opened) and look there too (:mod:`mlxd.cache.disk`); None: none."""
        self._disk = disk

    def lookup(self, tokens: Sequence[int] | Any, min_tokens: int = 1, align: int = 1) -> Hit:
        """The longest reusable state for ``tokens``, ready to continue from token ``num_cached``; a miss when it
        covers fewer than ``min_tokens``. With ``align``, a trimmable state is cut back to a multiple of ``align``
        tokens where that still covers ``min_tokens`` (:func:`_aligned`)."""
        tokens = _as_tokens(tokens)
        with self._lock:
            match = self._index.match(tokens, min_tokens)
            if self._disk is None or (match is not None and match.num_tokens >= len(tokens) - 1):
                return self._checkout(match, align, min_tokens)
        found = self._disk.lookup(tokens, min_tokens, match.num_tokens if match is not None else 0)
        with self._lock:
            if found is None:  # memory's match, unless it went meanwhile (another thread's insert or clear)
                return self._checkout(self._index.match(tokens, min_tokens), align, min_tokens)
            disk_match, entry_tokens, snapshot = found
            self._put(entry_tokens, snapshot)  # back in memory (if it fits)
            disk_match = _aligned(disk_match, align, min_tokens, snapshot.trimmable)
            self._count_hit(disk_match)
        return Hit(restore(snapshot, disk_match.num_to_trim), disk_match.num_tokens, disk_match.kind, entry_tokens)

    def _checkout(self, match: Match | None, align: int, min_tokens: int) -> Hit:
        """A memory entry's layers (callers hold the lock)."""
        if match is None:
            self._counts["num_misses"] += 1
            return MISS
        match = _aligned(match, align, min_tokens, self._store.get(match.entry_id).trimmable)
        cache = self._store.checkout(match.entry_id, match.num_to_trim)
        self._index.touch(match.entry_id)
        self._count_hit(match)
        return Hit(cache, match.num_tokens, match.kind, self._index.tokens(match.entry_id))

    def _count_hit(self, match: Match) -> None:
        self._hits[match.kind] += 1
        self._counts["num_tokens_reused"] += match.num_tokens

    def insert(self, tokens: Sequence[int] | Any, cache: Sequence[Any]) -> bool:
        """Keep a snapshot of ``cache``, whose layers hold exactly ``tokens`` (batch size 1, evaluated).

        The caller may go on extending ``cache``. Returns False when nothing new was stored: the tokens are
        already covered (an equal entry, or a longer trimmable one that can stand in), or the snapshot is larger
        than the budget or than what eviction can free.
        """
        tokens = _as_tokens(tokens)
        if not tokens or not cache:
            return False
        _check_holds(cache, len(tokens))
        with self._lock:
            covering = self._index.find(tokens)
            if covering is None:
                covering = self._index.covering(tokens)
            if covering is not None:
                self._index.touch(covering)
                return False
        snapshot = take_snapshot(cache)  # outside the lock: it may wait for the arrays to be evaluated
        with self._lock:
            return self._put(tokens, snapshot)

    def _put(self, tokens: tuple[int, ...], snapshot: Any) -> bool:
        if snapshot.num_bytes > self._store.budget_bytes or self._index.find(tokens) is not None:
            self._counts["num_rejected"] += 1
            return False
        entry_id = self._index.add(tokens, trimmable=snapshot.trimmable)
        self._index.acquire(entry_id)  # not a victim of its own insertion
        dominated = self._index.strict_prefixes(tokens) if snapshot.trimmable else []
        for victim in dominated:
            self._drop(victim)
        stored, evicted = self._store.put(entry_id, snapshot, self._index.victims())
        self._index.release(entry_id)
        for victim in evicted:
            self._index.remove(victim)
        if not stored:
            self._index.remove(entry_id)
            self._counts["num_rejected"] += 1
            return False
        self._counts["num_inserts"] += 1
        self._counts["num_dominated_dropped"] += len(dominated)
        self._counts["num_evictions"] += len(evicted)
        return True

    def discard(self, tokens: Sequence[int] | Any) -> bool:
        """Drop the entry whose tokens are exactly ``tokens`` (a hit's ``entry``), unless an insertion in progress
        pins it, and its file in the disk tier; returns whether one was dropped. For a snapshot that a later one of
        the same prompt supersedes, where the index cannot tell (entries that cannot be trimmed never dominate their
        prefixes), and for a state that failed on use."""
        tokens = _as_tokens(tokens)
        on_disk = self._disk is not None and self._disk.discard(tokens)
        with self._lock:
            entry_id = self._index.find(tokens)
            if entry_id is None or entry_id not in self._index.victims():
                return on_disk
            self._drop(entry_id)
            self._counts["num_superseded_dropped"] += 1
            return True

    def _drop(self, entry_id: int) -> None:
        self._index.remove(entry_id)
        if entry_id in self._store:
            self._store.pop(entry_id)

    @property
    def num_bytes(self) -> int:
        """Bytes the snapshots hold now."""
        with self._lock:
            return self._store.num_bytes

    def shrink(self, num_bytes: int) -> int:
        """Evict least recently used entries until at most ``num_bytes`` are held; returns the bytes freed.

        For memory that others need now (requests being admitted); the budget itself is unchanged. Entries pinned
        by an insertion in progress stay.
        """
        with self._lock:
            before = self._store.num_bytes
            for victim in self._index.victims():
                if self._store.num_bytes <= num_bytes:
                    break
                self._spill(victim, self._store.get(victim))
                self._drop(victim)
                self._counts["num_evictions"] += 1
            return before - self._store.num_bytes

    def _spill(self, entry_id: int, snapshot: Snapshot) -> None:
        """An entry evicted for the budget goes to the disk tier, if there is one (callers hold the lock)."""
        if self._disk is not None:
            self._disk.submit(self._index.tokens(entry_id), snapshot)

    def persist(self, timeout_s: float) -> dict[str, int] | None:
        """Write every entry still in memory to the disk tier (least recently used first, so that the bound keeps
        the newest), wait at most ``timeout_s`` for the writes, and stop the writer (after those still queued). For
        a clean stop; None without a disk tier."""
        disk = self._disk
        if disk is None:
            return None
        with self._lock:
            entries = [(self._index.tokens(e), self._store.get(e)) for e in self._index.victims() if e in self._store]
        num_queued = sum(disk.submit(tokens, snapshot) for tokens, snapshot in entries)
        written = disk.flush(timeout_s)
        disk.close(wait=written)  # a write still running when the process exits leaves only a temporary file
        stats = disk.stats()
        log.info("prefix_disk_persisted", num_in_memory=len(entries), num_queued=num_queued, complete=written,
                 num_files=stats["num_entries"], num_file_bytes=stats["num_bytes"], num_writes=stats["num_writes"])
        return {"num_entries": len(entries), "num_queued": num_queued, "complete": int(written)}

    def stats(self) -> dict[str, Any]:
        """Entries, bytes, budget, hits by kind, misses, tokens reused and insert/evict counters."""
        with self._lock:
            return {
                "num_entries": len(self._index),
                "num_bytes": self._store.num_bytes,
                "budget_bytes": self._store.budget_bytes,
                "hits": {kind: self._hits[kind] for kind in ("exact", "prefix", "longer", "diverged")},
                "num_hits": sum(self._hits.values()),
                **{k: self._counts[k] for k in ("num_misses", "num_tokens_reused", "num_inserts",
                                                "num_dominated_dropped", "num_superseded_dropped", "num_evictions",
                                                "num_rejected")},
                **({"disk": self._disk.stats()} if self._disk is not None else {}),
            }

    def clear(self) -> None:
        """Drop every entry, the disk tier's files included (counters are kept)."""
        with self._lock:
            self._index.clear()
            self._store.clear()
        if self._disk is not None:
            self._disk.clear()


def _aligned(match: Match, align: int, min_tokens: int, trimmable: bool) -> Match:
    """``match`` cut back to a multiple of ``align`` tokens (the cut tokens trimmed from the entry's state too),
    where its state can be trimmed and what is left still covers ``min_tokens``; else as it is.

    The engine aligns text prompts' hits to its device's group bucket: a pass of rests attends over the cached
    tokens and the rests, and with the cached length rounded as the rests' is
    (:func:`mlxd.engine.step.prompts.group_width`) its shapes repeat from one burst to the next instead of taking
    every cached length a shared system prompt happens to have. MLX's CUDA backend builds work for each new shape:
    on an H200 (Qwen3-8B shape) a pass of 4 rests of 256 tokens after 35 cached took 147-150 ms the first time and
    38-48 ms after."""
    extra = match.num_tokens % align
    if not extra or match.num_tokens - extra < min_tokens or not trimmable:
        return match
    return replace(match, num_tokens=match.num_tokens - extra, num_to_trim=match.num_to_trim + extra)
