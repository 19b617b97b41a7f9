"""Prompt lookup: draft the tokens that followed the last earlier occurrence of the row's latest n-gram.

No model runs: agents that edit code or quote documents repeat long spans of their context, and those spans come
back as accepted drafts. Each row keeps an index from n-gram (``ngram_min`` to ``ngram_max`` tokens) to where its
latest occurrence ended, extended incrementally as the row grows, so a step costs a few dictionary lookups however
long the context is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxd.engine.drafters.base import DraftRow


@dataclass(slots=True, eq=False)
class _Index:
    """N-gram → the position right after its latest occurrence that has a token following it."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # positions < indexed are in ``ends``


class PromptLookupDrafter:
    name = "prompt_lookup"
    needs_hidden = False

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self._rows: dict[str, _Index] = {}

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        return [self._propose(row) for row in rows]

    def _propose(self, row: DraftRow) -> list[int]:
        tokens = row.tokens
        index = self._rows.setdefault(row.request_id, _Index())
        self._extend(index, tokens)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            end = index.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + row.k]
        return []

    def _extend(self, index: _Index, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (so that a token follows it)."""
        limit = len(tokens) - 1
        for end in range(max(index.indexed, self.ngram_min), limit + 1):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                index.ends[tuple(tokens[end - n : end])] = end
        index.indexed = max(index.indexed, limit + 1)

    def commit(self, request_id: str, num_accepted: int) -> None:
        """Nothing to roll back: the index only ever holds tokens the row has emitted."""

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
