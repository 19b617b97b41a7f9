"""Vision-language serving, in one run on one model folder, every server a separate process over real sockets:

1. mlxd, time to first token of an image turn, each case repeated with distinct images (medians), with the
   vision-tower runs each case costs (``GET /v1/status`` → ``vision.num_vision_calls`` before and after):
   (a) cold: a fresh image, prefix cache cleared (``DELETE /v1/cache``);
   (b) the same image after a different system prompt: the prefix cache misses, the vision-feature cache serves it;
   (c) turn 2 of (a)'s conversation (its prompt + answer + a new user message): a prefix-cache hit.
2. 8 concurrent streams, 4 with one image each and 4 text-only, against mlxd and ``mlx_vlm.server``.
3. 8 and 1 text-only streams against mlxd serving the vision folder and the same folder with
   ``[model] kind = "text"`` (mlx-lm's language model alone); the ratio (target ≥ 0.85).

Definitions (``benchmarks/load.py``'s, plus end-to-end tok/s) are in ``HEADER``, which opens the markdown file.

    python benchmarks/vision.py --tiny qwen2_5_vl --max-tokens 32 --repeats 2 --label "CPU, tiny"
    python benchmarks/vision.py --model ../models/qwen2_5_vl_7b --append --label "H100, Qwen2.5-VL-7B shape"
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime
import io
import itertools
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.support
import load as loadgen  # noqa: E402  (the load generator's server helpers and BLAS setup)

SYSTEM_A = "You are a careful assistant who describes pictures for a museum catalogue, in full sentences."
SYSTEM_B = "Reply in English. " + SYSTEM_A  # differs from its first words on, so the prefix cache misses
QUESTION = "Describe this picture in detail: its colours, its shapes and what it might show."
FOLLOW_UP = "Now tell me a long story about the sea, inspired by that picture."
# Nothing may be downloaded. cuDNN attention off for every server: on CUDA it ends the process on Qwen2.5-VL's
# vision tower (mlxd.runtime.cuda; mlxd turns it off itself, mlx_vlm.server does not); elsewhere it is not read.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MLX_CUDA_USE_CUDNN_SDPA": "0",
           # A workload that times out ends its server with SIGABRT: Python then writes every thread's stack to
           # the server's log, which says where it was stuck (see dump_stacks).
           "PYTHONFAULTHANDLER": "1"}
# workload: (image streams, text streams, servers that run it)
WORKLOADS = {
    "4 image + 4 text": (4, 4, ("mlxd", "mlxd_alt", "mlx_vlm")),
    "8 text": (0, 8, ("mlxd", "mlxd_text", "mlx_vlm")),
    "1 text": (0, 1, ("mlxd", "mlxd_text", "mlx_vlm")),
}
LABELS = {"mlxd": "mlxd", "mlx_vlm": "mlx_vlm.server", "mlxd_text": "mlxd, kind = \"text\"", "mlxd_alt": "mlxd, alt"}


# ---- requests ----

def png(seed: int, size: int) -> bytes:
    """A deterministic PNG of ``size``×``size`` pixels: 8×8-pixel blocks of seeded random colours."""
    import numpy as np
    from PIL import Image

    blocks = np.random.default_rng(seed).integers(0, 256, size=(-(-size // 8), -(-size // 8), 3), dtype=np.uint8)
    image = Image.fromarray(blocks).resize((size, size), Image.Resampling.NEAREST)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def image_turn(text: str, seed: int, size: int) -> dict:
    uri = "data:image/png;base64," + base64.b64encode(png(seed, size)).decode()
    parts = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}]
    return {"role": "user", "content": parts}


def text_turn(tag: str) -> dict:
    words = " ".join(f"w{(zlib.crc32(tag.encode()) + k * 11) % 997}" for k in range(4))
    return {"role": "user", "content": f"Request {tag}: tell me a long story about the sea and the stars. {words}"}


@dataclass
class Stream:
    """One streamed reply: when it started, when each content frame arrived, and its usage."""

    start: float
    kind: str = "text"
    times: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    usage: dict = field(default_factory=dict)

    def add(self, frame: dict, now: float) -> None:
        delta = (frame.get("choices") or [{}])[0].get("delta") or {}
        if delta.get("content"):
            self.times.append(now)
            self.text.append(delta["content"])
        self.usage = frame.get("usage") or self.usage

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start

    @property
    def tokens(self) -> int:
        return self.usage.get("completion_tokens") or len(self.times)

    @property
    def cached(self) -> int | None:
        return (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def stream_chat(port: int, model: str, messages: list[dict], max_tokens: int, kind: str = "text") -> Stream:
    """One streaming /v1/chat/completions request (greedy), through a raw asyncio client as in load.py."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    stream = Stream(time.perf_counter(), kind)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    status = await reader.readline()
    if b" 200 " not in status:
        rest = (await reader.read())[-800:].decode(errors="replace")
        writer.close()
        raise RuntimeError(f"{status.decode().strip()}: {rest}")
    while line := await reader.readline():
        if line.startswith(b"data: {"):
            now = time.perf_counter()
            stream.add(json.loads(line[6:]), now)
    writer.close()
    if not stream.times:
        raise RuntimeError(f"no content frames (usage {stream.usage})")
    return stream


