"""The event loop's CPU time per streamed token: this mlxd against another source tree, side by side.

The engine thread and the event loop (HTTP, the pipeline's stages, SSE frames) share Python's interpreter lock, so
every microsecond the loop spends on a token is one the engine's step may wait for. Each server is started from its
own tree (``--baseline-mlxd``, e.g. ``git worktree add ../base HEAD~1``) on the same model; rounds alternate
between them. A round: ``--streams`` streaming clients, each asking for ``--max-tokens`` greedy tokens, again and
again for ``--seconds``; the server's main thread (the event loop) CPU time is read from ``/proc`` before and after
(Linux only), and divided by the tokens streamed. Aggregate tok/s is reported beside it.

    python benchmarks/loop_cost.py --tiny qwen3 --baseline-mlxd ../base --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import (  # noqa: E402
    free_port,
    mlxd_command,
    model_folder,
    serve,
    story_prompt,
    stream_one,
    tree_env,
    with_openblas,
)


def main_thread_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process's main thread (the event loop's)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(port: int, streams: int, max_tokens: int, seconds: float) -> int:
    """Rounds of ``streams`` concurrent streams until ``seconds`` have passed; returns the tokens streamed."""
    end, tokens = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        runs = await asyncio.gather(*[stream_one(port, "bench", story_prompt(i), max_tokens) for i in range(streams)])
        tokens += sum(n for _, _, n in runs)
    return tokens


def measure(pid: int, port: int, args) -> tuple[float, float]:
    """(event loop CPU µs per token, aggregate tok/s) of one round."""
    cpu, start = main_thread_cpu_s(pid), time.monotonic()
    tokens = asyncio.run(drive(port, args.streams, args.max_tokens, args.seconds))
    return (main_thread_cpu_s(pid) - cpu) / tokens * 1e6, tokens / (time.monotonic() - start)


def main() -> None:
    with_openblas()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder")
    parser.add_argument("--tiny", default="qwen3", help="else a tiny random model of this arch")
    parser.add_argument("--baseline-mlxd", required=True, help="the other mlxd source tree")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write a markdown section here (else print it)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mlxd-loop-"))
    model = model_folder(args.model, None if args.model else args.tiny, tmp / "models")
    trees = {"this tree": {}, "baseline": tree_env(args.baseline_mlxd)}  # name -> the server's environment
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, env in trees.items():
            port, folder = free_port(), tmp / name.replace(" ", "-")
            command = mlxd_command(model, port, folder, args.streams)
            proc = stack.enter_context(serve(command, port, folder / "server.log", "/health", env))
            asyncio.run(drive(port, args.streams, 16, 1.0))  # warm
            servers[name] = (proc.pid, port)
        for _ in range(args.rounds):
            for name, (pid, port) in servers.items():
                results[name].append(measure(pid, port, args))
                print(name, results[name][-1], flush=True)  # noqa: T201 - progress
    lines = [f"Model: `{model}`; {args.streams} streams of {args.max_tokens} greedy tokens, {args.seconds:g} s a "
             f"round, {args.rounds} rounds alternating.", "",
             "| server | event loop CPU per token, each round (µs) | median | aggregate tok/s, each round |",
             "|---|---|---|---|"]
    for name, runs in results.items():
        lines.append(f"| {name} | {', '.join(f'{us:.0f}' for us, _ in runs)} | "
                     f"{statistics.median(us for us, _ in runs):.0f} | {', '.join(f'{r:.0f}' for _, r in runs)} |")
    mine, theirs = (statistics.median(us for us, _ in results[n]) for n in trees)
    lines += ["", f"- event loop CPU per token, this tree / baseline: {mine / theirs:.2f}x"]
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)  # noqa: T201 - the report


if __name__ == "__main__":
    main()
