"""The prefix cache's disk tier: time to first token of a long agent turn after a restart, from disk against cold.

Three daemons in turn on the embedded model (``embedded:smollm2-135m``, ``configs/agents.toml``'s engine settings:
``prefill_chunk = 2048``, a 4 GiB prefix cache), greedy, streaming, on 127.0.0.1:

1. **A** (``prefix_cache_dir`` set, empty): serves turn 1 of an agent conversation (a system prompt with tool
   definitions and this repository's source files, about ``--tokens`` tokens, then a user message), then stops with
   SIGTERM: after the drain it writes what its prefix cache holds. The stop's duration and the files are recorded.
2. **B** (same folder): serves turn 2 (turn 1, its answer, a new user message), as an agent sends after a restart.
   Its prompt comes from disk.
3. **C** (no disk tier): serves the same turn 2 cold.

TTFT = first text frame − request sent. B's and C's answers must be the same text (the report says whether they
were). The load average (1 minute) is recorded with each number: the machine may be shared. ``--out`` replaces the
section between this script's markers in the document (or adds it at the end).

    python benchmarks/disk_cache.py --tokens 4096 --out docs/benchmarks/memory.md
    python benchmarks/disk_cache.py --tokens 20480 --out docs/benchmarks/memory.md   # the issue's size
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import free_port, wait_ready, with_openblas  # noqa: E402  (benchmarks/ is not a package)

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- disk_cache.py: start -->", "<!-- disk_cache.py: end -->"
SOURCE = "embedded:smollm2-135m"
CHARS_PER_TOKEN = 3.3  # this repository's Python through SmolLM2's tokenizer (measured: 9,420 characters, 2,853 tokens)
TOOLS = json.dumps([{"name": name, "description": text, "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}, "required": ["path"]}}
    for name, text in (("read_file", "Read a file of the repository and return its text."),
                       ("edit_file", "Replace a file's text with new text; returns the diff."),
                       ("run_tests", "Run the test suite (or the tests under path) and return the failures."))])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="turn 1's prompt length, about (the issue's: 20480)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each answer generates")
    parser.add_argument("--out", type=Path, help="markdown document whose section this run replaces")
    parser.add_argument("--keep", type=Path, help="keep the daemons' logs and the cache folder here")
    parser.add_argument("--source", default=SOURCE, help="[model] source: the embedded model (default) or an mlx-lm "
                        "folder; a folder of benchmarks/random_model.py (word-level tokenizer) gets a prompt of its "
                        "own words, one token each")
    return parser.parse_args(argv)


@dataclass
class Turn:
    ttft_s: float = 0.0
    total_s: float = 0.0
    text: str = ""
    usage: dict = field(default_factory=dict)
    load: float = 0.0


@dataclass
class Daemon:
    name: str
    turn: Turn
    ready_s: float
    stop_s: float
    status: dict


def load_avg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").exists() else float("nan")


def agent_messages(num_tokens: int, source: str = SOURCE) -> list[dict]:
    """Turn 1: a coding agent's system prompt (its rules and tools, then this repository's files as it read them)
    of about ``num_tokens`` tokens, and the user's request. A random model's word-level tokenizer knows only its own
    words (``t2``, ``t3``, ...): its system prompt is ``num_tokens`` of them."""
    if source != SOURCE and _word_level(Path(source)):
        words = " ".join(f"t{2 + (i * 7919) % 3000}" for i in range(num_tokens))
        return [{"role": "system", "content": words}, {"role": "user", "content": "t5 t6 t7 t8"}]
    parts, size = ["You are a coding agent working in the mlxd repository. Read files before editing them, keep "
                   "changes small, run the tests after each change, and answer with the tool calls you make. Tools:\n"
                   f"{TOOLS}\n"], 0
    for path in sorted((ROOT / "mlxd").rglob("*.py")):
        text = f"\n### {path.relative_to(ROOT)}\n{path.read_text()}"
        parts.append(text[: int(num_tokens * CHARS_PER_TOKEN) - size])
        size += len(parts[-1])
        if size >= num_tokens * CHARS_PER_TOKEN:
            break
    return [{"role": "system", "content": "".join(parts)},
            {"role": "user", "content": "The prefix cache loses every entry when the daemon restarts. Find where "
                                        "entries are evicted and say which file you would change first."}]


def _word_level(folder: Path) -> bool:
    tokenizer = folder / "tokenizer.json"
    return tokenizer.exists() and json.loads(tokenizer.read_text()).get("model", {}).get("type") == "WordLevel"


async def stream_chat(port: int, messages: list[dict], max_tokens: int, plain: bool = False) -> Turn:
    """One streamed turn: a chat completion, or with ``plain`` (a model without a chat template) a completion of the
    messages' texts joined by spaces."""
    common = {"model": "agent", "max_tokens": max_tokens, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    if plain:
        path, body = "/v1/completions", {**common, "prompt": " ".join(m["content"] for m in messages)}
    else:
        path, body = "/v1/chat/completions", {**common, "messages": messages}
    payload = json.dumps(body).encode()
    turn = Turn(load=load_avg())
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
    writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" % path.encode()
                 + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"{status!r} {(await reader.read())[:2000]!r}")
    while line := await reader.readline():
        if not line.startswith(b"data: {"):
            continue
        frame = json.loads(line[6:])
        turn.usage = frame.get("usage") or turn.usage
        for choice in frame.get("choices") or []:
            if content := (choice.get("delta") or {}).get("content") or choice.get("text"):
                turn.ttft_s = turn.ttft_s or time.perf_counter() - started
                turn.text += content
    writer.close()
    turn.total_s = time.perf_counter() - started
    return turn


