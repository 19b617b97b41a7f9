"""Does a batched decode step pay for a cache length it has not met before?

Each pass joins ``--streams`` rows through one prompt pass (prompts of about the given length, a few tokens apart,
so the batch is left-padded as in serving) and runs ``--steps`` decode steps of mlxd's ``DecodeBatch``. Every
length is run twice in a row, with fresh rows: the first pass meets each cache length for the first time in the
process, the second meets the same lengths again. Were anything built per length (a kernel, a plan), the first
pass of each pair would be slower. Step times are wall times of ``DecodeBatch.step`` (which waits for the previous
step's tokens), medians and means over the pass.

    python benchmarks/decode_lengths.py --model ../models/qwen3-8b --streams 16 --lengths 30,600,1500
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import model_folder  # noqa: E402


def one_pass(model, streams: int, length: int, steps: int, tag: int) -> list[float]:
    import mlx.core as mx

    from mlxd.engine.base import SamplingParams
    from mlxd.engine.batch import DecodeBatch
    from mlxd.engine.prompts import process_prompts
    from mlxd.engine.row import Row

    prompts = [[(tag * 131 + i * 17 + j * 7) % 5000 + 10 for j in range(length + (i * 3) % 9)] for i in range(streams)]
    rows = [Row.for_request(f"r{tag}-{i}", SamplingParams(), model, 0) for i in range(streams)]
    batch = DecodeBatch(model)
    batch.add_batch(rows, *process_prompts(model, rows, prompts))
    walls = []
    for _ in range(steps):
        started = time.perf_counter()
        batch.step()
        walls.append(1000 * (time.perf_counter() - started))
    mx.eval(batch.inputs)
    batch.clear()
    mx.clear_cache()
    return walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder (else a tiny random --tiny model)")
    parser.add_argument("--tiny", default="qwen3")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--lengths", default="30,600,1500", help="prompt lengths, each run twice")
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(model_folder(args.model, args.tiny))
    if mx.default_device() != mx.cpu:
        from mlxd.runtime.small_batch_linear import use_small_batch_kernel

        use_small_batch_kernel(model)  # as mlxd serves it
    print("| prompt tokens | pass | step ms, median | mean | first three |")  # noqa: T201 - the report
    print("|---|---|---|---|---|")  # noqa: T201
    tag = 0
    for length in (int(n) for n in args.lengths.split(",")):
        for name in ("first", "again"):
            tag += 1
            walls = one_pass(model, args.streams, length, args.steps, tag)
            print(f"| ~{length} | {name} | {statistics.median(walls):.2f} | {statistics.mean(walls):.2f} | "  # noqa: T201
                  f"{', '.join(f'{w:.1f}' for w in walls[:3])} |", flush=True)


if __name__ == "__main__":
    main()
