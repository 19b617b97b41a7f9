"""Streaming load generator and baselines for the batching engine.

Measures, in one run and on one model:

* mlx-lm driven directly: ``generate_step`` (one stream) and ``BatchGenerator`` (all streams in one batch);
* OpenAI-compatible servers through HTTP with streaming clients: mlxd, ``mlx_lm.server`` and, when given a Python
  that has it, vllm-mlx.

Per server and concurrency: mean time to first token, median inter-token latency and aggregate tokens/s: completion
tokens of all streams / (last token − first request sent), prefill included, as a user waits for it. mlx-lm's own
figures (``generate_step``, ``BatchGenerator``) are decode only: tokens / (last token − first token). Every run has
prompts of its own, seen by no earlier request (no prefix cache serves a round from the one before), distinct per
client and chosen so that greedy decoding does not hit an end-of-sequence token within ``--max-tokens``, so every
stream runs to its length; ``--prompt-words`` sets their length.

For each mlxd run, its engine's steps during the run (read from ``/v1/status`` before and after): how many, the
run's wall time over them, and the milliseconds the engine thread accounted a step by phase; the wall time beyond
the phases' sum went between the steps. A ``BatchGenerator`` run that runs out of device memory (beside servers that
share the device) is reported as failed and the rounds go on.

For mlxd (and the baseline mlxd), the first pass at the highest concurrency right after ``/health`` turns 200 is
reported apart, beside the pass that follows it (median time to first token, aggregate tokens/s): what warm-up
leaves for the first clients to pay. Both passes use prompts of their own, seen by no earlier request, so that
neither hits the prefix cache. MLX's CUDA backend keeps the kernels it compiles on disk (``MLX_PTX_CACHE_DIR``, by
default ``$TMPDIR/mlx/<version>/ptx``), so a later start pays less than the first one on a machine: point
``MLX_PTX_CACHE_DIR`` at an empty folder to measure a first start.

    python benchmarks/load.py --tiny qwen3 --out docs/benchmarks/engine-cpu.md
    python benchmarks/load.py --model PATH --concurrency 1,8,16 --servers mlxd
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.support

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Result:
    label: str
    concurrency: int
    tokens: int
    ttft_s: float | None
    itl_ms: float | None
    tokens_per_s: float
    ttft_p50_s: float | None = None
    spread_s: float | None = None  # last stream's first token - first stream's first token
    gap_p90_ms: float | None = None
    gap_max_ms: float | None = None
    failed: int = 0  # streams that ended before --max-tokens tokens (an error frame or a dropped connection)
    # CPU time of the server's main thread (mlxd: the event loop) and of its whole process, per streamed token
    loop_us_per_token: float | None = None
    process_us_per_token: float | None = None
    # mlxd: its engine's steps during the run and their mean milliseconds by phase (/v1/status's step_ms)
    engine_steps: int | None = None
    step_ms: dict[str, float] | None = None


# ---- prompts ----

def story_prompt(i: int, words: int = 8) -> str:
    """The ``i``-th prompt of the benchmarks: distinct for every ``i``, also under word-level tokenizers (the "t123"
    words; benchmarks/random_model.py)."""
    tags = " ".join(f"t{(i * 37 + k * 11) % 997 + 3}" for k in range(words))
    return f"Request {i}: tell me a long story about the sea, the stars and the number {i * 7}. {tags}"


def pick_prompts(model, tokenizer, count: int, max_tokens: int, words: int = 8) -> list[str]:
    """Distinct prompts whose greedy continuation runs ``max_tokens`` without an end-of-sequence token, checked in
    batches (mlx-lm's ``BatchGenerator``), so that hundreds of prompts cost seconds, not minutes."""
    from mlx_lm.generate import BatchGenerator

    eos = set(tokenizer.eos_token_ids)
    prompts: list[str] = []
    start = 0
    while len(prompts) < count:
        batch = [story_prompt(i, words) for i in range(start, start + min(64, 2 * (count - len(prompts)) + 4))]
        start += len(batch)
        generator = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(batch),
                                   prefill_batch_size=len(batch))
        uids = generator.insert([tokenizer.encode(p) for p in batch], max_tokens=[max_tokens] * len(batch))
        ended = set()
        while responses := generator.next_generated():
            ended.update(r.uid for r in responses if r.token in eos)
        generator.close()
        prompts += [p for uid, p in zip(uids, batch, strict=True) if uid not in ended][: count - len(prompts)]
        if start > 50 * count:
            raise RuntimeError("could not find prompts that avoid end-of-sequence tokens")
    return prompts