def chat(port: int, model: str, messages: list[dict], max_tokens: int) -> Stream:
    return asyncio.run(stream_chat(port, model, messages, max_tokens, "image"))


# ---- 1. TTFT of an image turn on mlxd ----

@dataclass
class Case:
    name: str
    streams: list[Stream] = field(default_factory=list)
    vision_calls: int = 0


def vision_calls(port: int) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=30).json()["vision"]["num_vision_calls"]


def engine_clock(port: int) -> tuple[dict[str, float], int]:
    """The engine's step phases so far (total ms per phase) and its number of steps."""
    status = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=30).json()
    steps = status.get("num_steps", 0)
    return {k: v * steps for k, v in status.get("step_ms", {}).items()}, steps


def clock_since(port: int, before: tuple[dict[str, float], int]) -> dict[str, float]:
    """Mean ms per step, by phase, and the number of steps, since ``before`` (:func:`engine_clock`)."""
    totals, steps = engine_clock(port)
    num = steps - before[1]
    return {**{k: (v - before[0].get(k, 0.0)) / max(num, 1) for k, v in totals.items()}, "steps": num}


def clear_prefix_cache(port: int) -> None:
    httpx.delete(f"http://127.0.0.1:{port}/v1/cache", timeout=60).raise_for_status()


def ttft_cases(port: int, model: str, args) -> list[Case]:
    """Cases (a), (b), (c) for ``args.samples`` distinct images (seeds 1000, 1001, …)."""
    cases = [Case("(a) cold: fresh image, prefix cache cleared"),
             Case("(b) same image, other system prompt (feature cache)"),
             Case("(c) turn 2 of (a) (prefix cache)")]
    chat(port, model, [{"role": "system", "content": SYSTEM_A}, image_turn(QUESTION, 999, args.image_size)], 8)
    for seed in range(1000, 1000 + args.samples):
        clear_prefix_cache(port)
        turn = image_turn(QUESTION, seed, args.image_size)
        first = [{"role": "system", "content": SYSTEM_A}, turn]
        conversations = [first, [{"role": "system", "content": SYSTEM_B}, turn], None]
        for case, messages in zip(cases, conversations, strict=True):
            if messages is None:  # turn 2 resends turn 1 with its answer, as clients do
                answer = "".join(cases[0].streams[-1].text)
                messages = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
            before = vision_calls(port)
            case.streams.append(chat(port, model, messages, args.max_tokens))
            case.vision_calls += vision_calls(port) - before
        print(f"  image {seed}: " + ", ".join(f"{c.streams[-1].ttft:.3f}s" for c in cases), flush=True)
    return cases


def ttft_table(cases: list[Case]) -> str:
    lines = ["| case | median TTFT (s) | min – max (s) | prompt tokens | cached tokens | vision-tower runs |",
             "|---|---|---|---|---|---|"]
    for case in cases:
        ttfts = [s.ttft for s in case.streams]
        prompt = statistics.median(s.usage.get("prompt_tokens", 0) for s in case.streams)
        cached = [s.cached for s in case.streams if s.cached is not None]
        cached_text = f"{statistics.median(cached):.0f}" if cached else "not reported"
        lines.append(f"| {case.name} | {statistics.median(ttfts):.3f} | {min(ttfts):.3f} – {max(ttfts):.3f} | "
                     f"{prompt:.0f} | {cached_text} | {case.vision_calls} for {len(case.streams)} requests |")
    cold = statistics.median(s.ttft for s in cases[0].streams)
    ratios = [f"{c.name[:3]} {statistics.median(s.ttft for s in c.streams) / cold:.0%} of cold" for c in cases[1:]]
    return "\n".join(lines) + "\n\nMedian TTFT against the cold turn: " + "; ".join(ratios) + "."


