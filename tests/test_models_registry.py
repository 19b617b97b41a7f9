"""Several models in one daemon ([models.NAME]): each answers as it does alone, loads on its first request, unloads
when idle (its memory given back) or to make room under a memory budget, and streams beside the other."""

from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path

import pytest

from tests.helpers import app_client, sse_events, streamed_text, write_config

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def second_model_dir(tiny_models_root: Path) -> Path:
    """A tiny llama like ``tiny_model_dir`` but from another seed: other weights, other outputs."""
    from tests.support.tiny import tiny_model_cached

    return tiny_model_cached(tiny_models_root, "llama", seed=1)


def two_models(tmp: Path, a: Path, b: Path, *, b_extra: str = "", a_extra: str = "", server_extra: str = "") -> Path:
    sampling = "temperature = 0.0\nmax_tokens = 12\n"
    text = f"""[server]
keepalive_s = 0.5
{server_extra}
[engine]
max_running = 4
[models.a]
source = "{a}"
{a_extra}
[models.a.sampling]
{sampling}
[models.b]
source = "{b}"
aliases = ["gpt-*"]
{b_extra}
[models.b.sampling]
{sampling}
[logging]
format = "json"
"""
    path = tmp / "two.toml"
    path.write_text(text)
    return path


def complete(client, model: str, prompt: str = PROMPT) -> tuple[int, dict]:
    response = client.post("/v1/completions", json={"model": model, "prompt": prompt})
    return response.status_code, response.json()


@pytest.fixture(scope="module")
def row(tmp_path_factory, tiny_model_dir) -> int:
    """Bytes of KV one request of these tests reserves (both models share a shape): a budget must leave room
    for one such row beside the loaded models' weights for a request to start (mlxd.models_budget.KVLedger)."""
    folder = tmp_path_factory.mktemp("row")
    with app_client(write_config(folder, tiny_model_dir, model_extra="")) as (_, daemon):
        engine = daemon.engine
        return engine.memory.kv.num_bytes(32, engine.config.prefill_chunk)


def fill_prefix_cache(client) -> None:
    """Two prompts to model a: its prefix cache keeps an entry of each, more than one row of KV holds."""
    for prompt in (PROMPT, "A different story begins"):
        status, _ = complete(client, "a", prompt)
        assert status == 200


def solo_text(tmp: Path, model_dir: Path) -> str:
    """The completion a one-model daemon gives (greedy, the same max_tokens)."""
    folder = tmp / model_dir.name
    folder.mkdir()
    with app_client(write_config(folder, model_dir, model_extra="", extra="[engine]\nmax_running = 4\n")) as (c, _):
        response = c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 12})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]


def states(client) -> dict[str, str]:
    return {card["id"]: card["state"] for card in client.get("/v1/models").json()["data"]}


@pytest.fixture(scope="module")
def solo(tmp_path_factory, tiny_model_dir, second_model_dir) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("solo")
    return {"a": solo_text(tmp, tiny_model_dir), "b": solo_text(tmp, second_model_dir)}


def test_each_model_answers_as_it_does_alone_and_the_second_loads_on_request(tmp_path, tiny_model_dir,
                                                                             second_model_dir, solo):
    assert solo["a"] != solo["b"]  # the two models differ, so a request that reached the wrong one would show
    with app_client(two_models(tmp_path, tiny_model_dir, second_model_dir)) as (client, daemon):
        assert states(client) == {"a": "ready", "b": "unloaded"}
        health = client.get("/health")  # serving once the models loaded at start are ready
        assert health.status_code == 200 and health.json()["models"] == {"a": "ready", "b": "unloaded"}
        status, body = complete(client, "a")
        assert status == 200 and body["choices"][0]["text"] == solo["a"] and body["model"] == "a"
        assert states(client)["b"] == "unloaded"
        status, body = complete(client, "gpt-4o")  # b's alias: b loads on its first request
        assert status == 200, body
        assert body["choices"][0]["text"] == solo["b"] and body["model"] == "b"
        assert states(client) == {"a": "ready", "b": "ready"}
        status, body = complete(client, "a")
        assert status == 200 and body["choices"][0]["text"] == solo["a"]
        missing = client.post("/v1/completions", json={"model": "c", "prompt": PROMPT})
        assert missing.status_code == 404 and "'a', 'b'" in missing.json()["error"]["message"]
        assert [slot.num_loads for slot in daemon.models.slots] == [1, 1]
        models = {m["name"]: m for m in client.get("/v1/status").json()["models"]}
        assert [(models[n]["state"], models[n]["num_requests"]) for n in "ab"] == [("ready", 2), ("ready", 1)]
        assert models["b"]["weight_bytes"] == daemon.models.resolve("b").weight_bytes > 100_000
        metrics = client.get("/metrics").text
        assert 'mlxd_model_state{model="b",state="ready"} 1.0' in metrics
        assert 'mlxd_model_requests_total{model="a"} 2.0' in metrics
        assert f'mlxd_model_memory_bytes{{kind="weights",model="b"}} {float(models["b"]["weight_bytes"])}' in metrics


