"""The first image requests after a vision model's server reports ready: is there a cold stall?

For each server (this tree's mlxd, optionally another mlxd source tree as a baseline, and this tree with other
``[vision] warm_up_image_sizes``), round after round: start
a fresh process, wait for ``/health`` 200 (the seconds it took are the start-up cost), then send two image requests
one after the other, each with an image the server has not seen, and record their times to first token. With no
stall the first equals the second. Then each conversation's second turn (its answer and a new question: a
prefix-cache hit), the first of which is the first such turn of the process.

    python benchmarks/first_image.py --model ../models/qwen2_5_vl_7b --baseline-mlxd ../base --rounds 2 \\
        --out docs/benchmarks/x.md
    python benchmarks/first_image.py --model ../models/qwen2_5_vl_7b --warm-up-sizes "224,448" --rounds 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load as loadgen  # noqa: E402
from vision import OFFLINE, chat, image_turn, mlxd_server  # noqa: E402


def one_start(label: str, args, tmp: Path, env: dict | None, round_: int, sizes: str | None = None) -> str:
    spec = mlxd_server(f"{label.replace(' ', '-')}-{round_}", args.model, tmp)
    if sizes is not None:
        config = Path(spec.command[spec.command.index("--config") + 1])
        config.write_text(config.read_text() + f"[vision]\nwarm_up_image_sizes = [{sizes}]\n")
    port = loadgen.port_of(spec.command)
    started = time.perf_counter()
    with loadgen.serve(spec.command, port, tmp / f"{label}-{round_}.log", spec.health, {**OFFLINE, **(env or {})}):
        ready = time.perf_counter() - started
        turns = [[image_turn("What is in this picture?", 1000 * round_ + i, args.image_size)] for i in range(2)]
        firsts = [chat(port, spec.model, turn, 8) for turn in turns]
        seconds = [chat(port, spec.model, [*turn, {"role": "assistant", "content": "".join(first.text)},
                                           {"role": "user", "content": "And what colours are in it?"}], 8)
                   for turn, first in zip(turns, firsts, strict=True)]
    ttfts = [s.ttft for s in firsts]
    again = [s.ttft for s in seconds]
    line = (f"| {label} | {round_ + 1} | {ready:.1f} | {ttfts[0]:.3f} | {ttfts[1]:.3f} | {ttfts[0] / ttfts[1]:.2f} "
            f"| {again[0]:.3f} ({seconds[0].cached}) | {again[1]:.3f} ({seconds[1].cached}) |")
    print(line, flush=True)  # noqa: T201 - progress
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a vision-language model folder")
    parser.add_argument("--baseline-mlxd", help="another mlxd source tree, started the same way")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--warm-up-sizes", help="also serve this tree with [vision] warm_up_image_sizes = [THIS] "
                                                "(comma list of pixels a side)")
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()

    servers = [("mlxd", None, None)]
    if args.baseline_mlxd:
        base = str(Path(args.baseline_mlxd).resolve())
        servers.append(("mlxd baseline", {"PYTHONPATH": os.pathsep.join([base, os.environ.get("PYTHONPATH", "")]),
                                          "PYTHONSAFEPATH": "1"}, None))
    if args.warm_up_sizes:
        servers.append((f"mlxd, warm-up sizes {args.warm_up_sizes}", None, args.warm_up_sizes))
    lines = [f"Model: `{args.model}`; images {args.image_size} px, 8 tokens a request, greedy.", "",
             "| server | start | seconds to ready | first image TTFT (s) | second image TTFT (s) | first / second "
             "| first conversation's turn 2 TTFT (s) (cached tokens) | second conversation's turn 2 |",
             "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for label, env, sizes in servers if round_ % 2 == 0 else servers[::-1]:
                lines.append(one_start(label, args, Path(tmp), env, round_, sizes))
    loadgen.emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