# ---- 2, 3. concurrent streams in interleaved rounds ----

def workload_requests(workload: str, round_: int, size: int) -> list[tuple[str, list[dict]]]:
    """(kind, messages) per client: image and text clients alternate; nothing repeats an earlier round's request."""
    num_image, num_text, _ = WORKLOADS[workload]
    seed = 10_000 + 100 * (round_ + 1)
    image = [("image", [image_turn(f"{QUESTION} (client {i}, round {round_})", seed + i, size)])
             for i in range(num_image)]
    text = [("text", [text_turn(f"{workload}/{round_}/{i}")]) for i in range(num_text)]
    mixed = [r for pair in zip(image, text, strict=False) for r in pair]
    return mixed + image[len(mixed) // 2:] + text[len(mixed) // 2:]


async def run_streams(port: int, model: str, requests: list[tuple[str, list[dict]]], max_tokens: int) -> list[Stream]:
    return list(await asyncio.gather(*[stream_chat(port, model, m, max_tokens, kind) for kind, m in requests]))


def run_rounds(servers: dict, procs: dict[str, subprocess.Popen], args, errors: dict[str, str],
               clocks: dict[tuple[str, str], list[dict[str, float]]]) -> dict[tuple[str, str], list[list[Stream]]]:
    """Every workload on every server that runs it, round after round (a short warm-up round first). ``clocks``
    collects mlxd's engine step breakdown over each workload (:func:`clock_since`)."""
    rounds: dict[tuple[str, str], list[list[Stream]]] = {}
    for round_ in range(-1, args.repeats):
        for workload in args.workloads:
            names = WORKLOADS[workload][2][:: -1 if round_ % 2 else 1]  # every other round in reverse order
            requests = workload_requests(workload, round_, args.image_size)
            for name in (n for n in names if n in servers and f"{workload} / {n}" not in errors):
                port, model = servers[name]
                max_tokens = 8 if round_ < 0 else args.max_tokens
                time.sleep(args.settle)
                before = engine_clock(port) if name.startswith("mlxd") else None
                try:
                    streams = asyncio.run(asyncio.wait_for(run_streams(port, model, requests, max_tokens),
                                                           args.workload_timeout))
                except (OSError, RuntimeError, ValueError, TimeoutError) as e:
                    reason = str(e) or f"not done after {args.workload_timeout:g} s"
                    if isinstance(e, TimeoutError):
                        reason += "; " + dump_stacks(procs[name], args.logs)
                    errors[f"{workload} / {name}"] = f"{type(e).__name__}: {reason}"
                    print(f"  {workload} on {name} failed: {reason}", flush=True)
                    continue
                if round_ >= 0:
                    rounds.setdefault((workload, name), []).append(streams)
                    clock = clock_since(port, before) if before is not None else None
                    if clock is not None:
                        clocks.setdefault((workload, name), []).append(clock)
                    print(f"  {workload} on {name}: {summarize(streams)}; engine ms a step: {clock}", flush=True)
                else:
                    print(f"  warm-up: {workload} on {name} done", flush=True)
        if round_ >= 0:
            print(f"round {round_ + 1}/{args.repeats} done", flush=True)
    return rounds


def dump_stacks(proc: subprocess.Popen, logs: Path | None) -> str:
    """Where a stuck server is: its threads' Python and native stacks (``py-spy dump --native`` when py-spy is on
    PATH, into the logs folder), then every thread's Python stack from its fault handler as SIGABRT ends it."""
    said = []
    spy = shutil.which("py-spy")
    if spy and logs:
        out = logs / f"stacks-{proc.pid}.txt"
        with open(out, "w") as f:
            subprocess.run([spy, "dump", "--native", "--pid", str(proc.pid)], stdout=f, stderr=subprocess.STDOUT,
                           timeout=120, check=False)
        said.append(f"py-spy stacks in {out}")
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGABRT)
        said.append("server ended with SIGABRT, its threads' stacks are in its log")
    return "; ".join(said) or "no stacks taken"