# ---- mlx-lm driven directly ----

def direct_generate_step(model, tokenizer, prompt: str, max_tokens: int) -> Result:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    start, times = time.perf_counter(), []
    for _ in generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=max_tokens):
        times.append(time.perf_counter())
    return Result("mlx-lm generate_step", 1, len(times), times[0] - start, _median_gap(times),
                  len(times) / (times[-1] - times[0]))


def direct_batch_generator(model, tokenizer, prompts: list[str], max_tokens: int) -> Result:
    """mlx-lm's BatchGenerator on all ``prompts`` at once, decode only; a run that runs out of device memory (beside
    the servers sharing the device) is reported as failed, and the comparison goes on without it."""
    import mlx.core as mx

    try:
        return _batch_generator_run(model, tokenizer, prompts, max_tokens)
    except RuntimeError as e:
        if "out of memory" not in str(e).lower():
            raise
        print(f"BatchGenerator at {len(prompts)} rows ran out of device memory: {e}", flush=True)  # noqa: T201
        mx.clear_cache()
        return Result("mlx-lm BatchGenerator", len(prompts), 0, None, None, 0.0, failed=len(prompts))


def _batch_generator_run(model, tokenizer, prompts: list[str], max_tokens: int) -> Result:
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    generator = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=n, prefill_batch_size=n)
    start = time.perf_counter()
    generator.insert([tokenizer.encode(p) for p in prompts], max_tokens=[max_tokens] * n)
    times: list[float] = []
    firsts: dict[int, float] = {}
    while responses := generator.next_generated():
        now = time.perf_counter()
        for response in responses:
            firsts.setdefault(response.uid, now)
            times.append(now)
    generator.close()
    return Result("mlx-lm BatchGenerator", n, len(times), statistics.mean(firsts.values()) - start, None,
                  len(times) / (times[-1] - times[0]))


def _median_gap(times: list[float]) -> float | None:
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) * 1000 if gaps else None


# ---- HTTP clients (raw asyncio streams: the client must cost less than the servers it measures) ----

