"""The engine's passes right after its warm-up, in process (no HTTP): is the first slower than the next ones?

``load.py`` measures the first pass of concurrent streams after ``/health`` turns 200 against the second, through
HTTP. This runs the same kind of pass against the engine alone: the model loaded as mlxd loads it, the engine
started (its warm-up included) and the heap frozen as the daemon does at ready, then ``--passes`` passes of
``--streams`` concurrent requests, each pass with prompts of its own. If the first pass is level with the others
here but not through HTTP, what slows it is outside the engine's step.

Each pass also reports what the host did meanwhile, to tell a slow pass of the engine from a busy host: the CPU
seconds this process used per second of the pass, the times the kernel took the CPU from it (involuntary context
switches), the CPU seconds everything else on the machine used (busy jiffies of ``/proc/stat`` less this
process's), the time the hypervisor gave this machine's CPUs to others (``steal``), and the speed of the CPU
itself (``--probe``): a probe process beside the engine repeats a fixed piece of Python on another core, and its
rounds a second during each pass say whether the same work ran slower then. ``--arms`` runs the starts under
different environment settings (MLX's, say) in turn, and sums up each: how the first pass compares with the others,
and how often it was the slowest of its start.

    python benchmarks/engine_passes.py --tiny qwen3                                  # CPU smoke run
    python benchmarks/engine_passes.py --model ../models/qwen3-8b --starts 2 --out docs/benchmarks/x.md
    python benchmarks/engine_passes.py --model ../models/qwen3-8b --starts 6 --arms "defaults;MLX_X=1,MLX_Y=2"
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import struct
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dispatch_costs import emit  # noqa: E402
from load import model_folder, story_prompt  # noqa: E402


def one_start(path: str, streams: int, passes: int, max_tokens: int, with_probe: bool) -> None:
    """Load, start and warm the engine, then print one line per pass: tok/s and the engine's ms per step."""
    from step_breakdown import engine_run

    from mlxd.config.schema import EngineConfig, ModelConfig
    from mlxd.engine.engine import BatchedEngine
    from mlxd.models.load import load
    from mlxd.runtime.heap import freeze_loaded_objects

    loaded = load(ModelConfig(source=path))
    engine = BatchedEngine(loaded.model, EngineConfig(max_running=streams))
    started = time.perf_counter()
    engine.start()
    print(f"ready {time.perf_counter() - started:.1f}", flush=True)  # noqa: T201 - read by the parent
    freeze_loaded_objects()
    probe = Probe() if with_probe else None
    try:
        for p in range(passes):
            host = HostClock(probe)
            rate, phases = engine_run(engine, prompts(loaded.tokenizer, p, streams), max_tokens, f"p{p}")
            load = host.read()
            print(f"pass {rate:.0f} {phases['decode_build']:.2f} {phases['steps']} {load['own']:.2f} "  # noqa: T201
                  f"{load['preempted']} {load['others']:.2f} {load['steal']:.2f} {load['probe']:.0f}", flush=True)
    finally:
        engine.stop()
        if probe is not None:
            probe.stop()


PROBE = """
import struct, sys
from multiprocessing import shared_memory
counter, rounds = shared_memory.SharedMemory(sys.argv[1]), 0
while True:
    sum(range(20000))
    rounds += 1
    counter.buf[:8] = struct.pack("Q", rounds)
"""


class Probe:
    """A process repeating a fixed piece of Python (``PROBE``) and counting its rounds in shared memory."""

    def __init__(self) -> None:
        self.memory = shared_memory.SharedMemory(create=True, size=8)
        self.process = subprocess.Popen([sys.executable, "-c", PROBE, self.memory.name])

    def rounds(self) -> int:
        return struct.unpack("Q", bytes(self.memory.buf[:8]))[0]

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.memory.close()
        self.memory.unlink()


