"""One memory budget for several models at run time ([server] models_memory_bytes): their engines' rows start only
while every loaded model's weights and every engine's KV reservations fit it together; a row that does not fit waits
until another model's rows end, and one that cannot fit beside the other models' weights gets 503."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from mlxd.models_budget import KVLedger
from tests.helpers import app_client, sse_events, streamed_text
from tests.test_models_registry import PROMPT, solo_text, two_models, weight_files


@pytest.fixture(scope="module")
def other_model_dir(tiny_models_root: Path) -> Path:
    from tests.support.tiny import tiny_model_cached

    return tiny_model_cached(tiny_models_root, "llama", seed=1)


@pytest.fixture(scope="module")
def solo_runs(tmp_path_factory, tiny_model_dir, other_model_dir) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("solo_budget")
    return {"a": solo_text(tmp, tiny_model_dir), "b": solo_text(tmp, other_model_dir)}


class Slot:
    """What the ledger reads of a model slot: whether it holds memory, and its weights."""

    def __init__(self, weights: int, holds_memory: bool = True) -> None:
        self.weights, self.holds_memory = weights, holds_memory

    def expected_bytes(self) -> int:
        return self.weights


def test_the_ledger_grants_claims_within_the_budget_beside_every_loaded_model_s_weights():
    a, b, unloaded = Slot(100), Slot(200), Slot(10_000, holds_memory=False)
    ledger = KVLedger(1000, [a, b, unloaded])
    share_a, share_b = ledger.share("a"), ledger.share("b")
    assert share_a.claim(500)  # 300 of weights + 500
    assert not share_b.claim(201)  # 300 + 500 + 201 > 1000
    assert share_b.claim(200)
    assert ledger.num_reserved_bytes() == 700
    assert share_a.claim(400)  # less than it holds: never refused
    assert share_b.claim(300)
    assert not share_a.claim(401)
    assert share_a.claim(0)  # its rows ended and nothing of it waits any more
    assert share_b.claim(700) and not share_b.claim(701)
    assert share_a.fits_alone(700) and not share_a.fits_alone(701)  # beside the weights alone
    ledger.forget("b")  # unloaded: b reserves nothing (its weights still count while it holds memory)
    assert ledger.num_reserved_bytes() == 0
    b.holds_memory = False
    assert share_a.claim(900) and not share_a.claim(901)


def test_the_ledger_serves_waiting_models_first_come_first_served():
    ledger, now = KVLedger(1000, [Slot(0)]), [0.0]
    ledger.clock = lambda: now[0]
    a, b, c = ledger.share("a"), ledger.share("b"), ledger.share("c")
    assert a.claim(600)
    assert not b.claim(600)  # b waits from t=0
    now[0] = 0.5
    assert not a.claim(700)  # a's rows would take what b waits for: refused although 700 fit beside b's 0
    a.settle(300)  # a's rows end
    assert not c.claim(200)  # c came later: b's 600 first (300 + 600 + 200 > 1000)
    assert b.claim(600) and ledger.reserved == {"a": 300, "b": 600}
    assert c.claim(100)  # b no longer waits; c (waiting since t=0.5) fits
    c.settle(0)
    assert not c.claim(200)  # 900 held: c waits again, from now
    now[0] = 1.0
    assert not b.claim(700)  # b asks later than c waits: it leaves c's 200 (it would not fit anyway)
    now[0] = 4.0  # c gave up (its request ended) more than WAITER_TTL_S ago: it holds nobody back
    a.settle(0)
    assert b.claim(700)


def test_the_scheduler_keeps_a_row_the_shared_budget_refuses_waiting_until_room_is_settled():
    from mlxd.engine.schedule.scheduler import Scheduler, SequenceState

    ledger = KVLedger(1000, [Slot(0)])
    other = ledger.share("other")
    assert other.claim(700)  # another model's rows
    scheduler = Scheduler(max_running=4, max_waiting=4, step_token_budget=64, kv_budget_bytes=1000)
    scheduler.shared = ledger.share("me")
    for i in range(2):
        scheduler.add(SequenceState(f"r{i}", num_prompt_tokens=8, prefill_chunk=8, max_tokens=4, num_kv_bytes=200))
    plan = scheduler.schedule()  # its own budget holds 5 rows; beside the other's 700 one fits
    assert [s.request_id for s, _ in plan.prefill] == ["r0"] and scheduler.num_waiting == 1
    assert ledger.reserved == {"other": 700, "me": 200}
    scheduler.on_prefilled(plan.prefill[0][0], 8)
    assert scheduler.schedule().prefill == [] and ledger.reserved["me"] == 200  # r1 still waits
    other.settle(300)  # the other model's rows end
    plan = scheduler.schedule()
    assert [s.request_id for s, _ in plan.prefill] == ["r1"] and ledger.reserved["me"] == 400
    scheduler.remove("r0")
    scheduler.remove("r1")
    assert ledger.reserved["me"] == 0


def row_bytes(daemon, name: str, num_tokens: int) -> int:
    engine = daemon.models.resolve(name).engine
    return engine.memory.kv.num_bytes(num_tokens, engine.config.prefill_chunk)


def test_two_busy_models_keep_their_kv_reservations_within_the_budget_and_answer_as_alone(
        tmp_path, tiny_model_dir, other_model_dir, solo_runs):
    """Budget: both models' weights plus room for 2.5 rows; 8 streams on each model. At every sampled moment the
    weights and the reservations of both engines fit the budget; rows did wait for each other; every answer equals
    the model's solo run."""
    probe = two_models(tmp_path, tiny_model_dir, other_model_dir, b_extra='load = "at_start"')
    with app_client(probe) as (_, daemon):
        row = max(row_bytes(daemon, name, 32) for name in ("a", "b"))  # the short prompt + 12 tokens: one step
    budget = weight_files(tiny_model_dir) + weight_files(other_model_dir) + 2 * row + row // 2
    config = two_models(tmp_path, tiny_model_dir, other_model_dir, b_extra='load = "at_start"\npin = true',
                        a_extra="pin = true", server_extra=f"models_memory_bytes = {budget}")
    with app_client(config) as (client, daemon):
        slots = [daemon.models.resolve(name) for name in ("a", "b")]
        weights = sum(slot.weight_bytes for slot in slots)
        assert 2 * row <= budget - weights < 3 * row  # room for two rows in all, not three
        texts: dict[str, list[str]] = {"a": [], "b": []}
        samples: list[tuple[int, int, int]] = []  # (KV reserved by both, running rows, waiting rows)

        def stream(name: str) -> None:
            for _ in range(2):
                response = client.post("/v1/completions", json={"model": name, "prompt": PROMPT, "stream": True})
                texts[name].append(streamed_text(sse_events(response.text)))

        def watch() -> None:
            deadline = time.monotonic() + 180
            while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
                engines = [slot.engine for slot in slots]
                samples.append((sum(e.memory_bytes()["kv"] for e in engines),
                                sum(e.scheduler.num_running for e in engines),
                                sum(e.scheduler.num_waiting for e in engines)))
                time.sleep(0.002)

        threads = [threading.Thread(target=stream, args=(name,)) for name in ("a", "b") for _ in range(4)]
        watcher = threading.Thread(target=watch)
        for thread in [*threads, watcher]:
            thread.start()
        for thread in [*threads, watcher]:
            thread.join(180)
        assert texts == {"a": [solo_runs["a"]] * 8, "b": [solo_runs["b"]] * 8}
        assert max(kv for kv, _, _ in samples) + weights <= budget
        assert max(running for _, running, _ in samples) == 2  # the budget was used, and never beyond two rows
        assert max(waiting for _, _, waiting in samples) > 0  # rows did wait for room
        assert daemon.models.ledger.num_reserved_bytes() == 0  # every reservation given back