async def stream_one(port: int, model: str, prompt: str, max_tokens: int,
                     api: str = "completions") -> tuple[float, list[float], int]:
    """One streaming /v1/completions (or, ``api`` "chat", /v1/chat/completions) request; returns (start, arrival
    time of each text frame, completion tokens)."""
    request = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}}
    request.update({"prompt": prompt} if api == "completions" else {"messages": [{"role": "user", "content": prompt}]})
    body = json.dumps(request).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    path = b"chat/completions" if api == "chat" else b"completions"
    writer.write(b"POST /v1/%s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (path, len(body)) + body)
    times, usage = [], 0
    while line := await reader.readline():
        if not line.startswith(b"data: {"):
            continue
        frame = json.loads(line[6:])
        if frame.get("choices") and _has_text(frame["choices"][0]):
            times.append(time.perf_counter())
        if frame.get("usage"):
            usage = frame["usage"]["completion_tokens"]
    writer.close()
    return start, times, usage or len(times)


def _has_text(choice: dict) -> bool:
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content"))


def cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of process ``pid``, or of its thread ``tid`` (Linux: /proc)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def http_load(label: str, port: int, model: str, prompts: list[str], max_tokens: int, pid: int | None = None,
                    api: str = "completions") -> Result:
    """``pid``: the server's process, whose main thread's CPU time (mlxd's event loop) and whole CPU time per
    streamed token the result reports (on Linux)."""
    measure = pid is not None and Path(f"/proc/{pid}/task/{pid}/stat").exists()
    steps_before = await engine_steps(port) if label.startswith("mlxd") else None
    before = (cpu_s(pid, pid), cpu_s(pid)) if measure else None
    runs = await asyncio.gather(*[stream_one(port, model, p, max_tokens, api) for p in prompts])
    steps = step_phases(steps_before, await engine_steps(port)) if steps_before is not None else (None, None)
    tokens = sum(n for _, _, n in runs)
    per_token = [(cpu_s(pid, pid) - before[0]) * 1e6 / max(tokens, 1),
                 (cpu_s(pid) - before[1]) * 1e6 / max(tokens, 1)] if before is not None else [None, None]
    sent = min(s for s, _, _ in runs)
    failed = sum(1 for _, t, n in runs if n < max_tokens or not t)
    if not any(t for _, t, _ in runs):
        return Result(label, len(prompts), tokens, None, None, 0.0, failed=failed)
    first = min(t[0] for _, t, _ in runs if t)
    last = max(t[-1] for _, t, _ in runs if t)
    ttfts = [t[0] - s for s, t, _ in runs if t]
    gaps = sorted(g for _, t, _ in runs for g in (b - a for a, b in zip(t, t[1:], strict=False)))
    return Result(label, len(prompts), tokens, statistics.mean(ttfts), statistics.median(gaps) * 1000 if gaps else None,
                  tokens / (last - sent), statistics.median(ttfts),
                  max(t[0] for _, t, _ in runs if t) - first,
                  gaps[int(0.9 * (len(gaps) - 1))] * 1000 if gaps else None, gaps[-1] * 1000 if gaps else None,
                  failed, *per_token, *steps)


async def engine_steps(port: int) -> tuple[int, dict[str, float]] | None:
    """mlxd's engine step count and mean milliseconds a step by phase, from /v1/status (None if it has none)."""
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        status = (await client.get(f"http://127.0.0.1:{port}/v1/status")).json()
    found = _find_steps(status)
    return (found["num_steps"], found["step_ms"]) if found is not None else None


def _find_steps(value) -> dict | None:
    if isinstance(value, dict):
        if "step_ms" in value and "num_steps" in value:
            return value
        value = list(value.values())
    if isinstance(value, list):
        return next((found for item in value if (found := _find_steps(item)) is not None), None)
    return None


def step_phases(before, after) -> tuple[int | None, dict[str, float] | None]:
    """The steps between two :func:`engine_steps` readings and their mean milliseconds by phase."""
    if before is None or after is None or after[0] <= before[0]:
        return None, None
    (n0, ms0), (n1, ms1) = before, after
    return n1 - n0, {phase: (ms1[phase] * n1 - ms0.get(phase, 0.0) * n0) / (n1 - n0) for phase in ms1}


@dataclasses.dataclass
class FirstPass:
    """The first pass at one concurrency right after a server reported ready, and the pass that followed it."""

    first: Result
    second: Result


def first_passes(label: str, port: int, model: str, prompts: list[str], max_tokens: int,
                 api: str = "completions") -> FirstPass:
    """Two passes of ``len(prompts) // 2`` streams, one after the other, each with its own half of ``prompts``."""
    n = len(prompts) // 2
    first = asyncio.run(http_load(label, port, model, prompts[:n], max_tokens, api=api))
    return FirstPass(first, asyncio.run(http_load(label, port, model, prompts[n:], max_tokens, api=api)))


# ---- servers ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(command: list[str], port: int, log: Path, health: str,
          env: dict | None = None) -> Iterator[subprocess.Popen]:
    """Start a server process logging to ``log``, wait until ``health`` answers 200, yield the process, stop it."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        wait_ready(port, health, proc, log)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_ready(port: int, path: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout}s:\n{log.read_text()[-3000:]}")


def mlxd_command(model_path: str, port: int, tmp: Path, max_running: int, log_level: str = "warning",
                 memory_gb: float = 0) -> list[str]:
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "mlxd.toml"
    config.write_text(f"""pipeline = "chat"
