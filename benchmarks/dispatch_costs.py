"""What a batched decode step's operations cost the host and the device, op by op, at 1, 8 and 16 rows.

A decode step of a dense model is, per layer, seven projections and one attention over the cache. This script times
those operations alone, in the shapes of one decode step (Qwen3-8B's by default), with random bf16 weights:

- **projections**: the seven projections of every layer for B rows (``x @ W.T``), all queued, then evaluated;
- **attention**: ``mx.fast.scaled_dot_product_attention`` for one query position over a cache of ``--context``
  positions, once per layer: with no mask (what a lone stream on mlx-lm's plain cache passes), with the boolean
  mask that mlx-lm's batched cache builds for left-padded rows, with the same mask as additive bf16 values, and
  row by row without a mask (each row's keys from its first real position).

For each it reports the host's time to build and dispatch the work (``host``: graph building plus ``async_eval``)
and the time until the device has finished it (``total``), as medians. Where ``host`` is close to ``total``, the
host is what limits that work.

    python benchmarks/dispatch_costs.py --rows 1,8,16 --out docs/benchmarks/x.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import mlx.core as mx


def timed(build: Callable[[], list[mx.array]], repeats: int) -> tuple[float, float]:
    """Median host and total milliseconds of building, dispatching and finishing ``build()``'s arrays."""
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


def projections(args, rows: int) -> Callable[[], list[mx.array]]:
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    shapes = [(q, args.hidden), (kv, args.hidden), (kv, args.hidden), (args.hidden, q),
              (args.intermediate, args.hidden), (args.intermediate, args.hidden), (args.hidden, args.intermediate)]
    weights = [[mx.random.normal(shape, dtype=mx.bfloat16) * 0.02 for shape in shapes] for _ in range(args.layers)]
    inputs = {k: mx.random.normal((rows, k), dtype=mx.bfloat16) for k in {k for _, k in shapes}}
    mx.eval(weights, inputs)
    return lambda: [inputs[w.shape[1]] @ w.T for layer in weights for w in layer]


def attention(args, rows: int, mask_kind: str) -> Callable[[], list[mx.array]]:
    # Keys and values are views of a larger buffer, as in mlx-lm's caches (which grow in steps of 256).
    capacity = (args.context // 256 + 1) * 256
    shape = (rows, args.kv_heads, capacity, args.head_dim)
    keys = mx.random.normal(shape, dtype=mx.bfloat16)[:, :, : args.context]
    values = mx.random.normal(shape, dtype=mx.bfloat16)[:, :, : args.context]
    queries = mx.random.normal((rows, args.heads, 1, args.head_dim), dtype=mx.bfloat16)
    padding = mx.array([(i * 7) % 32 for i in range(rows)])
    boolean = mx.arange(args.context)[None, None, None, :] >= padding[:, None, None, None]
    scale = args.head_dim ** -0.5
    if mask_kind == "each row alone, unmasked":
        starts = padding.tolist()
        mx.eval(keys, values, queries)
        return lambda: [mx.fast.scaled_dot_product_attention(queries[i : i + 1], keys[i : i + 1, :, start:],
                                                              values[i : i + 1, :, start:], scale=scale)
                        for _ in range(args.layers) for i, start in enumerate(starts)]
    mask = {"none": None, "boolean mask": boolean,
            "additive bf16 mask": mx.where(boolean, 0.0, -mx.inf).astype(mx.bfloat16)}[mask_kind]
    mx.eval(keys, values, queries, *([mask] if mask is not None else []))
    return lambda: [mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
                    for _ in range(args.layers)]


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The model shape a decode step is timed in (Qwen3-8B's by default)."""
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=12288)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)


def emit(text: str, out: str | None) -> None:
    """Append the report to ``out``, or print it."""
    if out:
        with open(out, "a") as f:
            f.write(text)
    else:
        print(text)  # noqa: T201 - the report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,16")
    add_shape_arguments(parser)
    parser.add_argument("--context", type=int, default=300, help="cache positions the attention reads")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()

    lines = [f"Device: {mx.default_device()}, mlx {mx.__version__}, {platform.platform()}. {args.layers} layers, "
             f"hidden {args.hidden}, intermediate {args.intermediate}, {args.heads} heads ({args.kv_heads} for keys "
             f"and values) of {args.head_dim}, attention over {args.context} positions; medians of {args.repeats}.",
             "", "| work (one decode step's worth) | rows | host ms | total ms |", "|---|---|---|---|"]
    for rows in [int(r) for r in args.rows.split(",")]:
        cases = [(f"{7 * args.layers} projections", projections(args, rows))]
        cases += [(f"{args.layers} attentions, {kind}", attention(args, rows, kind))
                  for kind in ("none", "boolean mask", "additive bf16 mask", "each row alone, unmasked")]
        for name, build in cases:
            host, total = timed(build, args.repeats)
            lines.append(f"| {name} | {rows} | {host:.2f} | {total:.2f} |")
            print(lines[-1], flush=True)  # noqa: T201 - progress
        mx.clear_cache()
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