def write_config(folder: Path, port: int, cache_dir: Path | None, source: str) -> Path:
    config = folder / f"mlxd-{port}.toml"
    disk = f'prefix_cache_dir = "{cache_dir}"\n' if cache_dir is not None else ""
    config.write_text(f"""pipeline = "chat"
[server]
host = "127.0.0.1"
port = {port}
drain_timeout_s = 5
[model]
source = "{source}"
name = "agent"
context_length = 32768
[engine]
max_running = 4
prefill_chunk = 2048
prefix_cache_bytes = 4294967296
{disk}[logging]
level = "info"
format = "json"
""")
    return config


def run_daemon(name: str, folder: Path, cache_dir: Path | None, messages: list[dict], max_tokens: int,
               source: str) -> Daemon:
    """Start a daemon, send one turn, read its status, stop it with SIGTERM (timed) and wait for its exit."""
    port = free_port()
    log = folder / f"{name}.log"
    started = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlxd", "--config", str(write_config(folder, port, cache_dir, source))],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(port, "/health", proc, log)
        ready_s = time.perf_counter() - started
        plain = source != SOURCE and _word_level(Path(source))
        turn = asyncio.run(stream_chat(port, messages, max_tokens, plain))
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=30).json()
        print(f"{name}: TTFT {turn.ttft_s:.2f} s, {turn.usage} (load {turn.load})", flush=True)
        stopping = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        stop_s = time.perf_counter() - stopping
    finally:
        if proc.poll() is None:
            proc.kill()
    if code != 0:
        raise RuntimeError(f"{name} exited with {code}:\n{log.read_text()[-3000:]}")
    return Daemon(name, turn, ready_s, stop_s, status)


def log_line(log: Path, event: str) -> dict:
    """The first line of ``event`` in a daemon's JSON log ({} if none)."""
    for line in log.read_text().splitlines():
        if f'"event": "{event}"' in line:
            return json.loads(line)
    return {}


