"""Prometheus metrics for ``GET /metrics``, every name prefixed ``mlxd_``.

Two sources: each request's trace, when its log line is written (requests by endpoint and outcome, tokens, time
to first token, gaps between tokens), and each loaded model's engine, read when the metrics are scraped (running and
waiting requests, the prefix cache, memory; one sample per model, labelled ``model``). Each app has its own registry, so several apps in one process (tests) never
share counters.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from mlxd.api.respond import Trace
from mlxd.daemon import Daemon

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CACHE_HIT_KINDS = ("exact", "prefix", "longer", "diverged")


class Metrics:
    """The registry of one app: request metrics fed by :meth:`observe`, engine metrics read on scrape."""

    def __init__(self, daemon: Daemon) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("mlxd_requests", "Requests that reached the pipeline, by endpoint and outcome "
                                "(ok, client_disconnected, error_<status>).", ["endpoint", "outcome"],
                                registry=registry)
        self.prompt_tokens = Counter("mlxd_prompt_tokens", "Prompt tokens of finished requests.", registry=registry)
        self.cached_tokens = Counter("mlxd_cached_tokens", "Prompt tokens of finished requests that the prefix "
                                     "cache supplied.", registry=registry)
        self.generated_tokens = Counter("mlxd_generated_tokens", "Tokens generated for finished requests.",
                                        registry=registry)
        self.ttft = Histogram("mlxd_ttft_seconds", "Seconds from a request's arrival to its first text.",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.inter_token = BatchHistogram("mlxd_inter_token_seconds", "Seconds between consecutive pieces of "
                                          "text sent for a request (one token each, unless the detokenizer held "
                                          "text back).", INTER_TOKEN_BUCKETS)
        registry.register(self.inter_token)
        registry.register(EngineCollector(daemon))
        registry.register(ModelsCollector(daemon))

    def observe(self, trace: Trace) -> None:
        """Count one request from its trace (called as its log line is written)."""
        self.requests.labels(trace.endpoint, trace.result).inc()
        if trace.done is not None:
            self.prompt_tokens.inc(trace.done.num_prompt_tokens)
            self.cached_tokens.inc(trace.done.num_cached_tokens)
            self.generated_tokens.inc(trace.done.num_completion_tokens)
        if trace.first_token is not None:
            self.ttft.observe(trace.first_token - trace.started)
        if trace.gaps:
            self.inter_token.observe_all(trace.gaps)

    def exposition(self) -> bytes:
        """The Prometheus text format of everything in this registry."""
        return generate_latest(self.registry)


class BatchHistogram(Collector):
    """A histogram fed all of a request's values at once, exposed as prometheus_client's ``Histogram`` exposes one
    (buckets, count, sum, created). ``Histogram.observe`` takes a lock and searches the buckets for every value: on
    the event loop, for every gap between a request's tokens, a few microseconds per streamed token; here the
    values are sorted once and each bucket's count found by bisection, under one lock per request."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation, self.bounds = name, documentation, buckets
        self._cumulative = [0] * len(buckets)  # values at or below each bound
        self._count, self._sum = 0, 0.0
        self._created = time.time()
        self._lock = threading.Lock()

    def observe_all(self, values: list[float]) -> None:
        ordered = sorted(values)
        below = [bisect_right(ordered, bound) for bound in self.bounds]
        total = sum(ordered)
        with self._lock:
            self._cumulative = [a + b for a, b in zip(self._cumulative, below, strict=True)]
            self._count += len(ordered)
            self._sum += total

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cumulative, count, total = list(self._cumulative), self._count, self._sum
        buckets = [(floatToGoString(b), float(n)) for b, n in zip(self.bounds, cumulative, strict=True)]
        yield HistogramMetricFamily(self.name, self.documentation, buckets=[*buckets, ("+Inf", float(count))],
                                    sum_value=total)
        yield GaugeMetricFamily(f"{self.name}_created", self.documentation, value=self._created)


