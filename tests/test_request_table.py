"""The request table (mlxd/engine/requests.py), plain Python: what it holds, what each request is told, and when."""

from __future__ import annotations

from typing import Any

from mlxd.engine.base import EngineRequest, Failed, Finished, Token
from mlxd.engine.requests import RequestTable, Submitted
from mlxd.engine.schedule.scheduler import SequenceState


class Handle:
    """Stands in for a RequestHandle: the table only appends ``(handle, event)`` pairs to its outbox."""


def submitted(request_id: str, *, max_tokens: int = 3, stop: frozenset[int] = frozenset(),
              listened: bool = True) -> Submitted:
    request = EngineRequest(request_id=request_id, prompt=[1, 2, 3], max_tokens=max_tokens, stop_token_ids=stop)
    return Submitted(request, Handle() if listened else None, SequenceState.for_request(request))  # type: ignore[arg-type]


def events(table: RequestTable) -> list[tuple[Any, Any]]:
    return list(table._outbox)


def test_held_requests_are_counted_and_let_go_once():
    table = RequestTable()
    a, b = submitted("a"), submitted("b")
    table.pending["c"] = submitted("c")
    table.hold(a)
    table.hold(b)
    assert "a" in table and len(table) == 2 and list(table) == ["a", "b"] and table.num_pending == 1
    assert table.totals["num_requests"] == 2 and table.totals["num_prompt_tokens"] == 6
    assert table.pop("a") is a and table.pop("a") is None and table.get("a") is None
    assert {s.request.request_id for s in table.take_all()} == {"b", "c"}
    assert len(table) == 0 and table.num_pending == 0


def test_tokens_are_emitted_up_to_the_one_that_ends_the_request():
    table = RequestTable()
    row = submitted("a", max_tokens=2)
    # Three tokens in one (speculative) step: the second reaches max_tokens; the third is in the cache, unsent.
    assert table.emit_all(row, [7, 8, 9], None) == ("length", 1)
    assert row.generated == [7, 8, 9] and row.state.num_generated == 2
    assert [event for _, event in events(table)] == [Token(7), Token(8)]
    assert table.totals["num_generated_tokens"] == 2


def test_a_stop_token_ends_the_request_unsent():
    table = RequestTable()
    row = submitted("a", max_tokens=10, stop=frozenset({5}))
    assert table.emit_all(row, [4, 5, 6], [(-0.1, []), (-0.2, []), (-0.3, [])]) == ("stop", 2)
    assert [event for _, event in events(table)] == [Token(4, -0.1, ())]
    assert row.generated == [4, 5, 6] and row.state.num_generated == 1
    assert table.emit_all(submitted("b"), [1], None) == (None, 0)


def test_endings_are_told_to_listeners_only_and_counted():
    table = RequestTable()
    listened, follower = submitted("a"), submitted("b", listened=False)
    table.post_finished(listened, "length")
    table.post_failed(listened, "no", 500, "num_failed")
    table.post_failed(follower, "no", 503, "num_aborted")
    told = [event for _, event in events(table)]
    assert isinstance(told[0], Finished) and told[0].reason == "length" and told[0].num_prompt_tokens == 3
    assert told[1:] == [Failed("no", status=500)]  # nobody listens to a follower's requests
    assert table.totals["num_failed"] == 1 and table.totals["num_aborted"] == 1
    assert table.mean_duration_s is None  # never started: no duration to learn from
