"""Does a batched decode step pay for a cache length, or a group's first step, it has not met before?

Each pass joins a group of rows through one prompt pass (prompts of about the given length, a few tokens apart, so
the batch is left-padded as in serving) and runs ``--steps`` decode steps of mlxd's ``DecodeBatch``. Every group is
run twice in a row, with fresh rows: the first pass meets its shapes for the first time in the process, the second
meets them again. Were anything built per shape (a kernel, a plan, a CUDA graph), the first pass of each pair would
be slower. Step times are wall times of ``DecodeBatch.step`` (which waits for the previous step's tokens): the
first step after the group joins, then the median and mean over the pass, and the host's CPU time a step (this
thread's), which equals the wall time when the step is bound by the host.

``--groups`` lists groups as ``ROWSxLENGTH`` or ``ROWS+DECODINGxLENGTH`` (the group joins a batch where
``DECODING`` other rows already decode); ``--warm-up`` runs mlxd's own warm-up (``max_running`` the largest batch
met) first, as the daemon does before it reports ready, and ``--freeze`` then freezes the Python heap, as the daemon
does at ready (:mod:`mlxd.runtime.heap`). The last column counts the cycle collector's passes during the pass and
the time they held the process: a full pass over an unfrozen heap can stall a step by tens of milliseconds.

    python benchmarks/decode_lengths.py --model ../models/qwen3-8b --groups 16x30,16x600,16x1500
    python benchmarks/decode_lengths.py --model ../models/qwen3-8b --warm-up --freeze --steps 32 \\
        --groups 16x27,8x27,12x27,5x45,8+4x27
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import emit, model_folder  # noqa: E402

from mlxd.runtime.heap import PAUSES, freeze_loaded_objects  # noqa: E402


def parse_groups(text: str) -> list[tuple[int, int, int]]:
    """``16x27,8+4x27`` → ``[(16, 0, 27), (8, 4, 27)]`` (rows, rows already decoding, prompt length)."""
    groups = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\+(\d+))?x(\d+)", item.strip())
        if not match:
            raise SystemExit(f"--groups: {item!r} is not ROWSxLENGTH or ROWS+DECODINGxLENGTH")
        groups.append((int(match[1]), int(match[2] or 0), int(match[3])))
    return groups


def one_pass(model, rows: int, decoding: int, length: int, steps: int, tag: int) -> tuple[list[float], float]:
    """Wall ms of each step after the group joins, and the host's CPU ms a step."""
    import mlx.core as mx

    from mlxd.engine.step.batch import DecodeBatch

    batch = DecodeBatch(model)
    if decoding:
        _join(model, batch, decoding, 3, f"d{tag}", 2 * tag)
        for _ in range(20):
            batch.step()
    mx.synchronize()
    _join(model, batch, rows, length, f"g{tag}", 2 * tag + 1)
    cpu = time.thread_time()
    walls = []
    for _ in range(steps):
        started = time.perf_counter()
        batch.step()
        walls.append(1000 * (time.perf_counter() - started))
    cpu = 1000 * (time.thread_time() - cpu) / steps
    mx.eval(batch.inputs)
    batch.clear()
    mx.clear_cache()
    return walls, cpu


def _join(model, batch, rows: int, length: int, name: str, seed: int) -> None:
    """``rows`` prompts of about ``length`` tokens, distinct for every ``seed``, join ``batch`` in one pass."""
    from mlxd.engine.base import SamplingParams
    from mlxd.engine.step.prompts import process_prompts
    from mlxd.engine.step.row import Row

    prompts = [[(seed * 131 + i * 17 + j * 7) % 5000 + 10 for j in range(length + (i * 3) % 9)] for i in range(rows)]
    group = [Row.for_request(f"{name}-{i}", SamplingParams(), model, 0) for i in range(rows)]
    batch.add_batch(group, *process_prompts(model, group, prompts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder (else a tiny random --tiny model)")
    parser.add_argument("--tiny", default="qwen3")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--groups", default="16x30,16x600,16x1500", help="groups, each run twice")
    parser.add_argument("--warm-up", action="store_true", help="run mlxd's warm-up first")
    parser.add_argument("--freeze", action="store_true", help="then freeze the Python heap, as the daemon does")
    parser.add_argument("--out", help="append the report here (else print it)")
    args = parser.parse_args()
    groups = parse_groups(args.groups)

    import mlx.core as mx
    from mlx_lm import load

    from mlxd.runtime.cuda import prepare_cuda

    prepare_cuda("text")  # MLX's CUDA settings, as mlxd serves (the environment's own win)
    model, _ = load(model_folder(args.model, args.tiny))
    if mx.default_device() != mx.cpu:
        from mlxd.runtime.small_batch_linear import use_small_batch_kernel

        use_small_batch_kernel(model)  # as mlxd serves it
    if args.warm_up:
        from mlxd.config.schema import EngineConfig
        from mlxd.engine.step.warmup import warm_up_shapes

        started = time.perf_counter()
        warm_up_shapes(model, EngineConfig(max_running=max(rows + decoding for rows, decoding, _ in groups)))
        emit(f"warm-up: {time.perf_counter() - started:.1f} s\n", args.out)
    if args.freeze:
        emit(f"frozen: {freeze_loaded_objects()} objects\n", args.out)
    PAUSES.install()
    lines = ["| group | prompt tokens | pass | first step ms | step ms, median | mean | host CPU ms a step | "
             "collector passes (full) / ms |", "|---|---|---|---|---|---|---|---|"]
    for tag, (rows, decoding, length) in enumerate(groups):
        for name in ("first", "again"):
            passes, full, paused = sum(PAUSES.num_collections), PAUSES.num_collections[2], PAUSES.total_s
            walls, cpu = one_pass(model, rows, decoding, length, args.steps, 2 * tag + (name == "again"))
            collector = (f"{sum(PAUSES.num_collections) - passes} ({PAUSES.num_collections[2] - full}) / "
                         f"{1000 * (PAUSES.total_s - paused):.1f}")
            label = f"{rows} joining {decoding}" if decoding else f"{rows}"
            lines.append(f"| {label} | ~{length} | {name} | {walls[0]:.1f} | {statistics.median(walls):.2f} | "
                         f"{statistics.mean(walls):.2f} | {cpu:.2f} | {collector} |")
            print(lines[-1], file=sys.stderr, flush=True)  # noqa: T201 - progress
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