class EngineCollector(Collector):
    """Gauges and counters read from each loaded model's engine at scrape time, one sample per model (label
    ``model``); nothing while no engine is loaded."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def describe(self) -> list[Metric]:
        return []  # registering must not read the engine

    def collect(self) -> Iterator[Metric]:
        if self.daemon.state not in ("ready", "draining"):
            return
        engines = self.daemon.models.loaded_engines()
        if not engines:
            return
        running = GaugeMetricFamily("mlxd_running", "Requests in the running batch (prefilling or decoding).",
                                    labels=["model"])
        waiting = GaugeMetricFamily("mlxd_waiting", "Requests waiting for a running slot.", labels=["model"])
        memory = GaugeMetricFamily("mlxd_memory_bytes", "Memory by kind: active, peak and cache (the MLX "
                                   "allocator, the process's: the same for every model), limit, weights, "
                                   "kv_reserved, kv_fixed, prefix_cache (the model's admission).",
                                   labels=["model", "kind"])
        caches = CacheFamilies()
        for name, engine in engines:
            status = engine.status()
            running.add_metric([name], len(status["running"]))
            waiting.add_metric([name], len(status["waiting"]))
            for key, value in status["memory"].items():
                if key.endswith("_bytes") and isinstance(value, int | float):
                    memory.add_metric([name, key.removesuffix("_bytes")], value)
            caches.add(name, engine.cache_stats())
        yield from (running, waiting, *caches.families(), memory)


class ModelsCollector(Collector):
    """Each configured model's state, memory, requests, loads and unloads (``mlxd.registry``), read at scrape time."""

    STATES = ("unloaded", "loading", "ready", "failed")

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        models = self.daemon.models.describe()
        state = GaugeMetricFamily("mlxd_model_state", "1 for each model's state (unloaded, loading, ready, failed).",
                                  labels=["model", "state"])
        memory = GaugeMetricFamily("mlxd_model_memory_bytes", "Each loaded model's memory: weights, kv (its running "
                                   "requests' cache reservations), prefix_cache, held (the three, as [server] "
                                   "models_memory_bytes counts them), and active (the MLX active memory its load "
                                   "added).", labels=["model", "kind"])
        counters = {key: CounterMetricFamily(f"mlxd_model_{key}", f"Each model's {key} since start.", labels=["model"])
                    for key in ("requests", "loads", "unloads")}
        active = GaugeMetricFamily("mlxd_model_active", "Each model's requests in its engine.", labels=["model"])
        for model in models:
            name = model["name"]
            for each in self.STATES:
                state.add_metric([name, each], 1 if model["state"] == each else 0)
            memory.add_metric([name, "weights"], model["weight_bytes"] if model["state"] == "ready" else 0)
            memory.add_metric([name, "kv"], model["kv_bytes"])
            memory.add_metric([name, "prefix_cache"], model["prefix_cache_bytes"])
            memory.add_metric([name, "held"], model["memory_bytes"])
            memory.add_metric([name, "active"], model["active_bytes"])
            for key, family in counters.items():
                family.add_metric([name], model[f"num_{key}"])
            active.add_metric([name], model["num_active"])
        yield from (state, memory, active, *counters.values())


DISK_COUNTERS = (
    ("hits", "Prefix-cache lookups served from a file of the disk tier."),
    ("misses", "Prefix-cache lookups that reached the disk tier and found nothing better than memory."),
    ("bytes_read", "Bytes of files the disk tier read for lookups."),
    ("bytes_written", "Bytes of files the disk tier wrote."),
    ("errors", "Disk-tier files rejected (torn, truncated, altered, another model's) or not written."),
    ("evictions", "Disk-tier files deleted to stay within prefix_cache_disk_bytes."),
)


class CacheFamilies:
    """The prefix cache's metrics (and its disk tier's, [engine] prefix_cache_dir, for models that have one), one
    sample per model."""

    def __init__(self) -> None:
        labels = ["model"]
        self.bytes = GaugeMetricFamily("mlxd_prefix_cache_bytes", "Bytes of prompt state the prefix cache holds.",
                                       labels=labels)
        self.hits = CounterMetricFamily("mlxd_prefix_cache_hits", "Prefix-cache hits by kind: exact, prefix (a "
                                        "shorter cached prompt), longer (trimmed back), diverged (a shared start).",
                                        labels=["model", "kind"])
        self.misses = CounterMetricFamily("mlxd_prefix_cache_misses", "Prefix-cache lookups that found nothing to "
                                          "reuse.", labels=labels)
        self.evictions = CounterMetricFamily("mlxd_prefix_cache_evictions", "Prefix-cache entries evicted to stay "
                                             "within the budget.", labels=labels)
        self.disk_bytes = GaugeMetricFamily("mlxd_prefix_disk_bytes", "Bytes of files the prefix cache's disk tier "
                                            "holds.", labels=labels)
        self.disk_entries = GaugeMetricFamily("mlxd_prefix_disk_entries", "Entries the prefix cache's disk tier "
                                              "holds.", labels=labels)
        self.disk = {key: CounterMetricFamily(f"mlxd_prefix_disk_{key}", documentation, labels=labels)
                     for key, documentation in DISK_COUNTERS}
        self.num_disk = 0

    def add(self, model: str, stats: dict[str, Any]) -> None:
        self.bytes.add_metric([model], stats.get("num_bytes", 0))
        for kind in CACHE_HIT_KINDS:
            self.hits.add_metric([model, kind], stats.get("hits", {}).get(kind, 0))
        self.misses.add_metric([model], stats.get("num_misses", 0))
        self.evictions.add_metric([model], stats.get("num_evictions", 0))
        disk = stats.get("disk")
        if disk is None:
            return
        self.num_disk += 1
        self.disk_bytes.add_metric([model], disk["num_bytes"])
        self.disk_entries.add_metric([model], disk["num_entries"])
        for key, family in self.disk.items():
            family.add_metric([model], disk[f"num_{key}"])

    def families(self) -> list[Metric]:
        """The families, the disk tier's only where some model has one."""
        disk = [self.disk_bytes, self.disk_entries, *self.disk.values()] if self.num_disk else []
        return [self.bytes, self.hits, self.misses, self.evictions, *disk]