[server]
port = {port}
[model]
source = "{model_path}"
name = "bench"
[engine]
max_running = {max_running}
memory_limit_bytes = {int(memory_gb * 1024**3)}
[logging]
level = "{log_level}"
format = "json"
""")
    return [sys.executable, "-m", "mlxd", "--config", str(config), "--port", str(port)]


def server_specs(args, tmp: Path, max_concurrency: int) -> list[tuple[str, list[str], str, dict]]:
    """(label, command, health path, extra environment) of every server to measure."""
    specs = [(*spec, {}) for spec in _named_specs(args, tmp, max_concurrency)]
    if args.baseline_mlxd:  # another mlxd source tree (an earlier commit), served side by side with this one
        port = free_port()
        command = mlxd_command(args.model, port, tmp / "baseline", args.mlxd_max_running or max_concurrency,
                               args.mlxd_log_level, args.mlxd_memory_gb)
        env = {**tree_env(args.baseline_mlxd), **dict(item.split("=", 1) for item in args.baseline_env.split())}
        specs.append(("mlxd baseline (HTTP)", command, "/health", env))
    return specs


def tree_env(tree: str) -> dict[str, str]:
    """The environment that makes ``python -m mlxd`` serve the mlxd of another source tree. PYTHONSAFEPATH: the
    working directory (this checkout, when run from its root) would otherwise come ahead of PYTHONPATH, and this
    mlxd would be served under the other's name."""
    return {"PYTHONPATH": os.pathsep.join([str(Path(tree).resolve()), os.environ.get("PYTHONPATH", "")]),
            "PYTHONSAFEPATH": "1"}


def _named_specs(args, tmp: Path, max_concurrency: int) -> list[tuple[str, list[str], str]]:
    specs = []
    for name in args.servers.split(","):
        port = free_port()
        if name == "mlxd":
            specs.append(("mlxd (HTTP)", mlxd_command(args.model, port, tmp, args.mlxd_max_running or max_concurrency,
                                                      args.mlxd_log_level, args.mlxd_memory_gb),
                          "/health"))
        elif name == "mlx_lm":
            specs.append(("mlx_lm.server (HTTP)", [sys.executable, "-m", "mlx_lm.server", "--model", args.model,
                                                   "--port", str(port), "--decode-concurrency",
                                                   str(max_concurrency), "--prompt-concurrency",
                                                   str(max_concurrency)], "/v1/models"))
        elif name == "vllm_mlx":
            specs.append(("vllm-mlx (HTTP)", [args.vllm_python, "-m", "vllm_mlx.cli", "serve", args.model, "--port",
                                              str(port), "--continuous-batching", "--max-num-seqs",
                                              str(max_concurrency)], "/v1/models"))
        else:
            raise SystemExit(f"unknown server {name!r}; known: mlxd, mlx_lm, vllm_mlx")
    return specs


def port_of(command: list[str]) -> int:
    return int(command[command.index("--port") + 1])


# ---- report ----

def versions(vllm_python: str | None) -> dict[str, str]:
    from importlib.metadata import version

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("mlx", "mlx-lm", "mlxd", "litestar", "uvicorn"):
        with contextlib.suppress(Exception):
            out[package] = version(package)
    if vllm_python:
        code = "from importlib.metadata import version as v; print(v('vllm-mlx'), v('mlx-lm'), v('mlx'))"
        with contextlib.suppress(Exception):
            vv = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, check=True).stdout.split()
            out["vllm-mlx venv"] = f"vllm-mlx {vv[0]}, mlx-lm {vv[1]}, mlx {vv[2]}"
    return out


