"""MLX's CUDA command-buffer settings against the decode step: ``step_breakdown.py`` run once per setting, each in
its own process (MLX reads these variables once), the settings in forward then reverse order, round after round.

MLX's CUDA backend records kernels into CUDA graphs and launches a graph when it holds ``MLX_MAX_OPS_PER_BUFFER``
kernels or its inputs reach ``MLX_MAX_MB_PER_BUFFER`` MB (on an H100: 30 and 400). A decode step of a model whose
weights are several GB therefore launches dozens of small graphs, each updated and launched from the host.
``MLX_USE_CUDA_GRAPHS=0`` launches every kernel directly instead.

    python benchmarks/cuda_settings.py --model ../models/qwen3-8b --streams 1,8,16 --max-tokens 64 --rounds 2 \\
        --out docs/benchmarks/x.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

PRESETS = {
    "defaults": {},
    "mb-unbounded": {"MLX_MAX_MB_PER_BUFFER": "1000000"},
    "ops200-mb-unbounded": {"MLX_MAX_OPS_PER_BUFFER": "200", "MLX_MAX_MB_PER_BUFFER": "1000000"},
    "ops1000-mb-unbounded": {"MLX_MAX_OPS_PER_BUFFER": "1000", "MLX_MAX_MB_PER_BUFFER": "1000000"},
    "no-graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
}


def run_one(args, settings: dict[str, str], out: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_MAX_") and k != "MLX_USE_CUDA_GRAPHS"}
    command = [sys.executable, str(HERE / "step_breakdown.py"), "--streams", args.streams, "--max-tokens",
               str(args.max_tokens), "--rounds", "1", "--parts", args.parts, "--json", str(out),
               *(["--model", args.model] if args.model else ["--tiny", args.tiny])]
    done = subprocess.run(command, env={**env, **settings}, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-4000:], flush=True)  # noqa: T201 - why a setting failed
        return []
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder")
    parser.add_argument("--tiny", help="build a tiny random model of this arch instead")
    parser.add_argument("--streams", default="1,8,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="each round runs every setting twice (A..Z, Z..A)")
    parser.add_argument("--parts", default="floor,batch", help="step_breakdown.py's --parts")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma list of: " + ", ".join(PRESETS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one setting's run")
    parser.add_argument("--out", help="write a markdown section here (else print it)")
    args = parser.parse_args()

    names = args.presets.split(",")
    results: dict[str, list[list[dict]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in [*names, *names[::-1]]:
                points = run_one(args, PRESETS[name], Path(tmp) / "points.json")
                results[name].append(points)
                print(f"round {round_ + 1}, {name}: " + "; ".join(  # noqa: T201 - progress
                    f"{p['what']} x{p['streams']} {p['score']:.2f} ms" for p in points), flush=True)
    report = table(results, args)
    if args.out:
        Path(args.out).write_text(report + "\n")
    print(report)  # noqa: T201 - the report


def table(results: dict[str, list[list[dict]]], args) -> str:
    """Per point and setting: the best step time over the runs, every run's, and the ratio to MLX's defaults."""
    points = sorted({(p["what"], p["streams"]) for runs in results.values() for run in runs for p in run},
                    key=lambda k: (k[1], k[0]))
    base = "defaults"
    lines = [f"Model: `{args.model or args.tiny}`; {args.max_tokens} greedy tokens a step loop; every setting in "
             f"its own process, {2 * args.rounds} runs each (settings in forward, then reverse order). Step time in "
             "ms (best; every run); speed against MLX's defaults from the best runs.", "",
             "| what | rows | setting | step ms | every run | speed vs defaults |", "|---|---|---|---|---|---|"]
    for what, n in points:
        for name, runs in results.items():
            times = [p["score"] for run in runs for p in run if (p["what"], p["streams"]) == (what, n)]
            if not times:
                continue
            base_times = [p["score"] for run in results.get(base, []) for p in run
                          if (p["what"], p["streams"]) == (what, n)]
            ratio = f"{min(base_times) / min(times):.2f}x" if base_times else "–"
            every = ", ".join(f"{t:.2f}" for t in times)
            settings = " ".join(f"{k}={v}" for k, v in PRESETS[name].items()) or "none"
            lines.append(f"| {what} | {n} | {name} (`{settings}`) | {min(times):.2f} | {every} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
