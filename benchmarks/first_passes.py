"""Passes of concurrent streams right after a fresh mlxd reports ready: is the first one cold, and if so, where?

Per start (``--starts`` fresh processes, each with an empty kernel cache, ``MLX_PTX_CACHE_DIR``), passes of
``--streams`` streams one after the other, each with prompts no earlier request has seen (so none hits the prefix
cache); the last ``--long-passes`` passes use longer prompts (a padded length not met before). Per pass:

* aggregate tokens/s and median time to first token, as ``load.py`` counts them;
* **kernels compiled**: files the pass added to the kernel cache. MLX's CUDA backend compiles a kernel (NVRTC) the
  first time it meets it and writes it there, so a pass that meets something warm-up did not adds files;
* the engine's own time per step, by phase, from ``/v1/status`` before and after the pass (``step_ms`` means times
  ``num_steps``): ``decode_build`` (the host building and dispatching a step), ``decode_wait`` (waiting for the
  device), ``prefill``;
* the Python collector's passes over the whole heap (generation 2) and its pauses, from ``/v1/status`` ``gc``;
* from the pass's request log lines (the server logs at ``info``), medians of each request's time to first token
  as the server saw it and of its parts: ``prepare_s`` (tokenizing, on a worker thread), ``queued_s`` (waiting for
  a place in the batch) and ``prefill_s`` (its prompt pass).

    python benchmarks/first_passes.py --model ../models/qwen3-8b --starts 2 --out docs/benchmarks/x.md
    python benchmarks/first_passes.py --tiny qwen3 --streams 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load as loadgen  # noqa: E402

HEADER = ["| start | pass | prompt words | tok/s | TTFT p50 (s) | kernels compiled | steps | decode build ms/step | "
          "decode wait ms/step | prefill ms | full collections | collector pause ms | server TTFT / prepare / queued / "
          "prefill ms, medians |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
PARTS = ("ttft_s", "prepare_s", "queued_s", "prefill_s")


def engine_totals(port: int) -> dict:
    """The engine's summed step time by phase (ms), its step count, and the collector's counters."""
    status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=30).read())
    steps = status.get("num_steps", 0)
    phases = {phase: ms * steps for phase, ms in status.get("step_ms", {}).items()}
    return {"steps": steps, **phases, "full": status["gc"]["num_collections"][2],
            "pause": status["gc"]["pause_ms_total"]}


def request_lines(log: Path, skip: int) -> tuple[list[dict], int]:
    """The request log lines written after the first ``skip`` lines of ``log``, and the count of lines read."""
    lines = log.read_text().splitlines()
    events = []
    for line in lines[skip:]:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "request":
            events.append(event)
    return events, len(lines)


def _median_ms(requests: list[dict], part: str) -> str:
    values = [r[part] for r in requests if r.get(part) is not None]
    return f"{1000 * statistics.median(values):.0f}" if values else "–"


def one_start(start: int, args, model: str, tmp: Path) -> list[str]:
    port = loadgen.free_port()
    folder = tmp / f"start-{start}"
    kernels = folder / "ptx"
    command = loadgen.mlxd_command(model, port, folder, args.streams, log_level="info")
    files = lambda: {p for p in kernels.rglob("*") if p.is_file()} if kernels.exists() else set()  # noqa: E731
    rows, offset, lines = [], 10_000 * start, 0
    with loadgen.serve(command, port, folder / "server.log", "/health", {"MLX_PTX_CACHE_DIR": str(kernels)}):
        seen, before = files(), engine_totals(port)
        plan = [args.words] * args.passes + [args.long_words] * args.long_passes
        for number, words in enumerate(plan, 1):
            prompts = [loadgen.story_prompt(offset + i, words) for i in range(args.streams)]
            offset += args.streams
            result = asyncio.run(loadgen.http_load("mlxd", port, "bench", prompts, args.max_tokens))
            time.sleep(0.2)  # the last request's bookkeeping
            now, after = files(), engine_totals(port)
            requests, lines = request_lines(folder / "server.log", lines)
            parts = " / ".join(_median_ms(requests, part) for part in PARTS)
            steps = max(after["steps"] - before["steps"], 1)
            rows.append(f"| {start + 1} | {number} | {words} | {result.tokens_per_s:.0f} | {result.ttft_p50_s:.3f} | "
                        f"{len(now - seen)} | {steps} | {(after['decode_build'] - before['decode_build']) / steps:.2f} | "
                        f"{(after['decode_wait'] - before['decode_wait']) / steps:.2f} | "
                        f"{after['prefill'] - before['prefill']:.0f} | {after['full'] - before['full']} | "
                        f"{after['pause'] - before['pause']:.0f} | {parts} |")
            print(rows[-1], flush=True)  # noqa: T201 - progress
            seen, before = now, after
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (else --tiny)")
    parser.add_argument("--tiny", default="qwen3", help="tiny random architecture when no --model")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--starts", type=int, default=1, help="fresh processes, one after the other")
    parser.add_argument("--passes", type=int, default=3, help="passes with prompts of --words tag words")
    parser.add_argument("--words", type=int, default=8)
    parser.add_argument("--long-passes", type=int, default=2, help="then passes with prompts of --long-words")
    parser.add_argument("--long-words", type=int, default=30)
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp())
    model = loadgen.model_folder(args.model, args.tiny, tmp / "model")
    rows = [row for start in range(args.starts) for row in one_start(start, args, model, tmp)]
    import mlx.core as mx

    command = " ".join(["python", "benchmarks/first_passes.py", *sys.argv[1:]])
    text = "\n".join([
        f"### First passes after ready ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
        f"`{command}`", "",
        f"{mx.default_device()}, mlx {mx.__version__}, {platform.platform()}; {args.streams} streams of "
        f"{args.max_tokens} greedy tokens a pass; each start with an empty kernel cache.", "",
        *HEADER, *rows, "", ""])
    loadgen.emit(text, args.out)


if __name__ == "__main__":
    main()