def table(results: list[Result]) -> str:
    lines = ["| engine | streams | tokens | TTFT (s) | first tokens spread (s) | ITL median / p90 / max (ms) | "
             "aggregate tok/s | main thread / process CPU per token (µs) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ttft = f"{r.ttft_s:.3f}" if r.ttft_s is not None else "–"
        spread = f"{r.spread_s:.3f}" if r.spread_s is not None else "–"
        itl = " / ".join(f"{v:.2f}" for v in (r.itl_ms, r.gap_p90_ms, r.gap_max_ms) if v is not None) or "–"
        tokens = f"{r.tokens} ({r.failed} streams failed)" if r.failed else f"{r.tokens}"
        cpu = (f"{r.loop_us_per_token:.0f} / {r.process_us_per_token:.0f}" if r.loop_us_per_token is not None
               and r.process_us_per_token is not None else "–")
        lines.append(f"| {r.label} | {r.concurrency} | {tokens} | {ttft} | {spread} | {itl} | "
                     f"{r.tokens_per_s:.0f} | {cpu} |")
    return "\n".join(lines)


def step_table(results: list[Result]) -> str:
    """mlxd's engine steps in each run: how many, the run's wall time over them (from the first request sent to the
    last token), and the milliseconds the engine thread accounted a step by phase; what the wall time has beyond the
    phases' sum went outside the engine's steps (between them: commands, hand-overs, waiting for the interpreter
    lock)."""
    rows = [r for r in results if r.engine_steps]
    if not rows:
        return ""
    phases = list(rows[0].step_ms)
    lines = ["| engine | streams | steps | wall ms a step | " + " | ".join(phases) + " | phases' sum |",
             "|---|---|---|---|" + "---|" * (len(phases) + 1)]
    for r in rows:
        wall_ms = r.tokens / r.tokens_per_s / r.engine_steps * 1000 if r.tokens_per_s else 0.0
        lines.append(f"| {r.label} | {r.concurrency} | {r.engine_steps} | {wall_ms:.2f} | "
                     + " | ".join(f"{r.step_ms[p]:.2f}" for p in phases) + f" | {sum(r.step_ms.values()):.2f} |")
    return "\n\nmlxd's engine steps during each run (its /v1/status):\n\n" + "\n".join(lines)


def first_pass_report(passes: list[FirstPass], rounds: list[list[Result]] | None = None) -> str:
    """The first pass after ready beside the second, per mlxd server, and their ratio of aggregate tokens/s; with
    ``rounds``, for scale, the same server's ratios between its runs at that level in consecutive rounds (warm
    passes that differ only by when they ran)."""
    lines = ["First pass after ready (right after /health turned 200) and the next pass, each with prompts of its own:",
             "", "| engine | streams | pass | tokens | TTFT p50 (s) | aggregate tok/s |", "|---|---|---|---|---|---|"]
    for p in passes:
        for name, r in (("first after ready", p.first), ("second", p.second)):
            ttft = f"{r.ttft_p50_s:.3f}" if r.ttft_p50_s is not None else "–"
            lines.append(f"| {r.label} | {r.concurrency} | {name} | {r.tokens} | {ttft} | {r.tokens_per_s:.0f} |")
    lines.append("")
    for p in passes:
        if not p.second.tokens_per_s:
            continue
        lines.append(f"- {p.first.label.replace(' (HTTP)', '')} first pass / second pass at {p.first.concurrency} "
                     f"streams: {p.first.tokens_per_s / p.second.tokens_per_s:.2f}x")
        warm = [_rate(runs, p.first.label, p.first.concurrency) for runs in rounds or []]
        steps = [a / b for a, b in itertools.pairwise(warm) if a and b]
        if steps:
            lines.append(f"  - for scale, its warm runs at {p.first.concurrency} streams, each round's against the "
                         f"next: {', '.join(f'{v:.2f}x' for v in steps)}")
    return "\n".join(lines)


def ratios(results: list[Result]) -> str:
    def rate(label: str, level: int) -> float | None:
        return _rate(results, label, level)

    lines = []
    solo = rate("mlx-lm generate_step", 1)
    mlxd_one = rate("mlxd (HTTP)", 1)
    if solo and mlxd_one:
        lines.append(f"- mlxd, 1 stream through HTTP: {mlxd_one / solo:.0%} of generate_step (target ≥ 90%)")
    for level in sorted({r.concurrency for r in results if r.concurrency > 1}):
        batch, ours = rate("mlx-lm BatchGenerator", level), rate("mlxd (HTTP)", level)
        if batch and ours:
            lines.append(f"- mlxd, {level} streams through HTTP: {ours / batch:.0%} of BatchGenerator at {level} "
                         "(target ≥ 85% at 8 and 16)")
    for other in ("mlxd baseline (HTTP)", "mlx_lm.server (HTTP)", "vllm-mlx (HTTP)"):
        for level in sorted({r.concurrency for r in results}):
            theirs, ours = rate(other, level), rate("mlxd (HTTP)", level)
            if theirs and ours:
                lines.append(f"- mlxd / {other.replace(' (HTTP)', '')}, {level} stream(s): {ours / theirs:.2f}x")
    return "\n".join(lines)


def round_ratios(rounds: list[list[Result]]) -> str:
    """mlxd against each other engine, round by round: the runs of one round and level follow each other within
    seconds, so their ratio is spared the host's slower swings (``docs/benchmarks/engine.md``). Per level: every
    round's ratio, their median, and in how many rounds mlxd was at least 1.3x ahead."""
    ours = "mlxd (HTTP)"
    others = [label for label in _LABELS if label != ours and any(r.label == label for runs in rounds for r in runs)]
    lines = ["mlxd / each engine, round by round (aggregate tok/s of runs in the same round):", "",
             "| against | streams | every round | median | rounds ≥ 1.3x |", "|---|---|---|---|---|"]
    levels = sorted({r.concurrency for runs in rounds for r in runs if r.label == ours})
    for other in others:
        for level in levels:
            pairs = [(_rate(runs, ours, level), _rate(runs, other, level)) for runs in rounds]
            values = [a / b for a, b in pairs if a and b]
            if values:
                lines.append(f"| {other.replace(' (HTTP)', '')} | {level} | "
                             f"{', '.join(f'{v:.2f}x' for v in values)} | {statistics.median(values):.2f}x | "
                             f"{sum(v >= 1.3 for v in values)} of {len(values)} |")
    return "\n".join(lines) if len(lines) > 4 else ""


def _rate(runs: list[Result], label: str, level: int) -> float | None:
    return next((r.tokens_per_s for r in runs if r.label == label and r.concurrency == level), None)


def model_folder(model: str | None, tiny: str | None, root: Path | None = None) -> str:
    """``--model``, else a tiny random model of the ``--tiny`` architecture (hidden 128, 4 layers), cached under
    ``root`` (a fresh temporary folder by default)."""
    if model:
        return model
    from tests.support.tiny import tiny_model_cached

    return str(tiny_model_cached(root or Path(tempfile.mkdtemp()), tiny, hidden_size=128, num_layers=4))


def emit(text: str, out: str | None) -> None:
    """Append the report to ``out``, or print it."""
    if out:
        with open(out, "a") as f:
            f.write(text)
    else:
        print(text)  # noqa: T201 - the report


def with_openblas() -> None:
    """Re-run this script with OpenBLAS preloaded (as ``mlxd`` runs itself), so that every engine measured here,
    the direct baselines and the servers started from here, computes with the same BLAS.

    The environment is the daemon's own (:func:`mlxd.runtime.blas.preload_environment`: the pip wheel's OpenBLAS
    with the gfortran it needs, ``OPENBLAS_THREAD_TIMEOUT``); it is tried on a throwaway ``python -S`` first, and
    the script carries on with the bundled BLAS when it does not start."""
    from mlxd.runtime.blas import ENV_REEXECED, find_openblas, preload_environment

    lib = find_openblas()
    if sys.platform != "linux" or lib is None or os.environ.get(ENV_REEXECED):
        return
    if str(lib) in os.environ.get("LD_PRELOAD", ""):
        return
    try:
        env = preload_environment(lib, os.environ)
    except OSError as e:
        print(f"OpenBLAS not preloaded ({e}); the bundled BLAS computes", file=sys.stderr)  # noqa: T201
        return
    env[ENV_REEXECED] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # mlxd and tests.support
    probe = subprocess.run([sys.executable, "-S", "-c", ""], env=env, capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        print(f"OpenBLAS not preloaded ({probe.stderr.strip()}); the bundled BLAS computes",  # noqa: T201
              file=sys.stderr)
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder")
    parser.add_argument("--tiny", help="build a tiny random model of this arch (hidden 128, 4 layers) instead")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, default=8,
                        help="tag words added to each prompt (about a token each with the random models' tokenizer: "
                             "240 gives prompts of about 256 tokens)")
    parser.add_argument("--api", default="completions", choices=["completions", "chat"],
                        help="the streaming endpoint the clients call: /v1/completions or /v1/chat/completions (the "
                             "chat template, then the reasoning parser, on the way)")
    parser.add_argument("--servers", default="mlxd,mlx_lm", help="comma list: mlxd, mlx_lm, vllm_mlx")
    parser.add_argument("--vllm-python", help="the python of a venv with vllm-mlx (for --servers ...,vllm_mlx)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per point; the best is kept")
    parser.add_argument("--out", help="write a markdown section here (else print it)")
    parser.add_argument("--rounds-json", type=Path, help="also write every round's runs here (JSON)")
    parser.add_argument("--logs", type=Path, help="keep the servers' logs in this folder")
    parser.add_argument("--mlxd-log-level", default="warning", choices=["warning", "info"],
                        help="mlxd's log level (info: a line per request, with its queued and prefill times)")
    parser.add_argument("--mlxd-max-running", type=int, default=0,
                        help="[engine] max_running of every mlxd served (default: the highest --concurrency)")
    parser.add_argument("--mlxd-memory-gb", type=float, default=0,
                        help="[engine] memory_limit_bytes of every mlxd served, in GiB (0: the device's own), so that "
                             "servers sharing one GPU each keep to a share")
    parser.add_argument("--baseline-mlxd", help="another mlxd source tree (e.g. `git worktree add ../base HEAD~3`), "
                                               "served side by side as 'mlxd baseline'")
    parser.add_argument("--baseline-env", default="",
                        help="environment of the baseline server only, 'NAME=value ...' (e.g. the same tree under "
                             "another setting: --baseline-mlxd . --baseline-env OPENBLAS_THREAD_TIMEOUT=4)")
    args = parser.parse_args()
    with_openblas()  # after parsing: --help needs no BLAS
    levels = [int(x) for x in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="mlxd-bench-"))
    logs = args.logs or tmp
    logs.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.model = model_folder(None, args.tiny, tmp / "models")
    from mlx_lm import load

    model, tokenizer = load(args.model)
    # Every run gets prompts of its own (no server's prefix cache serves one run from another's): the warming
    # pass, the first and second pass after ready (mlxd servers), then each round's one stream and levels.
    num_prompts = 3 * max(levels) + args.repeats * (1 + sum(levels))
    prompts = pick_prompts(model, tokenizer, num_prompts, args.max_tokens, args.prompt_words)
    results, passes, rounds = run_all(args, model, tokenizer, prompts, levels, tmp, logs)
    report = "\n\n".join([
        f"Model: `{args.model}`; {args.max_tokens} tokens per stream, greedy; best of {args.repeats} interleaved "
        "rounds.",
        table(results) + step_table(results),
        ratios(results),
        round_ratios(rounds),
        *([first_pass_report(passes, rounds)] if passes else []),
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions(args.vllm_python).items()),
    ])
    if args.out:
        Path(args.out).write_text(report + "\n")
    if args.rounds_json:
        args.rounds_json.write_text(json.dumps([[dataclasses.asdict(r) for r in runs] for runs in rounds], indent=1))
    print(report)


