"""GET /metrics: the Prometheus exposition parsed back, its counts checked against what was sent and against
/v1/status and /v1/cache/stats."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from mlxd.api.metrics import Metrics
from mlxd.api.respond import Trace
from mlxd.pipeline.events import Done
from mlxd.pipeline.job import Job
from tests.helpers import SHORT_HITS, app_client, sse_events, write_config

MESSAGES = [{"role": "user", "content": "Tell me about cats."}]


def scrape(client) -> dict[str, list]:
    """Samples by sample name (``mlxd_requests_total``, ``mlxd_ttft_seconds_count``, …)."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        assert family.name.startswith("mlxd_"), family.name
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples, name: str, **labels) -> float:
    found = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def test_counts_match_what_was_sent(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, model_extra="context_length = 512", extra=SHORT_HITS)
    with app_client(config) as (client, _):
        usages = []
        for max_tokens in (6, 8, 8):  # the last two are the same request: a prefix-cache hit
            response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                                  "max_tokens": max_tokens})
            assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
            usages.append(response.json()["usage"])
        before = scrape(client)
        num_chunks = []
        for prompt in ("Once upon a time", "def f(x):"):
            response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                            "stream": True, "stream_options": {"include_usage": True}})
            frames = sse_events(response.text)
            num_chunks.append(sum(1 for f in frames[:-1] if f["choices"] and f["choices"][0]["text"]))
            usages.append(frames[-2]["usage"])
        too_long = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4,
                                                             "messages": [{"role": "user", "content": "word " * 600}]})
        assert too_long.status_code == 400

        samples = scrape(client)
        assert value(samples, "mlxd_requests_total", endpoint="chat", outcome="ok") == 3
        assert value(samples, "mlxd_requests_total", endpoint="completions", outcome="ok") == 2
        assert value(samples, "mlxd_requests_total", endpoint="chat", outcome="error_400") == 1
        assert value(samples, "mlxd_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
        assert value(samples, "mlxd_generated_tokens_total") == sum(u["completion_tokens"] for u in usages)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert cached > 0
        assert value(samples, "mlxd_cached_tokens_total") == cached
        # Every successful request got text: one time to first token each; the refused one has none.
        assert value(samples, "mlxd_ttft_seconds_count") == 5
        assert value(samples, "mlxd_ttft_seconds_bucket", le="+Inf") == 5
        assert 0 < value(samples, "mlxd_ttft_seconds_sum") < 60
        # Streams: one gap between each two consecutive text chunks the client received.
        gaps = value(samples, "mlxd_inter_token_seconds_count") - value(before, "mlxd_inter_token_seconds_count")
        assert gaps == sum(n - 1 for n in num_chunks)

        status, stats = client.get("/v1/status").json(), client.get("/v1/cache/stats").json()
        tiny = {"model": "tiny"}  # engine metrics name their model
        assert value(samples, "mlxd_running", **tiny) == 0 and value(samples, "mlxd_waiting", **tiny) == 0
        for kind in ("exact", "prefix", "longer", "diverged"):
            assert value(samples, "mlxd_prefix_cache_hits_total", kind=kind, **tiny) == stats["hits"][kind]
        assert stats["num_hits"] >= 1
        assert value(samples, "mlxd_prefix_cache_misses_total", **tiny) == stats["num_misses"]
        assert value(samples, "mlxd_prefix_cache_evictions_total", **tiny) == stats["num_evictions"]
        assert value(samples, "mlxd_prefix_cache_bytes", **tiny) == stats["num_bytes"] > 0
        assert value(samples, "mlxd_memory_bytes", kind="active", **tiny) > 0
        assert value(samples, "mlxd_memory_bytes", kind="weights", **tiny) == status["memory"]["weights_bytes"]
        assert value(samples, "mlxd_memory_bytes", kind="limit", **tiny) == status["memory"]["limit_bytes"]


def test_each_app_has_its_own_registry():
    class NoModels:
        def describe(self) -> list:
            return []

        def loaded_engines(self) -> list:
            return []

    class NoEngine:
        engine, state, models = None, "loading", NoModels()

    first, second = Metrics(NoEngine()), Metrics(NoEngine())
    trace = Trace(Job("r1", "tiny"), "chat", started=0.0, first_token=0.5)
    trace.done = Done(finish_reason="stop", num_prompt_tokens=7, num_completion_tokens=3)
    first.observe(trace)
    assert b'mlxd_requests_total{endpoint="chat",outcome="ok"} 1.0' in first.exposition()
    assert b"mlxd_prompt_tokens_total 7.0" in first.exposition()
    assert b"mlxd_requests_total{" not in second.exposition()
    assert b"mlxd_running" not in second.exposition()  # no engine yet: no engine gauges


def test_engine_metrics_have_one_sample_per_loaded_model(tmp_path, tiny_model_dir, tiny_models_root):
    """Two models: mlxd_running, mlxd_waiting, the prefix cache's and memory's gauges carry a sample of each loaded
    model, its own numbers (each engine's); a model not loaded has none."""
    import threading
    import time

    from tests.support.tiny import tiny_model_cached
    from tests.test_models_registry import PROMPT, two_models

    other = tiny_model_cached(tiny_models_root, "llama", seed=1)
    with app_client(two_models(tmp_path, tiny_model_dir, other)) as (client, daemon):
        samples = scrape(client)
        assert {s.labels["model"] for s in samples["mlxd_running"]} == {"a"}  # b is not loaded yet
        for _ in range(2):
            assert client.post("/v1/completions", json={"model": "b", "prompt": PROMPT}).status_code == 200
        a, b = (daemon.models.resolve(name).engine for name in ("a", "b"))
        seen: list[tuple[float, float]] = []  # (a's running, b's running) while a's request runs

        def watch() -> None:
            deadline = time.monotonic() + 60
            while sender.is_alive() and time.monotonic() < deadline:
                scraped = scrape(client)
                seen.append((value(scraped, "mlxd_running", model="a"), value(scraped, "mlxd_running", model="b")))

        sender = threading.Thread(target=lambda: client.post("/v1/completions", json={
            "model": "a", "prompt": PROMPT, "max_tokens": 200}))
        watcher = threading.Thread(target=watch)
        sender.start()
        watcher.start()
        sender.join(120)
        watcher.join(120)
        assert (1, 0) in seen  # a's request counted in a's sample, not in b's
        samples = scrape(client)
        for name, engine in (("a", a), ("b", b)):
            stats, memory = engine.cache_stats(), engine.status()["memory"]
            assert value(samples, "mlxd_waiting", model=name) == 0
            assert value(samples, "mlxd_prefix_cache_bytes", model=name) == stats["num_bytes"] > 0
            assert value(samples, "mlxd_prefix_cache_misses_total", model=name) == stats["num_misses"]
            for kind in ("exact", "prefix", "longer", "diverged"):
                assert value(samples, "mlxd_prefix_cache_hits_total", model=name, kind=kind) == stats["hits"][kind]
            assert value(samples, "mlxd_memory_bytes", model=name, kind="weights") == memory["weights_bytes"]
        misses = {name: value(samples, "mlxd_prefix_cache_misses_total", model=name) for name in ("a", "b")}
        assert misses == {"a": 1, "b": 2}  # each model counts its own lookups: one request to a, two to b


def test_the_batch_histogram_exposes_what_prometheus_clients_histogram_does():
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from mlxd.api.metrics import INTER_TOKEN_BUCKETS, BatchHistogram

    theirs, ours = CollectorRegistry(), CollectorRegistry()
    one_by_one = Histogram("mlxd_inter_token_seconds", "Gaps.", buckets=INTER_TOKEN_BUCKETS, registry=theirs)
    batched = BatchHistogram("mlxd_inter_token_seconds", "Gaps.", INTER_TOKEN_BUCKETS)
    ours.register(batched)
    rng = random.Random(3)
    for _ in range(30):  # values on the bounds too: a bucket counts values at or below its bound
        values = [rng.choice(INTER_TOKEN_BUCKETS + (0.0, 9.0)) if rng.random() < 0.3 else rng.expovariate(40)
                  for _ in range(rng.randrange(1, 60))]
        for v in values:
            one_by_one.observe(v)
        batched.observe_all(values)

    def samples(registry: CollectorRegistry) -> dict[str, float]:
        text = generate_latest(registry).decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if not line.startswith("#")}

    expected, got = samples(theirs), samples(ours)
    assert [line for line in generate_latest(ours).decode().splitlines() if line.startswith("#")] == [
        line for line in generate_latest(theirs).decode().splitlines() if line.startswith("#")]
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        if key.endswith("_sum"):
            assert abs(value - got[key]) < 1e-9 * value, key
        elif not key.endswith("_created"):
            assert value == got[key], key
