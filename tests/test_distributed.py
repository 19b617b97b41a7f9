"""`[distributed]`: one model over a tensor-parallel group, rank 0 serving (mlxd/engine/distributed/).

The group tests run two processes over MLX's ``ring`` backend on loopback, started as users start them
(``mlxd launch --config FILE``, which runs ``mlx.launch``), and compare with one process serving the same model.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from mlxd.config import load_config
from mlxd.config.schema import DistributedConfig, EngineConfig
from mlxd.engine.base import EngineRequest, Failed, Finished, SamplingParams
from mlxd.engine.commands import Accept, Cancel, Clear, Drop, EndAll, Evict, Keep, RequestSpec, RunStep, Stop
from mlxd.engine.distributed.channel import Message, _decoder, _encoder
from mlxd.engine.distributed.leader import make_leader_engine
from mlxd.errors import ConfigError, ModelLoadError
from tests.helpers import SHORT_HITS, free_port, serve_subprocess, stop_process, wait_healthy, write_config

DISTRIBUTED = """
[distributed]
backend = "ring"
tensor_parallel = 2
starting_port = {ring_port}
control_port = {control_port}
heartbeat_s = 0.5
step_timeout_s = {timeout}
"""


def ring_ports(count: int = 2) -> int:
    """The first of ``count`` consecutive free ports (the ring's ranks bind one each), taken below the kernel's
    ephemeral range: a port there can be taken by any outgoing connection between this check and the ranks
    binding it (EADDRINUSE, seen in CI when ``free_port()``'s pick was reused)."""
    for _ in range(200):
        first = random.randrange(20000, 30000 - count)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError("no free consecutive ports between 20000 and 30000")


def distributed_config(tmp: Path, model_dir: Path, port: int, timeout: float = 30, extra: str = "") -> Path:
    extra = DISTRIBUTED.format(ring_port=ring_ports(), control_port=free_port(), timeout=timeout) + extra
    return write_config(tmp, model_dir, port=port, extra=extra, model_extra="", server_extra="")


@contextlib.contextmanager
def launched(config: Path, port: int, timeout: float = 240) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """``mlxd launch --config FILE`` as a real process group; yields (base URL, the launcher, its log)."""
    log_path = config.parent / f"launch-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlxd", "launch", "--config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout, log_path)
        yield base, proc, log_path
    finally:
        if proc.poll() is None:
            stop_process(proc)


def chat(base: str, content: str, history: list[dict] | None = None, max_tokens: int = 16,
         top_logprobs: int = 0) -> dict:
    messages = [*(history or []), {"role": "user", "content": content}]
    logprobs = {"logprobs": True, "top_logprobs": top_logprobs} if top_logprobs else {}
    reply = httpx.post(base + "/v1/chat/completions", timeout=120,
                       json={"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                             **logprobs})
    assert reply.status_code == 200, reply.text
    return reply.json()


PROMPTS = [f"Request number {i}: tell me about {topic}." for i, topic in
           enumerate(["rivers", "mountains", "tea", "clocks", "owls", "ships", "rain", "glass"])]


def eight_at_once(base: str) -> list[tuple[str, list[list[float]]]]:
    """Each prompt's text and, for each of its tokens, the two best log-probabilities (all eight at once)."""
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: chat(base, p, max_tokens=24, top_logprobs=2), PROMPTS))
    return [(r["choices"][0]["message"]["content"],
             [[top["logprob"] for top in entry["top_logprobs"]] for entry in r["choices"][0]["logprobs"]["content"]])
            for r in replies]


def separated_model(model_dir: Path, out: Path, factor: float = 64.0) -> Path:
    """``model_dir`` with its output head scaled by ``factor``: the same greedy tokens, every gap between logits
    ``factor`` times wider, so that no top two are near a tie the order of a sum across ranks could flip."""
    out.mkdir()
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    weights = mx.load(str(model_dir / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * factor
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def conversation(base: str) -> tuple[str, dict]:
    """Turn 1, then turn 2 extending it: turn 2's usage (its cached tokens) and text."""
    first = chat(base, "Describe a lighthouse.")
    history = [{"role": "user", "content": "Describe a lighthouse."},
               {"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    second = chat(base, "And at night?", history)
    return second["choices"][0]["message"]["content"], second["usage"]


def ranks(base: str) -> list[dict]:
    return httpx.get(base + "/v1/status", timeout=10).json()["distributed"]["ranks"]


def test_tensor_parallel_matches_one_process_and_hits_the_prefix_cache_on_both_ranks(tiny_qwen3_dir, tmp_path):
    model = separated_model(tiny_qwen3_dir, tmp_path / "model")
    single_port, group_port = free_port(), free_port()
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    single = write_config(tmp_path / "one", model, port=single_port, extra=SHORT_HITS)
    group = distributed_config(tmp_path / "two", model, group_port, extra=SHORT_HITS)
    with serve_subprocess(single, single_port) as (base, _):
        expected = eight_at_once(base)
        expected_turn2, _ = conversation(base)
    # The oracle holds where the top two logits are apart: far more than float32 sums in another order move them.
    margins = [top[0] - top[1] for _, tops in expected for top in tops]
    assert len(margins) == 8 * 24 and min(margins) > 0.05, sorted(margins)[:5]
    with launched(group, group_port) as (base, _, _):
        before = ranks(base)
        assert [r["rank"] for r in before] == [0, 1] and before[0]["pid"] != before[1]["pid"]
        served = eight_at_once(base)
        assert [text for text, _ in served] == [text for text, _ in expected]
        # What the sums' order leaves: log-probabilities equal to within float32 rounding, not bit for bit.
        for (_, theirs), (_, ours) in zip(served, expected, strict=True):
            assert sum(theirs, []) == pytest.approx(sum(ours, []), abs=1e-3)
        turn2, usage = conversation(base)
        assert turn2 == expected_turn2
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        time.sleep(1.5)  # the ranks' counters travel with rank 0's next message (a heartbeat while idle)
        after = ranks(base)
        status = httpx.get(base + "/v1/status", timeout=10).json()["distributed"]
        assert status["backend"] == "ring" and status["size"] == 2 and status["tensor_parallel"] == 2
        for rank_before, rank_after in zip(before, after, strict=True):
            assert rank_after["prefix_hits"] > rank_before["prefix_hits"]  # turn 2 hit on every rank
            assert rank_after["active_kib"] > 0
        assert after[0]["prefix_entries"] == after[1]["prefix_entries"] > 0


def test_killing_rank_1_mid_stream_fails_the_request_and_ends_the_job(tiny_qwen3_dir, tmp_path):
    port = free_port()
    config = distributed_config(tmp_path, tiny_qwen3_dir, port, timeout=6)
    with launched(config, port) as (base, proc, log_path):
        follower = ranks(base)[1]["pid"]
        frames, killed_at = [], None
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20000,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    frames.append(line)
                if len(frames) == 5 and killed_at is None:
                    os.kill(follower, signal.SIGKILL)
                    killed_at = time.monotonic()
        assert killed_at is not None, frames  # the stream ran long enough to be cut
        ended_after = time.monotonic() - killed_at
        assert frames[-1] == "data: [DONE]"
        assert '"error"' in frames[-2] and "rank" in frames[-2], frames[-2]
        assert ended_after < 6 + 10  # the watchdog's step_timeout_s, and some slack
        assert proc.wait(90) != 0  # the job ends non-zero: launchd or systemd restart it
    log = log_path.read_text()
    assert "distributed_watchdog" in log or "connection to a peer was lost" in log
    assert "rank 1 exited with code -9" in log or "rank 1 was killed" in log


# ---- in process: the watchdog, the message format, the config ----

class StuckChannel:
    """A channel whose step collective (the shared tokens) blocks once ``stuck`` is set, as with a peer that is
    gone; or raises, as a ring collective does when the peer's connection breaks (``broken``); or blocks after the
    peer's control connection ended (``lost``)."""

    rank, size = 0, 2

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stuck = threading.Event()
        self.released = threading.Event()
        self.lost = None

    def connect(self, timeout_s, port=0):
        pass

    def send(self, message):
        pass

    def wait_reported(self, timeout_s):
        pass

    def peer_stats(self):
        return [dict(pid=2)]

    def close(self, wait_s=0.0):
        pass

    def share_tokens(self, tokens):
        if self.stuck.is_set():
            if self.mode == "broken":
                raise RuntimeError("[ring] Send failed: connection reset by peer")
            if self.mode == "lost":
                self.lost = "rank 1's control connection to rank 0 ended (the connection was closed)"
            self.released.wait()
        return tokens


@pytest.mark.parametrize(("mode", "timeout", "told", "reason"), [
    ("blocked", 1.0, "waited more than 1 s for the group", "a rank died or hangs"),
    ("broken", 30.0, "on rank 0's engine thread, in a group of 2 ranks", "may have died or lost its connection"),
    # Known lost (its control connection ended): a second, not step_timeout_s.
    ("lost", 60.0, "rank 1's control connection to rank 0 ended", "rank 1's control connection"),
])
def test_a_lost_rank_fails_requests_and_reports_the_engine_dead(tiny_qwen3_dir, mode, timeout, told, reason):
    # A dead peer either blocks rank 0's collective (the watchdog ends the job) or makes it raise; either way the
    # clients and the job's owner are told that the group broke.
    from mlx_lm import load

    model, _ = load(str(tiny_qwen3_dir))
    channel = StuckChannel(mode)
    settings = DistributedConfig(backend="ring", tensor_parallel=2, step_timeout_s=timeout, heartbeat_s=0.2)
    engine = make_leader_engine(model, EngineConfig(max_running=2, warmup_tokens=1), channel=channel,
                                settings=settings)
    failures: list[str] = []
    engine.on_failure = failures.append
    engine.start()
    try:
        async def run() -> list:
            request = EngineRequest(request_id="r1", prompt=[5, 6, 7], max_tokens=10000)
            handle = engine.submit(request)
            events = []
            async for event in handle.events():
                events.append(event)
                if len(events) == 3:
                    channel.stuck.set()
                if isinstance(event, Failed | Finished):
                    return events
            return events

        started = time.monotonic()
        events = asyncio.run(asyncio.wait_for(run(), 30))
        assert isinstance(events[-1], Failed) and events[-1].status == 503
        assert told in events[-1].message
        assert time.monotonic() - started < 10
        deadline = time.monotonic() + 5  # on_failure runs right after the requests are told
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures and reason in failures[0]
        assert engine.failure == failures[0]
    finally:
        channel.released.set()
        engine.engine_loop.put(Stop())
        engine._thread.join(30)
        assert not engine._thread.is_alive()


def test_messages_round_trip():
    spec = RequestSpec("r1", [1, 2, 3], 8, SamplingParams(temperature=0.5, logit_bias={4: -1.0}), 512, (2,), True)
    message = Message([Accept(spec), Cancel("r2", "stop"), Keep("r0"), Drop("r0"), Clear(), Evict(1024),
                       EndAll("bye"), Stop()], RunStep([("r1", 3), ("r2", 5)], [["r1", "r2"]]), (1, 2, 3, 4, 5))
    assert _decoder.decode(_encoder.encode(message)) == message
    request = spec.request()
    assert request.prompt == [1, 2, 3] and request.sampling.logit_bias == {4: -1.0} and request.keep_prompt


def test_share_tokens_gives_rank_0s_tokens_alone():
    """In a group of one, the share is the identity; the graph keeps the sampled array (not a constant)."""
    from mlxd.engine.distributed.channel import Channel

    channel = Channel(mx.distributed.init())
    tokens = mx.array([3, 9], dtype=mx.uint32)
    shared = channel.share_tokens(tokens)
    assert shared.dtype == mx.uint32 and shared.tolist() == [3, 9]


def test_config_refuses_speculative_decoding_and_mismatched_hosts(tmp_path, tiny_qwen3_dir):
    base = write_config(tmp_path, tiny_qwen3_dir).read_text()
    path = tmp_path / "spec.toml"
    path.write_text(base + '\n[engine.speculative]\ndrafter = "prompt_lookup"\n[distributed]\nbackend = "ring"\n')
    with pytest.raises(ConfigError, match=r"spec.toml: engine.speculative.drafter: \[distributed\] does not run"):
        load_config(path)
    path.write_text(base + '\n[distributed]\nhosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]\ntensor_parallel = 2\n')
    with pytest.raises(ConfigError, match="distributed.hosts: 3 hosts"):
        load_config(path)
    path.write_text(base + '\n[distributed]\nbackend = "tcp"\n')
    with pytest.raises(ConfigError, match="distributed.backend"):
        load_config(path)


def test_launch_command_names_backend_hosts_and_ports(tmp_path, tiny_qwen3_dir):
    base = write_config(tmp_path, tiny_qwen3_dir).read_text()
    path = tmp_path / "two.toml"
    path.write_text(base + '\n[distributed]\nbackend = "ring"\nhosts = ["10.0.0.1", "10.0.0.2"]\n'
                    "starting_port = 40000\n")
    out = subprocess.run([sys.executable, "-m", "mlxd", "launch", "--config", str(path), "--port", "9000",
                          "--print"], capture_output=True, text=True, check=True).stdout
    out = shlex.split(out)
    assert out[out.index("--backend") + 1] == "ring" and out[out.index("--hosts") + 1] == "10.0.0.1,10.0.0.2"
    assert out[out.index("--starting-port") + 1] == "40000"
    assert out[out.index("--") + 1:] == [sys.executable, "-m", "mlxd", "--config", str(path.resolve()), "--port",
                                         "9000"]
    local = tmp_path / "local.toml"
    local.write_text(base + '\n[distributed]\nbackend = "ring"\ntensor_parallel = 2\n')
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = shlex.split(subprocess.run([sys.executable, "-m", "mlxd", "launch", "--config", str(local), "--print"],
                                     capture_output=True, text=True, check=True, env=env).stdout)
    assert out[out.index("-n") + 1] == "2"
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert out[out.index("--env") + 1] == f"OPENBLAS_NUM_THREADS={threads}"  # the ranks share this machine's cores
    plain = tmp_path / "plain.toml"
    plain.write_text(base)
    failed = subprocess.run([sys.executable, "-m", "mlxd", "launch", "--config", str(plain)], capture_output=True,
                            text=True)
    assert failed.returncode == 2 and "needs a [distributed] table" in failed.stderr


def test_a_vision_model_is_refused_before_loading(tiny_vlm):
    from mlxd.config.schema import ModelConfig
    from mlxd.models.load import load

    with pytest.raises(ModelLoadError, match="serves text models only"):
        load(ModelConfig(source=str(tiny_vlm("qwen2_5_vl"))), group=object())