def summarize(streams: list[Stream]) -> dict[str, float]:
    first = min(s.times[0] for s in streams)
    last = max(s.times[-1] for s in streams)
    tokens = sum(s.tokens for s in streams)
    ttfts = [s.ttft for s in streams]
    prompt = statistics.median(s.usage.get("prompt_tokens", 0) for s in streams)
    return {"streams": len(streams), "prompt": prompt, "tokens": tokens, "min_tokens": min(s.tokens for s in streams),
            "ttft_mean": statistics.mean(ttfts), "ttft_p50": statistics.median(ttfts),
            "tok_s": tokens / (last - first) if last > first else float("nan"),
            "e2e_tok_s": tokens / (last - min(s.start for s in streams))}


def best_round(runs: list[list[Stream]]) -> list[Stream]:
    return max(runs, key=lambda streams: summarize(streams)["tok_s"])


def load_table(rounds: dict[tuple[str, str], list[list[Stream]]]) -> str:
    """The best round of each point; the last column lists the aggregate tok/s of every round, best first."""
    lines = ["| workload | server | streams | prompt tokens (median) | completion tokens (fewest in a stream) | "
             "mean TTFT (s) | p50 TTFT (s) | aggregate tok/s | every round | end-to-end tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (workload, name), runs in rounds.items():
        kinds = ["image", "text", None] if WORKLOADS[workload][0] and WORKLOADS[workload][1] else [None]
        for kind in kinds:
            per_round = sorted((summarize(_only(streams, kind)) for streams in runs), key=lambda r: -r["tok_s"])
            every = ", ".join(f"{r['tok_s']:.0f}" for r in per_round)
            row = summarize(_only(best_round(runs), kind))
            lines.append(f"| {workload} | {LABELS[name]} | {row['streams']} {kind or 'all'} | {row['prompt']:.0f} | "
                         f"{row['tokens']} ({row['min_tokens']}) | {row['ttft_mean']:.3f} | {row['ttft_p50']:.3f} | "
                         f"{row['tok_s']:.0f} | {every} | {row['e2e_tok_s']:.0f} |")
    return "\n".join(lines)


def clock_table(clocks: dict[tuple[str, str], list[dict[str, float]]]) -> str:
    """mlxd's engine steps over each workload: mean ms per step by phase (over every round), steps per round."""
    phases = ("schedule", "prefill", "decode_build", "decode_wait", "post_process")
    lines = ["| workload | server | steps a round | " + " | ".join(p.replace("_", " ") for p in phases) +
             " | step total |", "|---|---|---|" + "---|" * (len(phases) + 1)]
    for (workload, name), runs in clocks.items():
        steps = sum(r["steps"] for r in runs)
        mean = {p: sum(r.get(p, 0.0) * r["steps"] for r in runs) / max(steps, 1) for p in phases}
        lines.append(f"| {workload} | {LABELS[name]} | {', '.join(str(r['steps']) for r in runs)} | "
                     + " | ".join(f"{mean[p]:.2f}" for p in phases) + f" | {sum(mean.values()):.2f} |")
    return "\n".join(lines)


def _only(streams: list[Stream], kind: str | None) -> list[Stream]:
    return [s for s in streams if kind is None or s.kind == kind]


def ratio_lines(rounds: dict[tuple[str, str], list[list[Stream]]]) -> str:
    def rate(workload: str, name: str, kind: str | None = None, key: str = "tok_s") -> float | None:
        runs = rounds.get((workload, name))
        return summarize(_only(best_round(runs), kind))[key] if runs else None

    def median(name: str, kind: str | None, key: str) -> float:
        return statistics.median(summarize(_only(streams, kind))[key] for streams in rounds[("4 image + 4 text", name)])

    lines = []
    pairs = [("mlxd", "mlx_vlm"), ("mlxd_alt", "mlx_vlm"), ("mlxd_alt", "mlxd")]
    for (mine, other), kind in itertools.product(pairs, (None, "image", "text")):
        ours, theirs = rate("4 image + 4 text", mine, kind), rate("4 image + 4 text", other, kind)
        if ours and theirs:
            ours_e2e, theirs_e2e = (rate("4 image + 4 text", n, kind, "e2e_tok_s") for n in (mine, other))
            medians = [median(mine, kind, key) / median(other, kind, key) for key in ("tok_s", "e2e_tok_s")]
            lines.append(f"- 4 image + 4 text, {kind or 'all'} streams: {LABELS[mine]} / {LABELS[other]} "
                         f"{ours / theirs:.2f}x aggregate, {ours_e2e / theirs_e2e:.2f}x end-to-end (best rounds); "
                         f"{medians[0]:.2f}x, {medians[1]:.2f}x (medians of the rounds)")
    for workload in ("8 text", "1 text"):
        vision, text = rate(workload, "mlxd"), rate(workload, "mlxd_text")
        if vision and text:
            verdict = "met" if vision / text >= 0.85 else "missed"
            lines.append(f"- {workload} stream(s): mlxd on the vision folder / mlxd kind = \"text\": "
                         f"{vision / text:.2f} (target ≥ 0.85: {verdict})")
        theirs = rate(workload, "mlx_vlm")
        if vision and theirs:
            lines.append(f"- {workload} stream(s): mlxd / mlx_vlm.server {vision / theirs:.2f}x")
    return "\n".join(lines)


# ---- servers ----

@dataclass
class Server:
    name: str
    command: list[str]
    health: str
    model: str  # what requests put in "model"
    env: dict[str, str] = field(default_factory=dict)  # beyond OFFLINE


def mlxd_server(name: str, model_path: str, tmp: Path, kind: str = "auto", log_level: str = "warning",
                engine: str = "") -> Server:
    """``engine``: more settings of the ``[engine]`` table (TOML lines)."""
    port = loadgen.free_port()
    command = loadgen.mlxd_command(model_path, port, tmp / name, max_running=8)
    config = Path(command[command.index("--config") + 1])
    text = config.read_text().replace("[model]\n", f'[model]\nkind = "{kind}"\n')
    text = text.replace("[engine]\n", f"[engine]\n{engine}\n" if engine else "[engine]\n")
    config.write_text(text.replace('level = "warning"', f'level = "{log_level}"'))
    return Server(name, command, "/health", "bench")


def mlx_vlm_server(model_path: str) -> Server:
    # Continuous batching is always on in mlx_vlm.server (its ResponseGenerator); --max-num-seqs only bounds it
    # (unbounded by default). Prefix caching (APC_ENABLED) stays off, its default: no request here repeats a prefix.
    port = loadgen.free_port()
    command = [sys.executable, "-m", "mlx_vlm.server", "--model", model_path, "--host", "127.0.0.1", "--port",
               str(port), "--max-num-seqs", "8", "--log-level", "WARNING"]
    return Server("mlx_vlm", command, "/health", model_path)


def server_specs(args, tmp: Path) -> list[Server]:
    specs = []
    for name in args.servers.split(","):
        if name in ("mlxd", "mlxd_text"):
            specs.append(mlxd_server(name, args.model, tmp, "text" if name == "mlxd_text" else "auto",
                                     args.server_log_level, args.mlxd_engine))
        elif name == "mlxd_alt":
            spec = mlxd_server(name, args.model, tmp, "auto", args.server_log_level,
                               "\n".join(filter(None, [args.mlxd_engine, args.alt_engine])))
            LABELS[name] = f"mlxd, {args.alt_engine}" if args.alt_engine else "mlxd, alt"
            if args.baseline_mlxd:  # another source tree; PYTHONSAFEPATH keeps the working directory's mlxd out
                tree = Path(args.baseline_mlxd).resolve()
                spec.env.update(PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
                                PYTHONSAFEPATH="1")
                LABELS[name] = f"mlxd baseline ({tree.name}{', ' + args.alt_engine if args.alt_engine else ''})"
            specs.append(spec)
        elif name == "mlx_vlm":
            specs.append(mlx_vlm_server(args.model))
        else:
            raise SystemExit(f"unknown server {name!r}; known: mlxd, mlx_vlm, mlxd_text, mlxd_alt")
    return specs


def start_servers(stack: contextlib.ExitStack, specs: list[Server], logs: Path,
                  errors: dict) -> tuple[dict, dict[str, subprocess.Popen]]:
    """Start each server; one that fails to start is recorded in ``errors`` (with its log's tail) and left out.
    Returns ``{name: (port, model)}`` and ``{name: process}``."""
    running, procs = {}, {}
    for spec in specs:
        port = loadgen.port_of(spec.command)
        try:
            procs[spec.name] = stack.enter_context(
                loadgen.serve(spec.command, port, logs / f"{spec.name}.log", spec.health, {**OFFLINE, **spec.env}))
        except RuntimeError as e:
            errors[spec.name] = str(e)
            print(f"{spec.name} did not start: {e}", flush=True)
            continue
        running[spec.name] = (port, spec.model)
    return running, procs


# ---- report ----

def environment() -> dict[str, str]:
    from importlib.metadata import version

    import mlx.core as mx

    device = str(mx.default_device())
    with contextlib.suppress(AttributeError, RuntimeError):
        device += f", {mx.device_info().get('device_name', '?')}"
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        device += " (" + subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                        capture_output=True, text=True, check=True).stdout.strip() + ")"
    found = []
    for package in ("mlx", "mlx-cuda-13", "mlx-lm", "mlx-vlm", "mlxd", "transformers", "litestar", "fastapi"):
        with contextlib.suppress(Exception):
            found.append(f"{package} {version(package)}")
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "host": f"{platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs", "device": device,
            "versions": f"python {platform.python_version()}, " + ", ".join(found)}


