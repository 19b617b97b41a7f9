"""Hostile clients against a real daemon (a subprocess on 127.0.0.1, a tiny vision-language model): six requests
of each kind at once (a 9 MB assistant message, 480,000 empty messages, a 9 MB tool description, bodies of eight
88-megapixel PNGs, 9 MB requests whose clients leave after 0.7 s, a client's own chat template through
``chat_template_kwargs``). Oracles: each is refused in the API's error shape (or its client left); meanwhile
``/health`` answers within 0.5 s and a greedy request gives the output it gives alone within twice its time plus
1 s; afterwards the daemon's RSS is within 300 MB of where it was after warm-up, and SIGTERM ends it within
``drain_timeout_s`` + 5 s, also while preparation workers are stuck in calls that never check for cancellation."""

from __future__ import annotations

import base64
import io
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import Stage
from tests.helpers import CHAT_PIPELINE, ROOT, free_port, serve_subprocess, write_config

NUM_EACH = 6
DRAIN_TIMEOUT_S = 2
NINE_MB = 9 * 1024 * 1024
GREEDY = {"model": "tiny", "messages": [{"role": "user", "content": "Count to five."}], "temperature": 0,
          "max_tokens": 16}
# Three nested loops of 99,999: forever, for a renderer without a deadline.
LOOPING_TEMPLATE = ("{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}"
                    "{% endfor %}{% endfor %}{% endfor %}")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _flat_png(side: int) -> bytes:
    """A ``side`` x ``side`` grey PNG: tiny in bytes (a flat image compresses about 1000:1), huge in pixels."""
    out = io.BytesIO()
    Image.new("L", (side, side), 128).save(out, "PNG", compress_level=9)
    return out.getvalue()


def _hostile_bodies() -> dict[str, tuple[str, bytes, float | None]]:
    """Kind → (path, JSON body, seconds after which the client leaves or None)."""
    filler = "lorem ipsum " * (NINE_MB // 12)
    hi = {"role": "user", "content": "hi"}
    png = "data:image/png;base64," + base64.b64encode(_flat_png(9400)).decode()  # 88.4 MP
    bodies: dict[str, tuple[str, Any, float | None]] = {
        "assistant 9 MB": ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "messages": [
            hi, {"role": "assistant", "content": filler}, hi]}, None),
        "480,000 empty messages": ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "user", "content": ""}] * 480_000}, None),
        "tool description 9 MB": ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "messages": [hi],
                                  "tools": [{"type": "function", "function": {
                                      "name": "f", "description": filler, "parameters": {"type": "object"}}}]}, None),
        "eight 88 MP PNGs": ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}] * 8 + [
                {"type": "text", "text": "describe"}]}]}, None),
        "9 MB, client leaves after 0.7 s": ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [
            hi, {"role": "assistant", "content": filler}, hi]}, 0.7),
        "own chat template": ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "messages": [hi],
                              "chat_template_kwargs": {"chat_template": LOOPING_TEMPLATE}}, None),
    }
    return {kind: (path, json.dumps(body).encode(), leave) for kind, (path, body, leave) in bodies.items()}


def _send(base: str, path: str, body: bytes, leave_after: float | None, out: list) -> None:
    started = time.monotonic()
    try:
        response = httpx.post(base + path, content=body, headers={"content-type": "application/json"},
                              timeout=leave_after or 120)
        out.append((response.status_code, response.json(), time.monotonic() - started))
    except httpx.TimeoutException:
        out.append(("left", None, time.monotonic() - started))


