"""The drafter interface: every way of proposing tokens (prompt lookup, a draft model, MTP heads) is one of these.

The engine calls a drafter on its own thread, once per speculative step, for all the rows that speculate in it
(:meth:`Drafter.propose`); after verification it tells the drafter how many of each row's proposed tokens the model
kept (:meth:`Drafter.commit`), and when a row leaves the batch (:meth:`Drafter.release`). Drafts are deterministic
functions of a row's tokens: verification treats each drafted token as a proposal with probability 1, which keeps
rejection sampling exact at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(slots=True, eq=False)
class DraftRow:
    """One row asking for a draft.

    ``tokens``: the row's whole sequence so far (prompt, then every generated token), ending with the token it
    feeds next, which the target model has not seen yet. ``k``: propose at most this many tokens. ``hidden``: the
    target's last hidden state for this row (``(1, hidden_size)``), for drafters with ``needs_hidden``; else None.
    """

    request_id: str
    tokens: list[int]
    k: int
    hidden: Any = None


class Drafter(Protocol):
    """Proposes tokens for speculative rows. Implementations live beside this module."""

    # The name requests and the config use, shown in the request log line and /v1/status.
    name: str
    # Whether :meth:`propose` needs the target's hidden states (MTP heads).
    needs_hidden: bool

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        """For each row, at most ``row.k`` tokens (possibly none) that are likely to follow ``row.tokens``."""

    def commit(self, request_id: str, num_accepted: int) -> None:
        """Of the tokens last proposed for this row, the model kept the first ``num_accepted``."""

    def release(self, request_id: str) -> None:
        """The row has left the batch: drop whatever is kept for it."""