def test_the_request_log_line_names_its_model(tmp_path, tiny_model_dir, second_model_dir):
    from structlog.testing import capture_logs

    with app_client(two_models(tmp_path, tiny_model_dir, second_model_dir)) as (client, _), capture_logs() as logs:
        assert complete(client, "gpt-4")[0] == 200  # b, by its alias
        deadline = time.monotonic() + 5
        while not [e for e in logs if e["event"] == "request"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [e["model"] for e in logs if e["event"] == "request"] == ["b"]
        assert [e["model"] for e in logs if e["event"] == "model_loaded"] == ["b"]


def test_an_idle_model_is_unloaded_and_its_memory_given_back(tmp_path, tiny_model_dir, second_model_dir, solo):
    import mlx.core as mx

    config = two_models(tmp_path, tiny_model_dir, second_model_dir, b_extra="idle_unload_s = 1")
    with app_client(config) as (client, daemon):
        status, body = complete(client, "b")
        assert status == 200 and body["choices"][0]["text"] == solo["b"]
        slot = daemon.models.resolve("b")
        weights, engine = slot.weight_bytes, weakref.ref(slot.engine)
        assert weights > 100_000
        loaded = mx.get_active_memory()
        deadline = time.monotonic() + 15
        while states(client)["b"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert states(client) == {"a": "ready", "b": "unloaded"}
        time.sleep(0.2)  # the engine thread is joined and the memory freed after the state turns
        unloaded = mx.get_active_memory()
        assert engine() is None  # nothing keeps the unloaded model's engine (and its model) alive
        assert loaded - unloaded >= weights, (loaded, unloaded, weights)
        status, body = complete(client, "b")  # and it comes back on request
        assert status == 200 and body["choices"][0]["text"] == solo["b"]
        assert (slot.num_loads, slot.num_unloads) == (2, 1)


def test_a_budget_for_one_model_swaps_them_and_every_request_succeeds(tmp_path, tiny_model_dir, second_model_dir,
                                                                     solo):
    one = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    config = two_models(tmp_path, tiny_model_dir, second_model_dir,
                        server_extra=f"models_memory_bytes = {int(one * 1.5)}")
    with app_client(config) as (client, daemon):
        for name in ["b", "a", "b", "a"]:
            status, body = complete(client, name)
            assert status == 200, body
            assert body["choices"][0]["text"] == solo[name]
            other = "a" if name == "b" else "b"
            assert states(client) == {name: "ready", other: "unloaded"}
        assert [slot.num_loads for slot in daemon.models.slots] == [3, 2]


def test_a_model_that_cannot_fit_gets_503_with_retry_after(tmp_path, tiny_model_dir, second_model_dir):
    one = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    config = two_models(tmp_path, tiny_model_dir, second_model_dir, a_extra="pin = true",
                        server_extra=f"models_memory_bytes = {int(one * 1.5)}")
    with app_client(config) as (client, daemon):
        assert complete(client, "a")[0] == 200
        cached = daemon.models.resolve("a").engine.reuse.num_bytes
        assert cached > 0
        response = client.post("/v1/chat/completions",
                               json={"model": "b", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 503 and float(response.headers["retry-after"]) > 0
        error = response.json()["error"]
        assert "models_memory_bytes" in error["message"] and "'a'" in error["message"]
        assert states(client) == {"a": "ready", "b": "unloaded"}  # the pinned model stays
        # with its prefix cache: giving it back could not have made room for b's weights
        assert daemon.models.resolve("a").engine.reuse.num_bytes == cached


def test_two_models_streaming_at_once_each_equal_its_solo_run(tmp_path, tiny_model_dir, second_model_dir, solo):
    config = two_models(tmp_path, tiny_model_dir, second_model_dir, b_extra='load = "at_start"')
    with app_client(config) as (client, daemon):
        turn = daemon.models.first.hooks.turn
        holders: list[str] = []
        turn.on_turn = holders.append
        texts: dict[str, list[str]] = {"a": [], "b": []}

        def stream(name: str) -> None:
            for _ in range(3):
                response = client.post("/v1/completions", json={"model": name, "prompt": PROMPT, "stream": True})
                texts[name].append(streamed_text(sse_events(response.text)))

        seen: set[str] = set()  # the models /v1/status listed running requests of, while both streamed

        def watch() -> None:
            while any(thread.is_alive() for thread in threads):
                seen.update(entry["model"] for entry in client.get("/v1/status").json()["running"])
                time.sleep(0.01)

        threads = [threading.Thread(target=stream, args=(name,)) for name in ("a", "b")]
        watcher = threading.Thread(target=watch)
        for thread in [*threads, watcher]:
            thread.start()
        for thread in [*threads, watcher]:
            thread.join(120)
        assert texts == {"a": [solo["a"]] * 3, "b": [solo["b"]] * 3}
        assert set(holders) == {"a", "b"}  # both engines stepped, each step under the device's turn
        assert seen == {"a", "b"}  # /v1/status lists every model's running requests, each naming its model


def test_a_model_that_fails_to_load_gets_503_and_the_others_keep_serving(tmp_path, tiny_model_dir, solo):
    missing = tmp_path / "no-such-model"
    with app_client(two_models(tmp_path, tiny_model_dir, missing)) as (client, daemon):
        for _ in range(2):  # each request tries again
            response = client.post("/v1/completions", json={"model": "b", "prompt": PROMPT})
            assert response.status_code == 503 and "retry-after" in response.headers
            assert "'b' could not be loaded" in response.json()["error"]["message"]
        assert states(client) == {"a": "ready", "b": "failed"}
        assert daemon.ready and client.get("/health").status_code == 200
        status, body = complete(client, "a")
        assert status == 200 and body["choices"][0]["text"] == solo["a"]


def test_requests_that_arrive_together_for_an_unloaded_model_share_one_load(tmp_path, tiny_model_dir,
                                                                            second_model_dir, solo):
    with app_client(two_models(tmp_path, tiny_model_dir, second_model_dir)) as (client, daemon):
        results: list[tuple[int, dict]] = []
        threads = [threading.Thread(target=lambda: results.append(complete(client, "b"))) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert [(status, body["choices"][0]["text"]) for status, body in results] == [(200, solo["b"])] * 3
        assert daemon.models.resolve("b").num_loads == 1


def test_the_least_recently_used_idle_model_makes_room(tmp_path, tiny_models_root, tiny_model_dir, second_model_dir):
    from tests.support.tiny import tiny_model_cached

    third = tiny_model_cached(tiny_models_root, "llama", seed=2)
    one = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    # Two models with their caches and a running request fit (2.4 weights' worth), three do not.
    config = two_models(tmp_path, tiny_model_dir, second_model_dir, server_extra=f"models_memory_bytes = {int(one * 3.2)}")
    config.write_text(config.read_text().replace("[logging]", f'[models.c]\nsource = "{third}"\n[logging]'))
    with app_client(config) as (client, _):
        for name in ["b", "a"]:  # b is used before a: the least recently used
            assert complete(client, name)[0] == 200
        assert states(client) == {"a": "ready", "b": "ready", "c": "unloaded"}
        assert complete(client, "c")[0] == 200
        assert states(client) == {"a": "ready", "b": "unloaded", "c": "ready"}


def weight_files(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def test_the_budget_counts_each_model_s_prefix_cache_beside_its_weights(tmp_path, tiny_model_dir, second_model_dir,
                                                                       solo):
    """Both models' weights fit the budget, but not beside a's prefix cache: b's load unloads a, which a count of
    weights alone would have kept; /v1/status and /metrics show what each model holds."""
    budget = weight_files(tiny_model_dir) + weight_files(second_model_dir) + 4096
    config = two_models(tmp_path, tiny_model_dir, second_model_dir, server_extra=f"models_memory_bytes = {budget}")
    with app_client(config) as (client, daemon):
        status, body = complete(client, "a")
        assert status == 200 and body["choices"][0]["text"] == solo["a"]
        a = daemon.models.resolve("a")
        assert a.engine.memory.limit_bytes == budget  # its own admission: never more than all models may hold
        prefix = a.engine.reuse.num_bytes
        assert prefix > 4096 + weight_files(tiny_model_dir) - a.weight_bytes  # what makes the two not fit
        model = {m["name"]: m for m in client.get("/v1/status").json()["models"]}["a"]
        assert (model["prefix_cache_bytes"], model["kv_bytes"]) == (prefix, 0)  # idle: no request reserves KV
        assert model["memory_bytes"] == a.weight_bytes + prefix
        metrics = client.get("/metrics").text
        assert f'mlxd_model_memory_bytes{{kind="prefix_cache",model="a"}} {float(prefix)}' in metrics
        assert f'mlxd_model_memory_bytes{{kind="held",model="a"}} {float(a.weight_bytes + prefix)}' in metrics
        status, body = complete(client, "b")
        assert status == 200 and body["choices"][0]["text"] == solo["b"]
        assert states(client) == {"a": "unloaded", "b": "ready"}
        status = client.get("/v1/status")  # the first model unloaded: the status still answers
        assert status.status_code == 200
        assert {m["name"]: m["memory_bytes"] for m in status.json()["models"]}["a"] == 0


def test_caches_that_grow_past_the_budget_unload_the_least_recently_used_idle_model(tmp_path, tiny_model_dir,
                                                                                   second_model_dir, solo, row):
    budget = weight_files(tiny_model_dir) + weight_files(second_model_dir) + row + 4096
    config = two_models(tmp_path, tiny_model_dir, second_model_dir, b_extra='load = "at_start"',
                        server_extra=f"models_memory_bytes = {budget}")
    with app_client(config) as (client, daemon):
        assert states(client) == {"a": "ready", "b": "ready"}  # the weights alone fit, and a row beside them
        fill_prefix_cache(client)  # a's prefix cache grows past the budget: b, idle, makes room
        status, body = complete(client, "a")
        assert status == 200 and body["choices"][0]["text"] == solo["a"]
        deadline = time.monotonic() + 10
        while states(client)["b"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert states(client) == {"a": "ready", "b": "unloaded"}
        assert daemon.models.held_bytes() <= budget
        status, body = complete(client, "b")  # and b comes back, a (now idle) making room
        assert status == 200 and body["choices"][0]["text"] == solo["b"]
        assert states(client) == {"a": "unloaded", "b": "ready"}


def test_a_pinned_model_s_prefix_cache_makes_room_for_another(tmp_path, tiny_model_dir, second_model_dir, solo,
                                                             row):
    """The weights of both fit (and a row beside them), not beside a's prefix cache; a is pinned: its prefix cache
    gives the room back instead of b getting 503."""
    from structlog.testing import capture_logs

    budget = weight_files(tiny_model_dir) + weight_files(second_model_dir) + row + 4096
    config = two_models(tmp_path, tiny_model_dir, second_model_dir, a_extra="pin = true",
                        server_extra=f"models_memory_bytes = {budget}")
    with app_client(config) as (client, daemon), capture_logs() as logs:
        fill_prefix_cache(client)
        a = daemon.models.resolve("a")
        assert a.engine.reuse.num_bytes > row + 4096 + weight_files(tiny_model_dir) - a.weight_bytes
        status, body = complete(client, "b")
        assert status == 200 and body["choices"][0]["text"] == solo["b"]
        assert states(client) == {"a": "ready", "b": "ready"}
        [shrunk] = [e for e in logs if e["event"] == "prefix_cache_shrunk" and e.get("for_model") == "b"]
        assert shrunk["model"] == "a" and shrunk["for_model"] == "b" and shrunk["freed_bytes"] > 0
        status, body = complete(client, "a")  # a still answers as itself (its prompt computed again)
        assert status == 200 and body["choices"][0]["text"] == solo["a"]


def test_pinned_models_whose_caches_grow_past_the_budget_give_back_prefix_cache(tmp_path, tiny_model_dir,
                                                                               second_model_dir, solo, row):
    budget = weight_files(tiny_model_dir) + weight_files(second_model_dir) + row + 4096
    config = two_models(tmp_path, tiny_model_dir, second_model_dir, a_extra="pin = true",
                        b_extra='load = "at_start"\npin = true', server_extra=f"models_memory_bytes = {budget}")
    with app_client(config) as (client, daemon):
        fill_prefix_cache(client)
        status, body = complete(client, "a")
        assert status == 200 and body["choices"][0]["text"] == solo["a"]
        deadline = time.monotonic() + 10
        while daemon.models.held_bytes() > budget and time.monotonic() < deadline:
            time.sleep(0.1)
        assert daemon.models.held_bytes() <= budget  # the reaper evicted a's entries: both pinned, nothing unloads
        assert states(client) == {"a": "ready", "b": "ready"}


def test_the_prefix_cache_endpoints_cover_every_loaded_model(tmp_path, tiny_model_dir, second_model_dir):
    with app_client(two_models(tmp_path, tiny_model_dir, second_model_dir)) as (client, daemon):
        for name in "ab":
            assert complete(client, name)[0] == 200
        engines = {name: daemon.models.resolve(name).engine for name in "ab"}
        held = {name: engine.reuse.num_bytes for name, engine in engines.items()}
        assert min(held.values()) > 0
        stats = client.get("/v1/cache/stats").json()
        assert {name: s["num_bytes"] for name, s in stats["models"].items()} == held
        cleared = client.delete("/v1/cache").json()
        assert {name: s["num_bytes"] for name, s in cleared["models"].items()} == held  # the stats before
        assert cleared["cleared"]["num_bytes"] == held["a"]
        assert {name: engine.reuse.num_bytes for name, engine in engines.items()} == {"a": 0, "b": 0}
