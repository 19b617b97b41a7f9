"""A drafter that knows the answer: it proposes a recorded continuation of each prompt (for tests and benchmarks).

Given the target model's own greedy output for a prompt, every draft is accepted: the mechanism's ceiling, with no
drafting cost. Given another continuation, it measures verification with a chosen acceptance pattern.
"""

from __future__ import annotations

from mlxd.engine.drafters.base import DraftRow


class OracleDrafter:
    name = "oracle"
    needs_hidden = False

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        """``continuations``: prompt token ids → the tokens to propose after them."""
        self.continuations = continuations

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        return [self._propose(row) for row in rows]

    def _propose(self, row: DraftRow) -> list[int]:
        for prompt, continuation in self.continuations.items():
            if tuple(row.tokens[: len(prompt)]) == prompt:
                done = len(row.tokens) - len(prompt)
                return continuation[done : done + row.k]
        return []

    def commit(self, request_id: str, num_accepted: int) -> None:
        """Stateless."""

    def release(self, request_id: str) -> None:
        """Stateless."""
