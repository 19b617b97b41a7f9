"""A radix tree over token ids that says which cached entry serves a prompt, and how.

Plain Python: token ids, counters and ref-counts; the snapshots themselves live in ``mlxd.cache.store``. Every
entry is a token sequence with an id and a flag that says whether its cache can be trimmed (every layer can drop
tokens from its end: plain attention caches can, recurrent states and full rotating windows cannot).

``match`` picks the entry that lets a prompt skip the most tokens, and never more than ``len(prompt) - 1`` (the
model must still see one prompt token to produce logits):

- ``prefix``: the entry's tokens are a prefix of the prompt; used as is. The only kind for non-trimmable entries,
  so a state that includes tokens the prompt does not have is never handed out.
- ``exact``: the entry's tokens are the prompt; trimmed by one token.
- ``longer``: the prompt is a strict prefix of the entry's tokens; trimmed back to the prompt (minus one).
- ``diverged``: entry and prompt share a prefix and then differ; trimmed back to the shared part.

The last three need a trimmable entry. LRU order and ref-counts are kept here too: ``victims`` lists the entries
that may be evicted, least recently used first, leaving out those that are pinned (``acquire``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

MatchKind = Literal["exact", "prefix", "longer", "diverged"]


@dataclass(frozen=True, slots=True)
class Match:
    """An entry that serves a prompt: keep its first ``num_tokens`` tokens (trim ``num_to_trim`` from its end)."""

    entry_id: int
    num_tokens: int
    num_to_trim: int
    kind: MatchKind


@dataclass(eq=False, slots=True)
class _Node:
    key: tuple[int, ...]  # the edge label from the parent
    depth: int  # tokens from the root to the end of this node
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)
    entry_id: int | None = None
    trimmable: bool = False
    num_trimmable: int = 0  # trimmable entries in this subtree, this node included


@dataclass(slots=True)
class _Entry:
    node: _Node
    trimmable: bool
    num_refs: int = 0


def _common_length(key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """How many leading tokens of ``key`` equal ``tokens[start:]``."""
    end = start + len(key)
    if tokens[start:end] == key:  # the usual case, compared at C speed
        return len(key)
    n = 0
    for a, b in zip(key, tokens[start:end], strict=False):
        if a != b:
            break
        n += 1
    return n


def _trim_kind(num_entry_tokens: int, num_shared: int, prompt: tuple[int, ...]) -> MatchKind:
    if num_shared < len(prompt):
        return "diverged"
    return "exact" if num_entry_tokens == len(prompt) else "longer"


class PrefixIndex:
    """Token sequences → entry ids, with match kinds, dominance, LRU order and ref-counts. Not thread-safe."""

    def __init__(self) -> None:
        self._root = _Node(key=(), depth=0)
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._entries

    # ---- lookups ----

    def find(self, tokens: Sequence[int]) -> int | None:
        """The id of the entry whose tokens are exactly ``tokens``, or None."""
        path, partial = self._path(tuple(tokens))
        return path[-1].entry_id if partial is None and path[-1].depth == len(tokens) else None

    def tokens(self, entry_id: int) -> tuple[int, ...]:
        """The token sequence of an entry."""
        parts: list[tuple[int, ...]] = []
        node: _Node | None = self._entries[entry_id].node
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)

    def is_trimmable(self, entry_id: int) -> bool:
        return self._entries[entry_id].trimmable

    def match(self, prompt: Sequence[int], min_tokens: int = 1) -> Match | None:
        """The entry that lets ``prompt`` skip the most tokens (at most ``len(prompt) - 1``), or None, also when
        the most is fewer than ``min_tokens``.

        Ties go to the kind that needs no trimming. Does not touch LRU order (the caller does, on use).
        """
        tokens = tuple(prompt)
        limit = len(tokens) - 1
        if limit < max(1, min_tokens):
            return None
        path, partial = self._path(tokens)
        prefix = next((n for n in reversed(path) if n.entry_id is not None and n.depth <= limit), None)
        num_prefix = prefix.depth if prefix is not None else 0
        subtree, shared = self._deepest_trimmable(path, partial)
        num_trimmed = min(shared, limit) if subtree is not None else 0
        if max(num_trimmed, num_prefix) < min_tokens:
            return None
        if subtree is not None and num_trimmed > num_prefix:
            node = self._shallowest_trimmable(subtree)
            return Match(node.entry_id, num_trimmed, node.depth - num_trimmed, _trim_kind(node.depth, shared, tokens))
        if prefix is not None:
            return Match(prefix.entry_id, num_prefix, 0, "prefix")
        return None

    def strict_prefixes(self, tokens: Sequence[int]) -> list[int]:
        """Ids of the entries whose tokens are a strict prefix of ``tokens`` (shortest first)."""
        tokens = tuple(tokens)
        path, _ = self._path(tokens)
        return [n.entry_id for n in path if n.entry_id is not None and n.depth < len(tokens)]

    def covering(self, tokens: Sequence[int]) -> int | None:
        """A trimmable entry whose tokens strictly extend ``tokens`` (it can stand in for them), or None."""
        tokens = tuple(tokens)
        path, partial = self._path(tokens)
        if partial is not None:
            child, shared = partial
            ends_inside = shared == len(tokens) and child.num_trimmable > 0
            return self._shallowest_trimmable(child).entry_id if ends_inside else None
        if path[-1].depth < len(tokens):
            return None
        child = next((c for c in path[-1].children.values() if c.num_trimmable > 0), None)
        return self._shallowest_trimmable(child).entry_id if child is not None else None

    # ---- changes ----

    def add(self, tokens: Sequence[int], *, trimmable: bool) -> int:
        """Add an entry for ``tokens`` (non-empty, not already present) and return its id (most recently used)."""
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError("an entry needs at least one token")
        node = self._insert_path(tokens)
        if node.entry_id is not None:
            raise ValueError(f"tokens already have entry {node.entry_id}")
        entry_id = self._next_id
        self._next_id += 1
        node.entry_id, node.trimmable = entry_id, trimmable
        self._entries[entry_id] = _Entry(node, trimmable)
        self._lru[entry_id] = None
        if trimmable:
            self._add_trimmable(node, 1)
        return entry_id

    def remove(self, entry_id: int) -> None:
        """Forget an entry (pinned or not); the tree is pruned and re-compressed around it."""
        entry = self._entries.pop(entry_id)
        del self._lru[entry_id]
        node = entry.node
        if entry.trimmable:
            self._add_trimmable(node, -1)
        node.entry_id, node.trimmable = None, False
        self._prune(node)

    def clear(self) -> None:
        """Forget every entry (ids are not reused)."""
        self._root = _Node(key=(), depth=0)
        self._entries.clear()
        self._lru.clear()

    # ---- LRU and ref-counts ----

    def touch(self, entry_id: int) -> None:
        """Mark an entry most recently used."""
        self._lru.move_to_end(entry_id)

    def acquire(self, entry_id: int) -> None:
        """Pin an entry: it is left out of ``victims`` until released as many times."""
        self._entries[entry_id].num_refs += 1

    def release(self, entry_id: int) -> None:
        entry = self._entries[entry_id]
        if entry.num_refs <= 0:
            raise ValueError(f"entry {entry_id} is not pinned")
        entry.num_refs -= 1

    def victims(self) -> list[int]:
        """Unpinned entries, least recently used first."""
        return [e for e in self._lru if self._entries[e].num_refs == 0]

    # ---- tree internals ----

    def _path(self, tokens: tuple[int, ...]) -> tuple[list[_Node], tuple[_Node, int] | None]:
        """Nodes fully matched by ``tokens`` (root first), and the child entered part-way with the shared depth."""
        node, pos, path = self._root, 0, [self._root]
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                return path, None
            n = _common_length(child.key, tokens, pos)
            if n < len(child.key):
                return path, (child, pos + n)
            node, pos = child, pos + n
            path.append(node)
        return path, None

    @staticmethod
    def _deepest_trimmable(path: list[_Node], partial: tuple[_Node, int] | None) -> tuple[_Node | None, int]:
        """The deepest subtree along the prompt's path holding a trimmable entry, and the tokens it shares."""
        if partial is not None and partial[0].num_trimmable > 0:
            return partial
        for node in reversed(path):
            if node.num_trimmable > 0:
                return node, node.depth
        return None, 0

    @staticmethod
    def _shallowest_trimmable(node: _Node) -> _Node:
        """A trimmable entry in the subtree of ``node``, preferring short ones (less to trim)."""
        while not (node.entry_id is not None and node.trimmable):
            node = next(c for c in node.children.values() if c.num_trimmable > 0)
        return node

    def _add_trimmable(self, node: _Node | None, delta: int) -> None:
        while node is not None:
            node.num_trimmable += delta
            node = node.parent

    def _insert_path(self, tokens: tuple[int, ...]) -> _Node:
        """The node that ends exactly at ``tokens``, splitting an edge or adding a leaf where needed."""
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(key=tokens[pos:], depth=len(tokens), parent=node)
                node.children[tokens[pos]] = leaf
                return leaf
            n = _common_length(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        return node

    @staticmethod
    def _split(node: _Node, n: int) -> _Node:
        """Cut ``node``'s edge after ``n`` tokens; returns the new upper node."""
        parent = node.parent
        assert parent is not None
        upper = _Node(key=node.key[:n], depth=node.depth - len(node.key) + n, parent=parent,
                      num_trimmable=node.num_trimmable)
        parent.children[upper.key[0]] = upper
        node.key = node.key[n:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def _prune(self, node: _Node) -> None:
        """Drop entry-less leaves and merge entry-less nodes that have a single child into it."""
        while node is not self._root and node.entry_id is None:
            parent = node.parent
            assert parent is not None
            if not node.children:
                del parent.children[node.key[0]]
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                child.key = node.key + child.key
                child.parent = parent
                parent.children[child.key[0]] = child
            return
