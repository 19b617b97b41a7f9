"""A long prompt's prefill of the embedded model on the CPU: MLX's attention kernel (before) against mlxd's blocked
numpy attention (after, :mod:`mlxd.models.text_attention`), side by side.

The model is loaded as mlxd serves it on a Linux CPU (float32, OpenBLAS preloaded: the script re-executes itself
with it, as ``mlxd`` does). A prompt of ``--tokens`` random token ids runs in chunks of ``--chunk`` positions
(``configs/agents.toml``'s ``prefill_chunk``) on one cache, each chunk evaluated before the next:

- after: the whole prefill, measured through mlxd's model (every layer's prompt attention blocked).
- attention alone, one layer, at the first and the last chunk's shapes (``H`` query heads over ``H_kv`` key heads
  of 64, the chunk's queries against every key before and in it), through MLX's kernel and through the blocked
  one. A chunk's attention grows linearly with the keys before it, so the mean of the first and the last chunk
  times the number of chunks is the sum over all chunks.
- before: the after run with every layer's blocked attention replaced by MLX's, ``after + layers x (sum of MLX's
  attention - sum of blocked attention)``. ``--before-full`` also runs the whole prefill through MLX's kernel
  (on 2 cores, over half an hour for 20k tokens).

Rounds alternate (after, then the attention samples), and the load average (``/proc/loadavg``, 1 minute) is
recorded with every number: the machine may be shared. ``--out`` replaces the section between this script's
markers in the document (or puts it first).

    python benchmarks/long_prefill.py --tokens 20480 --chunk 2048 --rounds 2 --out docs/benchmarks/default-model.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import with_openblas  # noqa: E402

START, END = "<!-- long_prefill.py: start -->", "<!-- long_prefill.py: end -->"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="embedded:smollm2-135m", help="[model] source to load")
    parser.add_argument("--tokens", type=int, default=20480, help="prompt length")
    parser.add_argument("--chunk", type=int, default=2048, help="positions a prompt pass (prefill_chunk)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of after and the samples")
    parser.add_argument("--before-full", action="store_true", help="also run the whole prefill through MLX's "
                        "attention (over half an hour for 20k tokens on 2 cores)")
    parser.add_argument("--out", type=Path, help="markdown document whose section this run replaces")
    return parser.parse_args(argv)




def load_avg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


@dataclass
class Results:
    after: list[tuple[float, float]] = field(default_factory=list)  # (seconds, load)
    before_full: list[tuple[float, float]] = field(default_factory=list)
    # (kernel, chunk index) -> [(seconds, load)] of one layer's attention
    attention: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)


def load_model(source: str):
    from mlxd.config.schema import ModelConfig
    from mlxd.models.load import load

    return load(ModelConfig(source=source, context_length=65536))


def prefill(model, tokens: list[int], chunk: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    started = time.perf_counter()
    for start in range(0, len(tokens), chunk):
        logits = model(mx.array([tokens[start : start + chunk]]), cache=cache)
        mx.eval(logits[:, -1], [c.state for c in cache])
    return time.perf_counter() - started


def attention_once(kernel: str, shape: tuple[int, int, int, int], queries: int, keys: int) -> float:
    """One layer's attention of ``queries`` positions against ``keys`` (the last queries), causal."""
    import mlx.core as mx

    from mlxd.models.prompt_attention import prompt_attention

    heads, kv_heads, dim, _ = shape
    q = mx.random.normal((1, heads, queries, dim))
    k, v = mx.random.normal((1, kv_heads, keys, dim)), mx.random.normal((1, kv_heads, keys, dim))
    mx.eval(q, k, v)
    started = time.perf_counter()
    if kernel == "mlx":
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask="causal"))
    else:
        mx.eval(prompt_attention(q, k, v, dim**-0.5, "causal"))
    return time.perf_counter() - started


def model_shape(model) -> tuple[int, int, int, int]:
    attention = model.model.layers[0].self_attn
    dim = attention.q_proj.weight.shape[0] // attention.n_heads
    return attention.n_heads, attention.n_kv_heads, dim, len(model.model.layers)