def test_a_request_that_cannot_fit_beside_the_other_model_s_weights_gets_503(tmp_path, tiny_model_dir,
                                                                             other_model_dir):
    probe = two_models(tmp_path, tiny_model_dir, other_model_dir, b_extra='load = "at_start"')
    with app_client(probe) as (_, daemon):
        row = max(row_bytes(daemon, name, 32) for name in ("a", "b"))
    budget = weight_files(tiny_model_dir) + weight_files(other_model_dir) + 2 * row + row // 2
    config = two_models(tmp_path, tiny_model_dir, other_model_dir, b_extra='load = "at_start"',
                        server_extra=f"models_memory_bytes = {budget}")
    with app_client(config) as (client, daemon):
        engine = daemon.models.resolve("a").engine
        max_tokens = 3 * 256 + 100  # four steps of 256 tokens: more than the room beside b's weights
        need = row_bytes(daemon, "a", max_tokens + 8)
        assert need <= engine.memory.kv_budget_bytes  # a alone could hold it: its own admission would wait
        response = client.post("/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": max_tokens})
        assert response.status_code == 503, response.text
        assert "models_memory_bytes" in response.json()["error"]["message"]
        assert float(response.headers["retry-after"]) >= 1
        ok = client.post("/v1/completions", json={"model": "a", "prompt": PROMPT})  # a short one still runs
        assert ok.status_code == 200
