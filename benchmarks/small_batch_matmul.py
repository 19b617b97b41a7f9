"""mlxd's few-rows matrix product on CUDA (``mlxd/runtime/small_batch.py``) against MLX's matmul: exactness, then
host and device time of one decode step's projections.

1. **Exactness**: for every weight shape of the model (and the vocabulary projection), 2 to 16 rows, bfloat16 and
   float16, with and without a bias: the largest difference from a float32 reference, next to MLX's own matmul's
   difference from the same reference. The kernel accumulates in float32, as cuBLAS does, so the two should be
   alike; the script exits non-zero if the kernel's error is more than twice MLX's plus one unit in the last place.
2. **Time**: the 7 projections of every layer for B rows, all queued then evaluated, through MLX's matmul and
   through the kernel; ``host`` is the time to build and dispatch, ``total`` until the device has finished.
   Medians of ``--repeats``.

    python benchmarks/small_batch_matmul.py --rows 1,2,8,16 --out docs/benchmarks/x.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import emit  # noqa: E402


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The model shape a decode step is timed in (Qwen3-8B's by default)."""
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=12288)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)


def timed(build: Callable[[], list], repeats: int) -> tuple[float, float]:
    """Median host and total milliseconds of building, dispatching and finishing ``build()``'s arrays."""
    import mlx.core as mx

    host, total = [], []
    for _ in range(repeats + 2):
        mx.synchronize()
        started = time.perf_counter()
        outputs = build()
        mx.async_eval(outputs)
        dispatched = time.perf_counter()
        mx.eval(outputs)
        finished = time.perf_counter()
        host.append(dispatched - started)
        total.append(finished - started)
    # The first two runs warm MLX's kernel and graph caches.
    return statistics.median(host[2:]) * 1e3, statistics.median(total[2:]) * 1e3


def shapes(args) -> list[tuple[int, int]]:
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    return [(q, args.hidden), (kv, args.hidden), (kv, args.hidden), (args.hidden, q),
            (args.intermediate, args.hidden), (args.intermediate, args.hidden), (args.hidden, args.intermediate)]


def exactness(args) -> tuple[list[str], bool]:
    import mlx.core as mx

    from mlxd.runtime.small_batch import small_batch_matmul

    lines = ["| weight (N x K) | dtype | rows | bias | kernel max error | MLX matmul max error |", "|---|---|---|---|---|---|"]
    ok = True
    cases = sorted(set(shapes(args))) + [(args.vocab, args.hidden)]
    for n, k in cases:
        for dtype in (mx.bfloat16, mx.float16):
            weight = (mx.random.normal((n, k)) * 0.02).astype(dtype)
            bias = (mx.random.normal((n,)) * 0.1).astype(dtype)
            for rows in (2, 3, 8, 9, 16):
                for with_bias in (False, True):
                    x = mx.random.normal((rows, 1, k)).astype(dtype)
                    b = bias if with_bias else None
                    exact = x.astype(mx.float32) @ weight.astype(mx.float32).T
                    if with_bias:
                        exact = exact + b.astype(mx.float32)
                    ours = small_batch_matmul(x, weight, b)
                    theirs = x @ weight.T + (b if with_bias else 0)
                    err = mx.abs(ours.astype(mx.float32) - exact).max().item()
                    ref = mx.abs(theirs.astype(mx.float32) - exact).max().item()
                    ulp = mx.abs(exact).max().item() * (2 ** -7 if dtype == mx.bfloat16 else 2 ** -10)
                    good = ours.shape == theirs.shape and err <= 2 * ref + ulp
                    ok &= good
                    if rows in (2, 16) or not good:
                        lines.append(f"| {n} x {k} | {dtype} | {rows} | {with_bias} | {err:.4g} | {ref:.4g} |"
                                     + ("" if good else " **too large**"))
            mx.clear_cache()
    return lines, ok


def projections(args, rows: int, ours: bool, warps: int, tiles: int):
    import mlx.core as mx

    from mlxd.runtime.small_batch import MAX_ROWS, small_batch_matmul

    weights = [[(mx.random.normal(shape) * 0.02).astype(mx.bfloat16) for shape in shapes(args)]
               for _ in range(args.layers)]
    inputs = {k: mx.random.normal((rows, 1, k)).astype(mx.bfloat16) for k in {k for _, k in shapes(args)}}
    mx.eval(weights, inputs)
    if ours and rows <= MAX_ROWS:
        return lambda: [small_batch_matmul(inputs[w.shape[1]], w, warps=warps, tiles=tiles)
                        for layer in weights for w in layer]
    return lambda: [inputs[w.shape[1]] @ w.T for layer in weights for w in layer]


def timing(args) -> list[str]:
    import mlx.core as mx

    lines = ["| rows | MLX matmul host ms | MLX matmul total ms | kernel host ms | kernel total ms | total, kernel / MLX |",
             "|---|---|---|---|---|---|"]
    for rows in [int(r) for r in args.rows.split(",")]:
        theirs = timed(projections(args, rows, False, args.warps, args.tiles), args.repeats)
        mx.clear_cache()
        ours = timed(projections(args, rows, True, args.warps, args.tiles), args.repeats)
        mx.clear_cache()
        lines.append(f"| {rows} | {theirs[0]:.2f} | {theirs[1]:.2f} | {ours[0]:.2f} | {ours[1]:.2f} | "
                     f"{ours[1] / theirs[1]:.2f} |")
        print(lines[-1], flush=True)  # noqa: T201 - progress
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,8,16")
    add_shape_arguments(parser)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--warps", type=int, default=0, help="warps a block, they split K (0: by shape)")
    parser.add_argument("--tiles", type=int, default=0, help="column groups of 8 a warp (0: by N)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--skip-exactness", action="store_true")
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()
    import mlx.core as mx

    lines = [f"Device: {mx.default_device()}, mlx {mx.__version__}, {platform.platform()}. {args.layers} layers, "
             f"hidden {args.hidden}, intermediate {args.intermediate}, {args.heads} heads ({args.kv_heads} for keys "
             f"and values) of {args.head_dim}; warps {args.warps or 'by shape'}, tiles {args.tiles or 'by shape'}; "
             f"medians of "
             f"{args.repeats}.", ""]
    ok = True
    if not args.skip_exactness:
        table, ok = exactness(args)
        lines += table + [""]
        print("\n".join(table), flush=True)  # noqa: T201 - progress
    lines += timing(args)
    emit("\n".join(lines) + "\n", args.out)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