def run_rounds(args: argparse.Namespace, model, tokens: list[int], results: Results) -> None:
    shape = model_shape(model)
    chunks = -(-args.tokens // args.chunk)
    for round_ in range(args.rounds):
        load = load_avg()
        seconds = prefill(model, tokens, args.chunk)
        results.after.append((seconds, load))
        print(f"round {round_ + 1}: after {seconds:.1f} s (load {load})", flush=True)
        for index in (0, chunks - 1):
            queries = min(args.chunk, args.tokens - index * args.chunk)
            for kernel in (("mlx", "blocked") if round_ % 2 == 0 else ("blocked", "mlx")):
                load = load_avg()
                seconds = attention_once(kernel, shape, queries, index * args.chunk + queries)
                results.attention.setdefault((kernel, index), []).append((seconds, load))
                print(f"  chunk {index + 1} attention, {kernel}: {seconds:.2f} s (load {load})", flush=True)


def run_before_full(args: argparse.Namespace, tokens: list[int], results: Results) -> None:
    """The whole prefill through mlx-lm's own attention modules (mlxd's load, then the modules swapped back)."""
    from mlx_lm.models import llama

    model = load_model(args.source).model
    for layer in model.model.layers:
        plain = llama.Attention(model.args)
        plain.update_modules({name: getattr(layer.self_attn, name)
                              for name in ("q_proj", "k_proj", "v_proj", "o_proj", "rope")})
        layer.update_modules({"self_attn": plain})
    load = load_avg()
    results.before_full.append((prefill(model, tokens, args.chunk), load))


def median(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(seconds for seconds, _ in pairs)


def loads(pairs: list[tuple[float, float]]) -> str:
    return ", ".join(f"{load:.1f}" for _, load in pairs)


def report(args: argparse.Namespace, shape: tuple[int, int, int, int], results: Results) -> str:
    heads, kv_heads, dim, layers = shape
    chunks = -(-args.tokens // args.chunk)
    last = chunks - 1

    def total(kernel: str) -> float:  # one layer's attention summed over the chunks
        return chunks * (median(results.attention[(kernel, 0)]) + median(results.attention[(kernel, last)])) / 2

    after = median(results.after)
    before = after + layers * (total("mlx") - total("blocked"))
    lines = [
        START,
        f"## A {args.tokens:,}-token prompt's prefill on the CPU: MLX's attention against blocked numpy attention "
        f"({time.strftime('%Y-%m-%d')})",
        "",
        f"`python benchmarks/long_prefill.py --tokens {args.tokens} --chunk {args.chunk} --rounds {args.rounds}"
        f"{' --before-full' if args.before_full else ''}`; {platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.platform()}. Model `{args.source}` as mlxd serves it on the CPU (float32, OpenBLAS "
        f"preloaded): {layers} layers, {heads} query heads over {kv_heads} key heads of {dim}; chunks of "
        f"{args.chunk} positions on one cache. Medians of {args.rounds} alternating rounds; the load average "
        "(1 minute) is given with each number: the machine was shared with other test runs.",
        "",
        "| attention | prefill | tok/s | how measured | load |",
        "|---|---|---|---|---|",
        f"| MLX's kernel (before) | {before:.0f} s | {args.tokens / before:.0f} | after + {layers} layers x "
        f"(MLX's - blocked attention, summed over the {chunks} chunks) | {loads(results.after)} |",
        f"| blocked numpy (after) | {after:.0f} s | {args.tokens / after:.0f} | whole prefill | "
        f"{loads(results.after)} |",
    ]
    if results.before_full:
        full = median(results.before_full)
        lines.append(f"| MLX's kernel, whole prefill | {full:.0f} s | {args.tokens / full:.0f} | whole prefill | "
                     f"{loads(results.before_full)} |")
    lines += ["", "One layer's attention (seconds, each round):", "",
              "| chunk | queries x keys | MLX's kernel | blocked numpy | speed-up | load |", "|---|---|---|---|---|---|"]
    for index in (0, last):
        queries = min(args.chunk, args.tokens - index * args.chunk)
        mlx, blocked = results.attention[("mlx", index)], results.attention[("blocked", index)]
        lines.append(f"| {index + 1} of {chunks} | {queries} x {index * args.chunk + queries} | "
                     f"{', '.join(f'{s:.2f}' for s, _ in mlx)} | {', '.join(f'{s:.2f}' for s, _ in blocked)} | "
                     f"{median(mlx) / median(blocked):.1f}x | {loads(mlx + blocked)} |")
    return "\n".join([*lines, "", END])


def write(out: Path, section: str) -> None:
    text = out.read_text() if out.exists() else ""
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        title, _, body = text.partition("\n\n")
        text = f"{title}\n\n{section}\n\n{body}" if title.startswith("# ") else f"{section}\n\n{text}"
    out.write_text(text)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    with_openblas()  # benchmarks/load.py: re-run with OpenBLAS preloaded, as mlxd runs itself
    import numpy as np

    model = load_model(args.source).model
    tokens = np.random.default_rng(0).integers(100, 40000, args.tokens).tolist()
    results = Results()
    run_rounds(args, model, tokens, results)
    if args.before_full:
        run_before_full(args, tokens, results)
    section = report(args, model_shape(model), results)
    print(section)
    if args.out:
        write(args.out, section)


if __name__ == "__main__":
    main(sys.argv[1:])
