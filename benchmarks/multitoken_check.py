"""Does a forward pass of several tokens over a cache agree with the same tokens fed one at a time?

Speculative verification and chunked prefill both run a pass of L > 1 query positions over a non-empty cache.
This script checks that path on whatever backend MLX runs on (it was written for MLX's CUDA backend, where
speculation's verify steps were slow and never accepted a draft), with an mlx-lm model folder:

1. verify: prefill a prompt, then feed 3 greedy tokens in one pass, and compare its logits with 3 one-token
   passes (max |difference|, argmax agreement, the top-1/top-2 gap of the one-token logits). Done with the
   plain cache (mlx-lm passes the string mask ``"causal"``) and with a one-row ``BatchKVCache`` (an array mask).
2. chunked prefill: the last logits of a 512-token prompt processed whole against 4 chunks of 128.
3. cost: milliseconds of a 1-, 3- and 5-token pass over a 600-token cache, with each cache kind.

    python benchmarks/multitoken_check.py --model ../models/qwen3-8b [--out docs/benchmarks/file.md]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache


def _batch_cache(model) -> list:
    return [BatchKVCache(left_padding=[0]) for _ in model.layers]


def _cache(model, kind: str) -> list:
    return make_prompt_cache(model) if kind == "plain" else _batch_cache(model)


def _logits(model, ids: list[int], cache) -> mx.array:
    out = model(mx.array([ids]), cache=cache)[0].astype(mx.float32)
    mx.eval(out)
    return out


def verify_check(model, prompt: list[int], kind: str) -> list[str]:
    cache = _cache(model, kind)
    first = int(mx.argmax(_logits(model, prompt, cache)[-1]))
    tokens, sequential = [first], []
    for _ in range(3):
        row = _logits(model, [tokens[-1]], cache)[-1]
        sequential.append(row)
        tokens.append(int(mx.argmax(row)))
    cache = _cache(model, kind)
    _logits(model, prompt, cache)
    together = _logits(model, tokens[:3], cache)
    lines = []
    for i, seq in enumerate(sequential):
        top2 = mx.sort(seq)[-2:]
        diff = float(mx.max(mx.abs(seq - together[i])))
        agree = int(mx.argmax(seq)) == int(mx.argmax(together[i]))
        lines.append(f"| verify, {kind} cache | position {i} | max abs diff {diff:.4f} | argmax agrees: {agree} | "
                     f"top-1 minus top-2: {float(top2[1] - top2[0]):.4f} |")
    return lines


def chunk_check(model, prompt: list[int], kind: str, chunk: int = 128) -> str:
    whole = _logits(model, prompt, _cache(model, kind))[-1]
    cache = _cache(model, kind)
    for start in range(0, len(prompt), chunk):
        last = _logits(model, prompt[start:start + chunk], cache)[-1]
    diff = float(mx.max(mx.abs(whole - last)))
    agree = int(mx.argmax(whole)) == int(mx.argmax(last))
    return f"| chunked prefill ({len(prompt)} in {chunk}s), {kind} cache | last position | max abs diff {diff:.4f} | argmax agrees: {agree} | |"


def cost_check(model, prompt: list[int], kind: str, reps: int = 10) -> list[str]:
    lines = []
    for width in (1, 3, 5):
        cache = _cache(model, kind)
        _logits(model, prompt, cache)
        times = []
        for _ in range(reps + 2):
            start = time.perf_counter()
            _logits(model, prompt[:width], cache)
            times.append(time.perf_counter() - start)
        times = sorted(times[2:])
        lines.append(f"| cost, {kind} cache | {width}-token pass over ~{len(prompt)} cached | "
                     f"median {1000 * times[len(times) // 2]:.1f} ms | min {1000 * times[0]:.1f} ms | |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    model, _ = load(args.model)
    vocab = model.args.vocab_size
    ids = [int(x) for x in mx.random.randint(100, min(vocab, 4000), (600,), key=mx.random.key(0)).tolist()]
    lines = [f"Device: {mx.default_device()}, model {args.model}", "",
             "| check | where | measure | result | note |", "|---|---|---|---|---|"]
    for kind in ("plain", "batch"):
        lines += verify_check(model, ids[:64], kind)
        lines.append(chunk_check(model, ids[:512], kind))
        lines += cost_check(model, ids, kind)
        print("\n".join(lines), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