def _greedy(base: str) -> tuple[str, float]:
    started = time.monotonic()
    response = httpx.post(base + "/v1/chat/completions", json=GREEDY, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"], time.monotonic() - started


def test_hostile_requests_starve_nothing_and_memory_comes_back(tiny_vlm, tmp_path):
    port = free_port()
    config = write_config(tmp_path, tiny_vlm("qwen2_5_vl"), port=port, model_extra="context_length = 2048",
                          server_extra=f"drain_timeout_s = {DRAIN_TIMEOUT_S}",
                          extra="[vision]\nwarm_up_image_sizes = []\n")
    bodies = _hostile_bodies()
    with serve_subprocess(config, port) as (base, proc):
        _greedy(base)
        expected, alone_s = _greedy(base)
        warm_rss = _rss_mb(proc.pid)
        results: dict[str, list] = {kind: [] for kind in bodies}
        threads = [threading.Thread(target=_send, args=(base, path, body, leave, results[kind]), daemon=True)
                   for kind, (path, body, leave) in bodies.items() for _ in range(NUM_EACH)]
        attack_started = time.monotonic()
        for thread in threads:
            thread.start()
        health_s: list[float] = []
        greedy: dict[str, Any] = {}
        with httpx.Client(base_url=base, timeout=10) as client:
            while any(thread.is_alive() for thread in threads) or not greedy:
                assert time.monotonic() - attack_started < 120, {k: len(v) for k, v in results.items()}
                started = time.monotonic()
                assert client.get("/health").status_code == 200
                health_s.append(time.monotonic() - started)
                if not greedy and time.monotonic() - attack_started > 0.3:
                    runner = threading.Thread(target=lambda: greedy.update(zip(("text", "s"), _greedy(base), strict=True)))
                    runner.start()
                    greedy["thread"] = runner
                time.sleep(0.05)
            greedy["thread"].join(60)
        attack_s = time.monotonic() - attack_started
        peak_rss = _rss_mb(proc.pid)
        settled = time.monotonic() + 10
        while (after_rss := _rss_mb(proc.pid)) - warm_rss >= 300 and time.monotonic() < settled:
            time.sleep(0.25)
        summary = {kind: sorted({str(r[0]) for r in out}) for kind, out in results.items()}
        slowest = {kind: round(max(r[2] for r in out), 2) for kind, out in results.items()}
        print(f"\nhostile: {len(threads)} requests over {attack_s:.1f} s; statuses {summary}; slowest (s) {slowest}; "
              f"/health max {max(health_s) * 1000:.0f} ms over {len(health_s)} calls; greedy {greedy['s']:.2f} s "
              f"(alone {alone_s:.2f} s); RSS warm {warm_rss:.0f} MB, after the attack {peak_rss:.0f} MB, "
              f"settled {after_rss:.0f} MB")
        for kind, out in results.items():
            assert len(out) == NUM_EACH, (kind, out)
            for status, body, _ in out:
                if status == "left":
                    assert bodies[kind][2] is not None, kind
                    continue
                assert status == 400, (kind, status, str(body)[:300])
        images = results["eight 88 MP PNGs"][0][1]["error"]
        assert images["param"] == "messages[0].content[0]" and "max_decode_pixels" in images["message"], images
        assert max(health_s) < 0.5
        assert greedy["text"] == expected and greedy["s"] <= alone_s * 2 + 1, (greedy, alone_s)
        assert after_rss - warm_rss < 300, (warm_rss, after_rss)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(DRAIN_TIMEOUT_S + 10)
        exit_s = time.monotonic() - signalled
        print(f"SIGTERM: exit {code} after {exit_s:.2f} s (drain_timeout_s = {DRAIN_TIMEOUT_S})")
        assert code == 0 and exit_s < DRAIN_TIMEOUT_S + 5


class Stuck(Stage):
    """Holds a request whose text says STUCK for a minute in one call that never checks for cancellation, as a
    tokenizer call on a huge prompt does."""

    name = "stuck"

    def prepare(self, job: Job) -> None:
        if "STUCK" in json.dumps(job.messages):
            time.sleep(60)


def test_sigterm_exits_in_time_while_preparation_workers_are_stuck(tiny_model_dir, tmp_path):
    (tmp_path / "stuck.toml").write_text(f'[[stages]]\ntype = "{__name__}:Stuck"\n\n' + CHAT_PIPELINE.read_text())
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port, pipeline=f'pipeline = "{tmp_path / "stuck.toml"}"',
                          server_extra=f"drain_timeout_s = {DRAIN_TIMEOUT_S}\nprepare_workers = 2")
    stuck = {"model": "tiny", "messages": [{"role": "user", "content": "STUCK"}], "max_tokens": 4}
    with serve_subprocess(config, port, env={"PYTHONPATH": str(ROOT)}) as (base, proc):
        out: list = []
        threads = [threading.Thread(target=_send, args=(base, "/v1/chat/completions", json.dumps(stuck).encode(),
                                                        None, out), daemon=True) for _ in range(3)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health", timeout=5).json().get("num_preparing", 0) < 3:
            assert time.monotonic() < deadline, "the requests did not reach preparation"
            time.sleep(0.05)
        started = time.monotonic()
        assert httpx.get(base + "/health", timeout=5).status_code == 200  # both workers are stuck
        assert time.monotonic() - started < 0.5
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(DRAIN_TIMEOUT_S + 10)
        exit_s = time.monotonic() - signalled
    print(f"\nSIGTERM with two stuck workers and one request waiting: exit {code} after {exit_s:.2f} s")
    assert code == 0 and exit_s < DRAIN_TIMEOUT_S + 5
