"""The prefix cache's disk tier: snapshots that leave memory are written to files, and a later lookup (also in a
restarted daemon) reads them back.

- **Format.** One safetensors file per entry, written by mlx-lm's ``save_prompt_cache`` (read back by
  ``load_prompt_cache``), with metadata: the format, the model identity's digest, the entry's tokens (int64,
  base64), whether it can be trimmed and the layers' classes (:mod:`mlxd.cache.diskfile`: mlx-lm's classes and
  mlxd's own subclasses of them; a snapshot holding another class stays in memory only).
- **Identity.** Files live in ``<prefix_cache_dir>/<identity digest>/``; the identity is the weights digest (every
  parameter's name, shape and dtype, and 64 values sampled across it: a re-quantized, re-cast or fine-tuned model
  differs, a re-downloaded copy of the same weights does not), ``kv_bits``, ``kv_group_size`` and ``max_kv_size``
  (which decide the cache's classes and shapes), and the format. The chat template is not in it: the key is token
  ids, and the state after given ids depends on the weights alone. A file whose metadata names another identity is
  foreign: a miss, deleted and logged.
- **Integrity.** A file is written under a temporary name, then renamed to the BLAKE2b digest of its bytes
  (``os.replace``: a reader sees a whole file or none). Start-up reads every header (tokens, sizes); a file whose
  header or length is wrong is deleted. A lookup that reads a file checks its digest first; a torn, truncated or
  altered file is a miss, deleted and logged (``prefix_disk_rejected``), never a wrong answer.
- **Threads.** Writes run on a writer thread of their own: the engine only queues a snapshot (its arrays are
  immutable and evaluated). Reads run on the engine thread, never on the event loop. Pending writes hold at most
  ``MAX_PENDING_BYTES`` (or one snapshot of any size); a snapshot beyond that is not written (counted).
- **Bound.** The files of an identity hold at most ``budget_bytes``; the least recently used go first (a hit
  touches its file, so the order survives a restart).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from mlxd.cache.diskfile import (
    FORMAT,
    CorruptFile,
    decode_tokens,
    encode_tokens,
    file_digest,
    identity_key,
    load_snapshot,
    read_metadata,
    save_snapshot,
    weights_digest,
    writable,
)
from mlxd.cache.index import Match, PrefixIndex
from mlxd.cache.store import Snapshot
from mlxd.errors import ConfigError
from mlxd.log import get_logger

log = get_logger("mlxd.cache")

SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"
# Snapshots waiting for the writer, beyond the one it writes first; an evicted one beyond this is not written (a
# snapshot larger than this alone is, as the only one waiting).
MAX_PENDING_BYTES = 1024**3
HEADER_RESERVE_BYTES = 64 * 1024  # a file's header beyond its tokens (class names, offsets), made room for in advance


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # gone meanwhile (another process sharing the folder): indexing it fails and says so
        return 0.0


class DiskTier:
    """Snapshots in files under ``root/<identity key>``, within ``budget_bytes``; see the module's docstring.

    ``open`` rebuilds the index from the folder and starts the writer; ``close`` stops it. ``lookup`` (the engine
    thread), ``submit`` (any thread), ``discard``, ``clear`` and ``stats`` are thread-safe."""

    def __init__(self, root: str | Path, budget_bytes: int, identity: dict[str, Any]) -> None:
        self.identity = {"format": FORMAT, **identity}
        self.key = identity_key(self.identity)
        self.folder = Path(root) / self.key
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self._index = PrefixIndex()
        self._files: dict[int, tuple[str, int]] = {}  # entry id -> (file name, bytes)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue[tuple[tuple[int, ...], Snapshot] | None] = queue.SimpleQueue()
        self._pending: dict[tuple[int, ...], int] = {}  # tokens waiting for the writer -> bytes
        self._counts: Counter[str] = Counter()
        self._read_s = 0.0  # reading, checking and loading files for hits, in all
        self._thread: threading.Thread | None = None

    # ---- start and stop ----

    def open(self) -> None:
        """Create the folder, index the files in it (oldest first; bad ones deleted) and start the writer."""
        started = time.perf_counter()
        self.folder.mkdir(parents=True, exist_ok=True)
        paths = sorted(self.folder.iterdir(), key=_mtime)
        for path in paths:
            if path.name.startswith(TEMP_PREFIX):  # a write that a crash or kill cut short
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX:
                self._index_file(path)
        with self._lock:
            self._fit(0)
        log.info("prefix_disk_opened", folder=str(self.folder), num_entries=len(self._files),
                 num_bytes=self.num_bytes, budget_bytes=self.budget_bytes,
                 open_s=round(time.perf_counter() - started, 3))
        self._thread = threading.Thread(target=self._write_loop, name="mlxd-prefix-disk", daemon=True)
        self._thread.start()

    def _index_file(self, path: Path) -> None:
        try:
            metadata = read_metadata(path)
            tokens = self._check_metadata(metadata)
            num_bytes = path.stat().st_size
        except (CorruptFile, OSError) as e:
            self._reject(path, str(e), "open")
            return
        with self._lock:
            if not tokens or self._index.find(tokens) is not None:
                path.unlink(missing_ok=True)
                return
            self._add(tokens, path.name, num_bytes, metadata.get("trimmable") == "1")

    def _check_metadata(self, metadata: dict[str, str]) -> tuple[int, ...]:
        if metadata.get("format") != FORMAT:
            raise CorruptFile(f"format {metadata.get('format')!r}, not {FORMAT!r}")
        if metadata.get("identity") != self.key:
            raise CorruptFile(f"another model's file (identity {metadata.get('identity')!r}, this model's "
                              f"{self.key!r})")
        try:
            return decode_tokens(metadata["tokens"])
        except (KeyError, ValueError) as e:
            raise CorruptFile(f"unreadable tokens: {e}") from e

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued snapshot is written, at most ``timeout_s``; returns whether they all were."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout=timeout_s)

    def close(self, wait: bool = True) -> None:
        """Take no more writes; the writer stops once it has written what is queued (waited for with ``wait``)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if wait:
                thread.join()

    # ---- reads (engine thread) ----

    def lookup(self, tokens: tuple[int, ...], min_tokens: int,
               better_than: int) -> tuple[Match, tuple[int, ...], Snapshot] | None:
        """The entry that serves ``tokens`` best (see ``PrefixIndex.match``) when it covers more than
        ``better_than`` tokens: the match, the entry's own tokens and its snapshot, read and checked; else None
        (a miss, counted). A file that fails its checks is deleted."""
        with self._lock:
            match = self._index.match(tokens, max(min_tokens, better_than + 1))
            entry = (self._index.tokens(match.entry_id), *self._files[match.entry_id]) if match else None
        if match is None:
            self._count("num_misses")
            return None
        entry_tokens, name, num_bytes = entry
        started = time.perf_counter()
        snapshot = self._read(self.folder / name, entry_tokens)
        read_s = time.perf_counter() - started
        with self._lock:
            if snapshot is None:
                self._forget(match.entry_id)
                self._counts["num_misses"] += 1
                return None
            if match.entry_id in self._files:
                self._index.touch(match.entry_id)
            self._counts["num_hits"] += 1
            self._counts["num_bytes_read"] += num_bytes
            self._read_s += read_s
        log.info("prefix_disk_hit", num_tokens=match.num_tokens, kind=match.kind, num_bytes=num_bytes,
                 read_s=round(read_s, 3))
        with contextlib.suppress(OSError):  # deleted meanwhile: the snapshot is read already
            os.utime(self.folder / name)  # the LRU order a restart rebuilds
        return match, entry_tokens, snapshot

    def _read(self, path: Path, tokens: tuple[int, ...]) -> Snapshot | None:
        try:
            if file_digest(path) != path.stem:
                raise CorruptFile("its bytes do not match its checksum (torn, truncated or altered)")
            snapshot, metadata = load_snapshot(path)
            if self._check_metadata(metadata) != tokens:
                raise CorruptFile("its tokens are not the ones it was indexed under")
            return snapshot
        except (CorruptFile, OSError) as e:
            self._reject(path, str(e), "read")
        except Exception as e:  # noqa: BLE001 - whatever mlx or mlx-lm make of a bad file: a miss, logged
            self._reject(path, f"{type(e).__name__}: {e}", "read")
        return None

    def _reject(self, path: Path, reason: str, phase: str) -> None:
        log.warning("prefix_disk_rejected", file=str(path), reason=reason, phase=phase)
        self._count("num_errors")
        path.unlink(missing_ok=True)

    # ---- writes (the writer thread) ----

    def submit(self, tokens: tuple[int, ...], snapshot: Snapshot) -> bool:
        """Queue a snapshot of ``tokens`` for writing; False when it is on disk already (or a longer trimmable
        entry stands in), queued, larger than the budget, or the queue is full."""
        with self._lock:
            if (self._thread is None or tokens in self._pending or self._index.find(tokens) is not None
                    or self._index.covering(tokens) is not None):
                return False
            if snapshot.num_bytes > self.budget_bytes or not writable(snapshot):
                self._counts["num_not_written"] += 1
                return False
            if self._pending and sum(self._pending.values()) + snapshot.num_bytes > MAX_PENDING_BYTES:
                self._counts["num_writes_dropped"] += 1
                return False
            self._pending[tokens] = snapshot.num_bytes
        self._queue.put((tokens, snapshot))
        return True

    def _write_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            tokens, snapshot = job
            try:
                self._write(tokens, snapshot)
            except Exception as e:  # noqa: BLE001 - a disk that is full or gone costs the entry, not the server
                log.warning("prefix_disk_write_failed", error_type=type(e).__name__, error=str(e),
                            num_tokens=len(tokens))
                self._count("num_errors")
            finally:
                with self._idle:
                    self._pending.pop(tokens, None)
                    self._idle.notify_all()

    def _write(self, tokens: tuple[int, ...], snapshot: Snapshot) -> None:
        metadata = {"format": FORMAT, "identity": self.key, "tokens": encode_tokens(tokens),
                    "trimmable": "1" if snapshot.trimmable else "0"}
        temp = self.folder / f"{TEMP_PREFIX}{uuid.uuid4().hex}{SUFFIX}"
        with self._lock:  # room first: the folder stays within its bound while the file is written, too
            self._fit(snapshot.num_bytes + len(metadata["tokens"]) + HEADER_RESERVE_BYTES)
        try:
            save_snapshot(temp, snapshot, metadata)
            final = self.folder / f"{file_digest(temp)}{SUFFIX}"
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        num_bytes = final.stat().st_size
        with self._lock:
            if self._index.find(tokens) is not None:
                return
            self._add(tokens, final.name, num_bytes, snapshot.trimmable)
            self._counts["num_writes"] += 1
            self._counts["num_bytes_written"] += num_bytes
            self._fit(0)

    # ---- the index (callers hold the lock) ----

    def _add(self, tokens: tuple[int, ...], name: str, num_bytes: int, trimmable: bool) -> None:
        entry_id = self._index.add(tokens, trimmable=trimmable)
        self._files[entry_id] = (name, num_bytes)
        self.num_bytes += num_bytes
        if trimmable:  # a longer trimmable entry serves every prefix of it
            for shorter in self._index.strict_prefixes(tokens):
                self._delete(shorter)

    def _fit(self, num_bytes: int) -> None:
        """Delete least recently used files until ``num_bytes`` more fit the budget."""
        for victim in self._index.victims():
            if self.num_bytes + num_bytes <= self.budget_bytes:
                break
            self._delete(victim)
            self._counts["num_evictions"] += 1

    def _delete(self, entry_id: int) -> None:
        name, _ = self._files[entry_id]
        self._forget(entry_id)
        (self.folder / name).unlink(missing_ok=True)

    def _forget(self, entry_id: int) -> None:
        if entry_id in self._files:
            _, num_bytes = self._files.pop(entry_id)
            self.num_bytes -= num_bytes
            self._index.remove(entry_id)

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    # ---- reports and clearing ----

    def discard(self, tokens: tuple[int, ...]) -> bool:
        """Delete the file of the entry whose tokens are exactly ``tokens``; returns whether there was one."""
        with self._lock:
            entry_id = self._index.find(tokens)
            if entry_id is None:
                return False
            self._delete(entry_id)
            return True

    def clear(self) -> None:
        """Delete every file of this identity (writes queued still land)."""
        with self._lock:
            for entry_id in list(self._files):
                self._delete(entry_id)

    def stats(self) -> dict[str, Any]:
        """Entries, bytes against the budget, hits and misses of lookups that reached the disk, bytes read and
        written, files rejected or failed (errors), evictions and writes pending, dropped or not possible."""
        with self._lock:
            return {
                "folder": str(self.folder), "num_entries": len(self._files), "num_bytes": self.num_bytes,
                "budget_bytes": self.budget_bytes, "num_pending_writes": len(self._pending),
                "read_s": round(self._read_s, 3),
                **{k: self._counts[k] for k in ("num_hits", "num_misses", "num_bytes_read", "num_writes",
                                                "num_bytes_written", "num_errors", "num_evictions",
                                                "num_writes_dropped", "num_not_written")},
            }


def make_disk_tier(config: Any, model: Any) -> DiskTier | None:
    """The disk tier ``[engine] prefix_cache_dir`` asks for (None when it is empty), opened: its index rebuilt from
    the folder and its writer started. Runs on the engine thread (the weights digest reads the model)."""
    if not config.prefix_cache_dir:
        return None
    identity = {"weights": weights_digest(model), "kv_bits": config.kv_bits or 16,
                "kv_group_size": config.kv_group_size if config.kv_bits else None,
                "max_kv_size": config.max_kv_size, "byteorder": sys.byteorder}
    tier = DiskTier(config.prefix_cache_dir, config.prefix_cache_disk_bytes, identity)
    try:
        tier.open()
    except OSError as e:
        raise ConfigError(f"engine.prefix_cache_dir: cannot use {tier.folder}: {e.strerror or e}") from e
    return tier