def run_all(args, model, tokenizer, prompts: list[str], levels: list[int], tmp: Path,
            logs: Path) -> tuple[list[Result], list[FirstPass], list[list[Result]]]:
    """Every engine at every level, round after round, interleaved: noise on a shared machine then hits all of
    them alike instead of whichever happened to run during it; the servers' order turns from one round and level to
    the next (:func:`rotated`). Returns the best run of each point, the first passes, and every round's runs.

    Each mlxd server first serves its first and second pass at the highest level, as soon as it is ready and
    before the next server starts (``prompts`` beyond the rounds' own are theirs)."""
    top = max(levels)
    with contextlib.ExitStack() as stack:
        servers, passes = [], []
        for label, command, health, env in server_specs(args, tmp, top):
            port = port_of(command)
            log_name = label.replace(" (HTTP)", "").replace(" ", "-")
            proc = stack.enter_context(serve(command, port, logs / f"{log_name}.log", health, env))
            servers.append((label, port, "bench" if label.startswith("mlxd") else args.model, proc.pid))
            if label.startswith("mlxd"):
                passes.append(first_passes(label, port, "bench", prompts[top : 3 * top], args.max_tokens, args.api))
                print(first_pass_report(passes[-1:]), flush=True)
        fresh = iter(prompts[3 * top:])
        for level in levels:  # warm every batch shape once
            direct_batch_generator(model, tokenizer, prompts[:level], 8)
            for label, port, name, _ in servers:
                asyncio.run(http_load(label, port, name, prompts[:level], 8, api=args.api))
        best: dict[tuple[str, int], Result] = {}
        rounds: list[list[Result]] = []
        for i in range(args.repeats):
            runs = [direct_generate_step(model, tokenizer, next(fresh), args.max_tokens)]
            for j, level in enumerate(levels):
                batch = [next(fresh) for _ in range(level)]
                runs.append(direct_batch_generator(model, tokenizer, batch, args.max_tokens))
                runs += [asyncio.run(http_load(label, port, name, batch, args.max_tokens, pid, args.api))
                         for label, port, name, pid in rotated(servers, i + j)]
            rounds.append(runs)
            for run in runs:
                key = (run.label, run.concurrency)
                if key not in best or run.tokens_per_s > best[key].tokens_per_s:
                    best[key] = run
            print(table(sorted(best.values(), key=_order)) + step_table(runs), flush=True)
    return sorted(best.values(), key=_order), passes, rounds


def rotated(servers: list, shift: int) -> list:
    """``servers`` in the order of a round and level: which one runs first, right after mlx-lm's in-process run,
    moves on from one to the next, so that what the first one meets is shared. With the order fixed, one tree
    against a copy of itself ran first at 0.83-0.91x of the copy at one stream in two runs on a 2-core CPU (its
    prompt pass 0.30 against 0.04 ms a step); with it turning, 0.96-1.02x in a third."""
    shift %= max(len(servers), 1)
    return servers[shift:] + servers[:shift]


_LABELS = ["mlx-lm generate_step", "mlx-lm BatchGenerator", "mlxd (HTTP)", "mlxd baseline (HTTP)",
           "mlx_lm.server (HTTP)", "vllm-mlx (HTTP)"]


def _order(result: Result) -> tuple[int, int]:
    return _LABELS.index(result.label), result.concurrency


if __name__ == "__main__":
    main()
