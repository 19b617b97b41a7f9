"""How the batching engine uses the prefix cache: where a prompt starts, and which states are kept.

- On admission, :meth:`PromptReuse.lookup` finds the longest reusable state; prompt processing starts after it.
- During prompt processing, :meth:`PromptReuse.chunk_end` ends a chunk at a checkpoint (the end of the last
  message) for caches that cannot be trimmed, since those can only hit where they were snapshotted; and
  :meth:`PromptReuse.keep_chunk` snapshots the state after every chunk, so a cancelled request (its client left)
  keeps its work and the same request sent again resumes where it stopped. Every model kind whose cache follows
  mlx-lm's protocol is kept this way (attention, sliding-window, quantized, recurrent and hybrid layers); vision
  prompts too, keyed by image digest. Snapshots are entries like any other: counted in the budget, evicted least
  recently used first.
- When a request ends, finished or cancelled, :meth:`PromptReuse.keep` snapshots prompt + generated tokens:
  the next turn of an agent conversation extends exactly that.
- Checkpoints (``EngineRequest.checkpoints``, from the ``template`` stage) are where the last message ends, where
  the system prompt and tools end, the client's cache breakpoints and a ``prompt_cache_key``'s shared prefix: a
  chunk ends at each one when the cache cannot be trimmed, and its snapshot is kept, so a hybrid model's next
  conversation with the same system prompt and tools reuses that whole block.
- A request whose run from a hit fails is retried from the start by the engine; :meth:`PromptReuse.drop_entry`
  drops the entry it started from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxd.cache.prefix_cache import MISS, Hit, PrefixCache
from mlxd.log import get_logger

log = get_logger("mlxd.engine")


def is_trimmable(layers: Sequence[Any]) -> bool:
    return all(layer.is_trimmable() for layer in layers)


class PromptReuse:
    """The engine's prefix cache, or nothing when its budget is 0."""

    def __init__(self, budget_bytes: int, min_tokens: int = 1, align: int = 1) -> None:
        self.cache = PrefixCache(budget_bytes) if budget_bytes > 0 else None
        self.min_tokens = min_tokens
        # A trimmable hit is cut back to a multiple of this many tokens (the engine's: its device's group bucket).
        self.align = align

    def lookup(self, prompt: Sequence[int], *, align: bool = True) -> Hit:
        """The longest state worth reusing: one that covers at least ``min_tokens``. A shorter one (a chat
        template's first tokens, a short system prompt) saves less than it costs: a prompt that starts from a cached
        state runs its rest in a pass with other such rests (:func:`mlxd.engine.step.prompts.process_continuations`),
        not in one pass with the whole prompts arriving with it. With ``align`` (text prompts: an image prompt's
        hit must not end inside an image's tokens) the hit is cut back to a multiple of :attr:`align` tokens
        (:func:`mlxd.cache.prefix_cache._aligned`)."""
        if self.cache is None:
            return MISS
        return self.cache.lookup(prompt, self.min_tokens, self.align if align else 1)

    def keep(self, tokens: Sequence[int], layers: Sequence[Any]) -> None:
        """Snapshot ``layers``, which hold exactly ``tokens`` (batch size 1). A snapshot that cannot be taken (the
        device out of memory) is skipped: it would only have saved a later prefill, so no request and not the
        engine ends with it."""
        if self.cache is None or not layers:
            return
        try:
            self.cache.insert(tokens, layers)
        except ValueError as e:  # a layer that does not hold these tokens: a bug to see, not to serve
            log.warning("prefix_cache_insert_skipped", reason=str(e), num_tokens=len(tokens))
        except Exception as e:  # noqa: BLE001 - reported; whoever asked goes on without the snapshot
            log.warning("prefix_keep_failed", num_tokens=len(tokens), error_type=type(e).__name__, error=str(e))
            mx.clear_cache()  # give back what MLX's allocator holds, for the requests still running

    def keep_chunk(self, key: Sequence[int], start: int, end: int, layers: Sequence[Any], *,
                   checkpoints: Sequence[int] = (), num_cached: int = 0) -> None:
        """Snapshot a prompt's state after the chunk ``[start, end)`` (``layers`` hold ``key[:end]``), so that a
        request whose client leaves keeps the chunks it finished: the same prompt sent again starts after them.

        A trimmable cache's longer snapshot stands in for the shorter one (the cache drops it). One that cannot be
        trimmed (recurrent layers: hybrid models) serves only prompts that extend it, so each snapshot is an entry
        of its own; the request's previous chunk snapshot (``key[:start]``) is then dropped, since the new one
        serves this prompt further and a chunk boundary is no place another prompt is likely to part from it.
        Kept are checkpoints (the end of a message: where the next turn or an edited history parts) and the
        state the request started from (``num_cached``)."""
        self.keep(key[:end], layers)
        if self.cache is None or is_trimmable(layers) or start <= num_cached or start in checkpoints:
            return
        self.cache.discard(key[:start])

    def drop_entry(self, entry: Sequence[int]) -> bool:
        """Drop the entry a request's prompt started from (``Hit.entry``: its tokens), from memory and disk: its
        state failed on use. Returns whether an entry was dropped."""
        return self.cache is not None and bool(entry) and self.cache.discard(entry)

    @staticmethod
    def chunk_end(start: int, num_tokens: int, checkpoints: Sequence[int], trimmable: bool) -> int:
        """How many of the ``num_tokens`` scheduled from ``start`` to process now: stop at a checkpoint inside
        the chunk when the cache cannot be trimmed (a trimmable cache serves any prefix of a longer entry)."""
        if trimmable:
            return num_tokens
        inside = [c for c in checkpoints if start < c < start + num_tokens]
        return min(inside) - start if inside else num_tokens

    @property
    def num_bytes(self) -> int:
        """Bytes the prefix cache holds (0 when it is off)."""
        return self.cache.num_bytes if self.cache is not None else 0

    def shrink(self, num_bytes: int) -> int:
        """Give memory back: evict least recently used entries until at most ``num_bytes`` are held."""
        return self.cache.shrink(max(0, num_bytes)) if self.cache is not None else 0

    def stats(self) -> dict[str, Any]:
        return self.cache.stats() if self.cache is not None else {"enabled": False}

    def clear(self) -> dict[str, Any]:
        before = self.stats()
        if self.cache is not None:
            self.cache.clear()
        return before