def model_summary(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    text, vision = config.get("text_config") or config, config["vision_config"]
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return (f"`{folder}`: {config['model_type']}, text hidden {text.get('hidden_size')} × "
            f"{text.get('num_hidden_layers')} layers, vocabulary {text.get('vocab_size') or config.get('vocab_size')}; "
            f"vision hidden {vision.get('hidden_size')} × {vision.get('depth') or vision.get('num_hidden_layers')} "
            f"blocks; {size / 1e6:,.0f} MB of safetensors")


HEADER = """# Vision-language models: image-turn TTFT, mixed image/text streams, text on a vision model

Written by `benchmarks/vision.py`; each section is one run. Every server is a separate process reached over real
sockets by a small raw-asyncio streaming client, as in `benchmarks/load.py`. Greedy, `max_tokens` a stream.

- **TTFT** = first content frame − request sent.
- **aggregate tok/s** = completion tokens (from usage) / (last content frame − first content frame, over the
  streams counted), as in `engine.md`.
- **end-to-end tok/s** = the same tokens / (last content frame − first request sent). It also charges the time
  before the first token: the aggregate favours a server that starts every stream late and at once over one that
  starts some streams early.
- Concurrent workloads run in interleaved rounds (every other round takes the servers in reverse order), each
  round with images and prompts no earlier round used (no cache helps across rounds); the best round of each point
  (by aggregate tok/s over all its streams) is kept, and every round's aggregate is listed. The mixed workload's
  ratios are given for the best rounds and for the medians over the rounds (one round in which a server happens to
  start every stream at once can lift its best aggregate far above its others). Completion tokens are totals, the
  fewest in one stream in brackets.
- Images are generated PNGs (8×8-pixel blocks of seeded random colours) sent as `data:` URIs in OpenAI
  `image_url` parts.
"""


def section(args, env: dict, cases: list[Case] | None, rounds: dict, errors: dict, specs: list[Server],
            clocks: dict) -> str:
    parts = [f"## {args.label or env['device']} ({env['date']})",
             "Command: `" + " ".join(["python", *map(shlex.quote, sys.argv)]) + "`",
             f"Host: {env['host']}. Device: {env['device']}.\n\nVersions: {env['versions']}.",
             f"Model: {model_summary(Path(args.model))}. Images {args.image_size}×{args.image_size} px; "
             f"{args.max_tokens} tokens a stream; best of {args.repeats} rounds; {args.samples} images per TTFT case.",
             "Servers (mlxd computes in float32 on a Linux CPU, `[model] dtype = \"auto\"`, else in the checkpoint's "
             "dtype; mlx_vlm.server always in the checkpoint's):\n"
             + "\n".join(f"- {LABELS[s.name]}: `{' '.join(map(str, s.command))}`" for s in specs)]
    if cases:
        parts += ["### 1. TTFT of an image turn (mlxd)", ttft_table(cases)]
    if rounds:
        parts += ["### 2, 3. Concurrent streams", load_table(rounds), ratio_lines(rounds)]
    if clocks:
        parts += ["mlxd's engine over each workload (`/v1/status` `step_ms` and `num_steps` before and after it; "
                  "ms a step, mean over every round):", clock_table(clocks)]
    if errors:
        parts.append("Failures:\n" + "\n".join(f"- {key}: ```{text[-1500:]}```" for key, text in errors.items()))
    return "\n\n".join(parts) + "\n"


def write_report(path: Path, text: str, append: bool) -> None:
    if append and path.exists():
        path.write_text(path.read_text().rstrip("\n") + "\n\n" + text)
    else:
        path.write_text(HEADER + "\n" + text)


# ---- main ----

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a vision-language model folder (config.json with a vision_config)")
    parser.add_argument("--tiny", help="build mlxd's tiny random-weight VLM of this family instead (qwen2_5_vl, "
                                       "qwen3_vl, gemma3, idefics3)")
    parser.add_argument("--servers", default="mlxd,mlx_vlm,mlxd_text",
                        help="comma list: mlxd, mlx_vlm, mlxd_text, mlxd_alt (mlxd with --alt-engine, or from "
                             "--baseline-mlxd)")
    parser.add_argument("--baseline-mlxd", help="serve mlxd_alt from another mlxd source tree (e.g. `git worktree "
                                                "add ../base HEAD~1`), side by side with this one")
    parser.add_argument("--alt-engine", default="", help="[engine] settings of mlxd_alt, e.g. 'step_token_budget = 2048'")
    parser.add_argument("--mlxd-engine", default="",
                        help="[engine] settings of every mlxd server, e.g. 'memory_limit_bytes = 28000000000' when "
                             "several servers share one GPU")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the best is kept")
    parser.add_argument("--samples", type=int, default=5, help="distinct images per TTFT case")
    parser.add_argument("--image-size", type=int, default=448, help="pixels of the generated square images")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds to wait before each workload, so that what the server before it still does "
                             "after its last stream (freeing memory) is over")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma list of the concurrent workloads to run: {', '.join(WORKLOADS)}")
    parser.add_argument("--out", type=Path, default=loadgen.ROOT / "docs" / "benchmarks" / "vision.md")
    parser.add_argument("--append", action="store_true", help="add a section to --out instead of replacing it")
    parser.add_argument("--label", default="", help="the section's title (default: the device)")
    parser.add_argument("--logs", type=Path, help="keep the servers' logs in this folder")
    parser.add_argument("--server-log-level", default="warning", help="mlxd servers' [logging] level")
    parser.add_argument("--workload-timeout", type=float, default=300.0,
                        help="seconds one workload may take on one server before it is recorded as failed")
    args = parser.parse_args()
    if bool(args.model) == bool(args.tiny):
        parser.error("give one of --model or --tiny")
    args.workloads = args.workloads.split(",")
    if unknown := [w for w in args.workloads if w not in WORKLOADS]:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    return args


def main() -> None:
    args = parse_args()
    loadgen.with_openblas()  # every server started from here computes with the BLAS mlxd uses
    tmp = Path(tempfile.mkdtemp(prefix="mlxd-vision-bench-"))
    logs = args.logs = args.logs or tmp
    logs.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from tests.support.tiny_vlm import tiny_vlm_cached

        args.model = str(tiny_vlm_cached(Path(tempfile.gettempdir()) / "mlxd-bench-models", args.tiny))
    args.model = str(Path(args.model).resolve())
    env, specs, errors = environment(), server_specs(args, tmp), {}
    cases, rounds, clocks = None, {}, {}
    with contextlib.ExitStack() as stack:
        servers, procs = start_servers(stack, specs, logs, errors)
        if "mlxd" in servers:
            print("1. TTFT of an image turn (mlxd)", flush=True)
            cases = ttft_cases(*servers["mlxd"], args)
        print("2, 3. concurrent streams", flush=True)
        rounds = run_rounds(servers, procs, args, errors, clocks)
    text = section(args, env, cases, rounds, errors, specs, clocks)
    write_report(args.out, text, args.append)
    print(text)


if __name__ == "__main__":
    main()