def report(args: argparse.Namespace, a: Daemon, b: Daemon, c: Daemon, files: list[int], folder: Path) -> str:
    saved = log_line(folder / "A.log", "prefix_disk_persisted")
    opened, hit = log_line(folder / "B.log", "prefix_disk_opened"), log_line(folder / "B.log", "prefix_disk_hit")
    computed = {d.name: log_line(folder / f"{d.name}.log", "request") for d in (a, b, c)}
    disk = b.status.get("prefix_disk", {})
    rows = [("A, turn 1, cold (then stopped)", a), ("B, turn 2 after the restart, from disk", b),
            ("C, turn 2, cold (no disk tier)", c)]
    lines = [
        START,
        f"## The prefix cache's disk tier: a long agent turn after a restart ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python benchmarks/disk_cache.py --tokens {args.tokens} --max-tokens {args.max_tokens}"
        f"{'' if args.source == SOURCE else ' --source ' + args.source}`; "
        f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}. Model `{args.source}` "
        f"({'float32 on the CPU' if args.source == SOURCE else 'its own dtype, default device'}), "
        "`prefill_chunk = 2048`, streaming, greedy; each daemon a fresh process. The load "
        "average (1 minute) is given with each number: the machine was shared.",
        "",
        "| daemon | prompt tokens | cached | TTFT | request | load |",
        "|---|---|---|---|---|---|",
    ]
    for label, daemon in rows:
        usage = daemon.turn.usage
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        lines.append(f"| {label} | {usage.get('prompt_tokens', '?'):,} | {cached:,} | {daemon.turn.ttft_s:.2f} s | "
                     f"{daemon.turn.total_s:.2f} s | {daemon.turn.load:.1f} |")
    same = "the same text" if b.turn.text == c.turn.text else "DIFFERENT texts"
    lines += [
        "",
        f"TTFT from disk against cold: {b.turn.ttft_s:.2f} s against {c.turn.ttft_s:.2f} s "
        f"({c.turn.ttft_s / b.turn.ttft_s:.1f}x); B and C answered {same}. A's stop (SIGTERM: drain, then the "
        f"entries in memory written) took {a.stop_s:.2f} s and left {len(files)} file(s), {sum(files):,} bytes "
        f"(`prefix_disk_persisted`: {json.dumps({k: saved.get(k) for k in ('num_in_memory', 'num_queued', 'complete')})}"
        f"). B indexed the folder at start-up in {opened.get('open_s', float('nan')):.3f} s and read "
        f"{disk.get('num_bytes_read', 0):,} bytes in {disk.get('num_hits', 0)} disk hit(s) "
        f"({hit.get('read_s', float('nan')):.2f} s: read, checksum, load; {disk.get('num_errors', 0)} error(s)), "
        f"then computed {computed['B'].get('prompt_tokens_computed', '?')} prompt tokens (prefill "
        f"{computed['B'].get('prefill_s', float('nan')):.2f} s; C's {computed['C'].get('prefill_s', float('nan')):.2f} "
        f"s). Start to ready (load and warm-up): A {a.ready_s:.0f} s, B {b.ready_s:.0f} s, C {c.ready_s:.0f} s.",
        "",
        END,
    ]
    return "\n".join(lines)


def write(out: Path, section: str) -> None:
    text = out.read_text() if out.exists() else ""
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    out.write_text(text)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="mlxd-disk-cache-"))
    cache_dir = folder / "prefix-cache"
    try:
        messages = agent_messages(args.tokens, args.source)
        a = run_daemon("A", folder, cache_dir, messages, args.max_tokens, args.source)
        files = [p.stat().st_size for p in cache_dir.rglob("*.safetensors")]
        messages = [*messages, {"role": "assistant", "content": a.turn.text},
                    {"role": "user", "content": "Good. Now make that change and run the prefix-cache tests."}]
        b = run_daemon("B", folder, cache_dir, messages, args.max_tokens, args.source)
        c = run_daemon("C", folder, None, messages, args.max_tokens, args.source)
        section = report(args, a, b, c, files, folder)
        print(section)
        if args.out:
            write(args.out, section)
    finally:
        if args.keep:
            shutil.copytree(folder, args.keep, dirs_exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    if "-h" not in sys.argv[1:] and "--help" not in sys.argv[1:]:
        with_openblas()
    main(sys.argv[1:])