class HostClock:
    """What the host did since this was made: this process's CPU seconds per wall second (``own``), its involuntary
    context switches (``preempted``), the CPU seconds of everything else (``others``, the probe's included) and of
    the hypervisor's steal (``steal``), from ``getrusage`` and ``/proc/stat`` (Linux), and the probe's rounds a
    second (``probe``)."""

    def __init__(self, probe: Probe | None) -> None:
        self.probe, self.probe_rounds = probe, probe.rounds() if probe is not None else 0
        self.wall, self.usage, self.stat = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), _stat()

    def read(self) -> dict[str, float]:
        wall, usage, stat = time.perf_counter() - self.wall, resource.getrusage(resource.RUSAGE_SELF), _stat()
        probe = (self.probe.rounds() - self.probe_rounds) / wall if self.probe is not None else 0.0
        own = (usage.ru_utime + usage.ru_stime) - (self.usage.ru_utime + self.usage.ru_stime)
        tick = os.sysconf("SC_CLK_TCK")
        busy = (sum(stat[:3]) + sum(stat[4:7]) - sum(self.stat[:3]) - sum(self.stat[4:7])) / tick
        return {"own": own / wall, "preempted": usage.ru_nivcsw - self.usage.ru_nivcsw,
                "others": max(busy - own, 0.0), "steal": (stat[7] - self.stat[7]) / tick, "probe": probe}


def _stat() -> list[int]:
    """The machine's CPU jiffies: user, nice, system, idle, iowait, irq, softirq, steal."""
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:9]]


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
    parser.add_argument("--arms", default="defaults",
                        help="';'-separated environment settings, each 'NAME=VALUE,...' or 'defaults'; the starts "
                        "take them in turn")
    parser.add_argument("--probe", action="store_true", help="run the CPU-speed probe beside the engine")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()
    path = model_folder(args.model, args.tiny)
    if args.child:
        one_start(path, args.streams, args.passes, args.max_tokens, args.probe)
        return
    arms = [arm.strip() for arm in args.arms.split(";")]
    lines = [f"Model: `{path}`; {args.streams} streams, {args.max_tokens} tokens each, {args.passes} passes a start.",
             "", "| start | environment | seconds to ready | tok/s of each pass | decode build ms a step, each pass | "
             "first pass / mean of the others | CPU s / s of this process | involuntary switches | CPU s of "
             "others | steal s | probe rounds / s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    results: dict[str, list[list[float]]] = {arm: [] for arm in arms}
    for start in range(args.starts):
        arm = arms[start % len(arms)]
        passes, ready = run_start(path, args, arm)
        rates = [float(p[0]) for p in passes]
        results[arm].append(rates)
        column = [", ".join(p[i] for p in passes) for i in range(8)]
        lines.append(f"| {start + 1} | {arm} | {ready} | {column[0]} | {column[1]} | {first_ratio(rates):.2f}x | "
                     f"{column[3]} | {column[4]} | {column[5]} | {column[6]} | {column[7] if args.probe else '-'} |")
    lines += ["", "| environment | starts | first pass / mean of the others, median (range) | first pass the slowest "
              "| median tok/s of all passes |", "|---|---|---|---|---|"]
    for arm, starts in results.items():
        if not starts:
            continue
        ratios = [first_ratio(rates) for rates in starts]
        slowest = sum(rates[0] == min(rates) for rates in starts)
        lines.append(f"| {arm} | {len(starts)} | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-"
                     f"{max(ratios):.2f}) | {slowest} of {len(starts)} (by chance: 1 in {args.passes}) | "
                     f"{statistics.median(r for rates in starts for r in rates):.0f} |")
    emit("\n".join(lines) + "\n", args.out)


def run_start(path: str, args: argparse.Namespace, arm: str) -> tuple[list[list[str]], str]:
    """One fresh process under ``arm``'s environment: its pass lines (split) and its seconds to ready."""
    env = dict(os.environ)
    if arm != "defaults":
        env.update(setting.split("=", 1) for setting in arm.split(","))
    command = [sys.executable, __file__, "--model", path, "--streams", str(args.streams), "--passes",
               str(args.passes), "--max-tokens", str(args.max_tokens), "--child"] + (["--probe"] if args.probe else [])
    child = subprocess.run(command, capture_output=True, text=True, env=env)
    out = child.stdout.split("\n")
    passes = [line.split()[1:] for line in out if line.startswith("pass ")]
    if len(passes) < args.passes:  # a failure at exit, after every pass, does not void them
        raise SystemExit(f"a start under {arm} ended with status {child.returncode}:\n{child.stderr[-3000:]}")
    return passes, next(line.split()[1] for line in out if line.startswith("ready "))


def first_ratio(rates: list[float]) -> float:
    return rates[0] / statistics.mean(rates[1:]) if len(rates) > 1 else float("nan")


if __name__ == "__main__":
    main()
