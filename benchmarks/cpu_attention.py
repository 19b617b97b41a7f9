"""Vision-tower attention on the CPU: MLX's fused call against mlxd's (``mlxd.models.cpu_attention``), side by side.

For each shape (patches, heads, head size) of one image's whole-image attention, the script times
``mx.fast.scaled_dot_product_attention`` and ``cpu_attention`` on the same random float32 inputs, alternating, and
checks they agree. The default shapes are a 448-px image in the tiny Qwen2.5-VL benchmark model, SmolVLM's tower
(SigLIP base, 512 px) and Gemma 3's (SigLIP so400m, 896 px), one layer each.

    python benchmarks/cpu_attention.py --shapes "1024x2x32,1024x12x64,4096x16x72" --out docs/benchmarks/x.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from dispatch_costs import emit  # noqa: E402

from mlxd.models.cpu_attention import cpu_attention  # noqa: E402


def seconds(run) -> float:
    start = time.perf_counter()
    mx.eval(run())
    return time.perf_counter() - start


def compare(shape: str, rounds: int) -> str:
    """The table row of one ``patches x heads x head size`` shape."""
    length, heads, dim = (int(n) for n in shape.split("x"))
    q, k, v = (mx.random.normal((1, heads, length, dim), key=mx.random.key(i)) for i in range(3))
    mx.eval(q, k, v)
    calls = {"mlx": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5),
             "ours": lambda: cpu_attention(q, k, v, dim**-0.5)}
    times: dict[str, list[float]] = {"mlx": [], "ours": []}
    for round_ in range(rounds):
        for name in (("mlx", "ours") if round_ % 2 == 0 else ("ours", "mlx")):
            times[name].append(seconds(calls[name]))
    diff = float(mx.abs(calls["mlx"]() - calls["ours"]()).max())
    mlx_ms, ours_ms = (1000 * statistics.median(times[n]) for n in ("mlx", "ours"))
    return f"| {shape} | {mlx_ms:.1f} | {ours_ms:.1f} | {mlx_ms / ours_ms:.2f}x | {diff:.1e} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1024x2x32,1024x12x64,4096x16x72", help="patches x heads x head size")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; one timed call each a round")
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)

    lines = [f"Device {mx.default_device()}, {platform.processor() or platform.machine()}, MLX {mx.__version__}; "
             f"one image's attention, float32, median of {args.rounds} alternating rounds.", "",
             "| patches x heads x head size | MLX's fused call (ms) | cpu_attention (ms) | ratio | largest difference |",
             "|---|---|---|---|---|"]
    lines += [compare(shape, args.rounds) for shape in args.shapes.split(",")]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
