"""The engine's passes right after its warm-up, in process (no HTTP): is the first slower than the next ones?

``load.py`` measures the first pass of concurrent streams after ``/health`` turns 200 against the second, through
HTTP. This runs the same kind of pass against the engine alone: the model loaded as mlxd loads it, the engine
started (its warm-up included) and the heap frozen as the daemon does at ready, then ``--passes`` passes of
``--streams`` concurrent requests, each pass with prompts of its own. If the first pass is level with the others
here but not through HTTP, what slows it is outside the engine's step.

    python benchmarks/engine_passes.py --tiny qwen3                                  # CPU smoke run
    python benchmarks/engine_passes.py --model ../models/qwen3-8b --starts 2 --out docs/benchmarks/x.md
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dispatch_costs import emit  # noqa: E402
from load import model_folder, story_prompt  # noqa: E402


def one_start(path: str, streams: int, passes: int, max_tokens: int) -> None:
    """Load, start and warm the engine, then print one line per pass: tok/s and the engine's ms per step."""
    from step_breakdown import engine_run

    from mlxd.config.schema import EngineConfig, ModelConfig
    from mlxd.engine.batched import BatchedEngine
    from mlxd.models.load import load
    from mlxd.runtime.heap import freeze_loaded_objects

    loaded = load(ModelConfig(source=path))
    engine = BatchedEngine(loaded.model, EngineConfig(max_running=streams))
    started = time.perf_counter()
    engine.start()
    print(f"ready {time.perf_counter() - started:.1f}", flush=True)  # noqa: T201 - read by the parent
    freeze_loaded_objects()
    try:
        for p in range(passes):
            rate, phases = engine_run(engine, prompts(loaded.tokenizer, p, streams), max_tokens, f"p{p}")
            print(f"pass {rate:.0f} {phases['decode_build']:.2f} {phases['steps']}", flush=True)  # noqa: T201
    finally:
        engine.stop()


def prompts(tokenizer, index: int, streams: int) -> list[list[int]]:
    """``streams`` prompts no other pass uses (the form ``load.py`` uses)."""
    return [tokenizer.encode(story_prompt(index * streams + i)) for i in range(streams)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder")
    parser.add_argument("--tiny", help="build a tiny random model of this arch instead")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--starts", type=int, default=1, help="fresh processes, one after the other")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()
    path = model_folder(args.model, args.tiny)
    if args.child:
        one_start(path, args.streams, args.passes, args.max_tokens)
        return
    lines = [f"Model: `{path}`; {args.streams} streams, {args.max_tokens} tokens each, {args.passes} passes a start.",
             "", "| start | seconds to ready | tok/s of each pass | decode build ms a step, each pass | "
             "first pass / mean of the others |", "|---|---|---|---|---|"]
    for start in range(args.starts):
        command = [sys.executable, __file__, "--model", path, "--streams", str(args.streams), "--passes",
                   str(args.passes), "--max-tokens", str(args.max_tokens), "--child"]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout.split("\n")
        ready = next(line.split()[1] for line in out if line.startswith("ready "))
        passes = [line.split()[1:] for line in out if line.startswith("pass ")]
        rates = [float(p[0]) for p in passes]
        ratio = rates[0] / (sum(rates[1:]) / len(rates[1:])) if len(rates) > 1 else float("nan")
        lines.append(f"| {start + 1} | {ready} | {', '.join(p[0] for p in passes)} | "
                     f"{', '.join(p[1] for p in passes)} | {ratio:.2f}x |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
