"""Host time of one call of mlxd's few-rows kernel (``mlxd/runtime/small_batch.py``), the call alone: no evaluation.

A batched decode step of Qwen3-8B makes 252 projection calls, and the step is bound by the host, so microseconds a
call count. This times, in one process, the calls that build a kernel node into MLX's graph (nothing is evaluated),
as the minimum over ``--batches`` batches of ``--calls`` calls, which keeps the host's swings out:

- ``constants``: the kernel as mlxd calls it (:func:`mlxd.runtime.small_batch.run`; its constants are in its source);
- ``template``: the same kernel with its constants passed as ``template`` arguments of each call, as mlxd called it
  before (MLX formats them and rebuilds the kernel's name and source on every call);
- ``layer``: a whole ``SmallBatchLinear`` call (the layer's checks, then ``run``);
- ``matmul``: MLX's own ``x @ w.T`` for the same rows, for scale.

    python benchmarks/kernel_call_cost.py --rows 8 --out docs/benchmarks/x.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dispatch_costs import emit  # noqa: E402

from mlxd.runtime import small_batch  # noqa: E402
from mlxd.runtime.small_batch_linear import SmallBatchLinear  # noqa: E402


def templated_kernel():
    """The kernel with its constants as ``template`` arguments (mlxd's call before the constants moved)."""
    return mx.fast.cuda_kernel(name="mlxd_call_cost_templated", input_names=["x", "w"], output_names=["y"],
                               header=small_batch._HEADER, source=small_batch._SOURCE.replace("ADD_BIAS", ""))


def per_call_us(call, calls: int, batches: int) -> float:
    best = float("inf")
    for _ in range(batches):
        outputs = []
        started = time.perf_counter()
        for _ in range(calls):
            outputs.append(call())
        best = min(best, time.perf_counter() - started)
        del outputs
    return best / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()

    weight = (mx.random.normal((args.n, args.k)) * 0.02).astype(mx.bfloat16)
    x = mx.random.normal((args.rows, 1, args.k)).astype(mx.bfloat16)
    mx.eval(weight, x)
    launch = small_batch.plan(weight, False)
    old = templated_kernel()
    template = [("T", weight.dtype), ("IS_BF16", True), ("TILES", launch.tiles), ("WARPS", launch.warps)]
    linear = nn.Linear(args.k, args.n, bias=False)
    linear.weight = weight
    layer = SmallBatchLinear(linear)
    calls = {
        "constants": lambda: small_batch.run(launch, x, weight),
        "template": lambda: old(inputs=[x, weight], template=template, grid=launch.grid,
                                threadgroup=launch.threadgroup, output_shapes=[(*x.shape[:-1], launch.columns)],
                                output_dtypes=[x.dtype])[0],
        "layer": lambda: layer(x),
        "matmul": lambda: x @ weight.T,
    }
    # Same results first (one evaluation each), then the timing, the forms in turn, twice.
    reference = calls["matmul"]()
    for name in ("constants", "template", "layer"):
        out = calls[name]()
        mx.eval(out, reference)
        assert mx.allclose(out.astype(mx.float32), reference.astype(mx.float32), atol=0.1).item(), name
    results = {name: [] for name in calls}
    for _ in range(2):
        for name, call in calls.items():
            results[name].append(per_call_us(call, args.calls, args.batches))
    lines = [f"Device: {mx.default_device()}, mlx {mx.__version__}; {args.rows} rows, weight {args.n} x {args.k} "
             f"bf16; min over {args.batches} batches of {args.calls} calls, two passes.", "",
             "| call | µs a call, pass 1 | pass 2 |", "|---|---|---|"]
    lines += [f"| {name} | {r[0]:.2f} | {r[1]:.2f} |" for name, r in results.items()]
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
