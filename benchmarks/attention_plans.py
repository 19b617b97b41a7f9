"""What MLX's cuDNN attention costs serving on CUDA: prompt passes of new and seen lengths, and lone-stream decoding.

MLX's CUDA backend sends attention over several query positions to cuDNN, which builds an execution plan for each
new shape. This script runs, in one process, with the attention setting it was started with
(``MLX_CUDA_USE_CUDNN_SDPA``; mlxd sets 0 unless the operator chose):

- **prompt passes**: whole prompts of 1 and 8 rows, lengths in a fixed order that repeats some (a plan built for a
  length is reused when it comes back), each timed alone from dispatch to finish;
- **decoding**: one row on mlx-lm's plain cache after prompts of 200, 1000 and 4000 tokens, ms a token over 40
  pipelined steps.

Run it once per setting, each in its own process (MLX reads the variable once):

    python benchmarks/attention_plans.py --model PATH --out docs/benchmarks/x.md
    MLX_CUDA_USE_CUDNN_SDPA=0 python benchmarks/attention_plans.py --model PATH --out docs/benchmarks/x.md
"""

from __future__ import annotations

import argparse
import os
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

LENGTHS = (57, 58, 59, 57, 58, 120, 121, 120, 300, 301, 300)


def prompt_pass_ms(model, length: int, rows: int) -> float:
    cache = (make_prompt_cache(model) if rows == 1
             else [BatchKVCache(left_padding=[i % 3 for i in range(rows)]) for _ in model.layers])
    tokens = mx.array([[1 + (i * 7 + r) % 1000 for i in range(length)] for r in range(rows)])
    mx.synchronize()
    started = time.perf_counter()
    mx.eval(model(tokens, cache=cache)[:, -1, :])
    mx.synchronize()
    return (time.perf_counter() - started) * 1e3


def decode_ms(model, context: int, steps: int = 40) -> float:
    cache = make_prompt_cache(model)
    for start in range(0, context, 500):
        model(mx.array([[1 + i % 900 for i in range(min(500, context - start))]]), cache=cache)
        mx.eval([c.state for c in cache])
    token = mx.array([[5]])
    for _ in range(5):
        token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)[None]
        mx.eval(token)
    started = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)[None]
        mx.async_eval(token)
    mx.eval(token)
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an mlx-lm model folder")
    parser.add_argument("--out", help="append the lines here (else print them)")
    args = parser.parse_args()
    model, _ = load(args.model)
    setting = os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "unset (cuDNN on)")
    prompt_pass_ms(model, 16, 1), prompt_pass_ms(model, 16, 4)  # the kernels every pass uses
    lines = [f"MLX_CUDA_USE_CUDNN_SDPA={setting}, mlx {mx.__version__}, {mx.default_device()}"]
    for rows in (1, 8):
        passes = " ".join(f"{n}:{prompt_pass_ms(model, n, rows):.0f}" for n in LENGTHS)
        lines.append(f"- prompt passes of {rows} row(s), length:ms in order: {passes}")
    lines.append("- decoding one row: " + "; ".join(f"after {n} tokens {decode_ms(model, n):.2f} ms a token"
                                                   for n in (200, 1000, 4000)))
    text = "\n".join(lines) + "\n"
    print(text, flush=True)  # noqa: T201 - the report
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
