"""KV-cache quantization (``[engine] kv_bits``): memory, decode speed and greedy agreement at 16, 8 and 4 bits.

For each setting (unquantized: the model's dtype, float32 on the CPU and bfloat16 or float16 on GPUs; then
``kv_bits`` 8 and 4 at ``--group-size``) the model is served in process by mlxd's batched engine
(``BatchedEngine``, prefix cache off) and measured:

- KV bytes per token: what memory admission counts (the engine's warm-up measurement), and the bytes a real
  cache holds after a 256-token prompt (its prefix-cache snapshot, divided by its tokens);
- the longest context that fits ``--budget-gib`` of KV cache (admission's count: allocated in 256-token steps);
- decode tok/s at ``--streams`` (default 1 and 16) streams of ``--context``-token prompts, ``--max-tokens`` each:
  the tokens emitted after the last stream's first token, over the time from then to the last one;
- greedy agreement with the unquantized setting over ``--prompts`` prompts of ``--prompt-tokens`` tokens (windows of
  README.md, the repository's own text): the share of identical tokens over ``--agree-tokens`` generated tokens,
  the prompts that agree throughout, and where the others first diverge. ``--prompts 0`` skips it (random weights).

The script re-executes itself with OpenBLAS preloaded, as ``mlxd`` does. ``--out`` replaces this device's section
(between this script's markers) in the document, or puts it after the title.

    python benchmarks/kv_bits.py --out docs/benchmarks/memory.md
    python benchmarks/kv_bits.py --source ../models/qwen3-8b --context 2048 --max-tokens 128 --budget-gib 16 \\
        --prompts 0 --out docs/benchmarks/memory.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import with_openblas  # noqa: E402

SETTINGS = (None, 8, 4)  # kv_bits; None: the model's dtype
# Tokens in the cache whose held bytes are measured: one allocation step, so that mlx-lm's KVCache (whose state is
# its whole allocated buffer) holds no unused positions.
HELD_TOKENS = 256


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--source", default="embedded:smollm2-135m", help="[model] source: an MLX folder, a .gguf "
                        "file or the embedded model")
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128), help="kv_group_size")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding stream")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens each decoding stream generates")
    parser.add_argument("--streams", default="1,16", help="comma-separated numbers of concurrent streams")
    parser.add_argument("--budget-gib", type=float, default=1.0, help="KV budget for the longest context")
    parser.add_argument("--prompts", type=int, default=50, help="agreement prompts (0: skip agreement)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="tokens of each agreement prompt")
    parser.add_argument("--agree-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--label", default="", help="what ran it (device, model), for the document")
    parser.add_argument("--out", type=Path, help="markdown document whose section this run replaces")
    return parser.parse_args(argv)


def load_avg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").exists() else 0.0


@dataclass
class Setting:
    bits: int | None
    dtype: str = ""
    admitted_per_token: int = 0
    held_per_token: float = 0.0
    longest: int = 0
    tok_s: dict[int, float] = field(default_factory=dict)
    loads: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    refused: str = ""  # the engine's reason, when it refused this setting at start-up

    @property
    def name(self) -> str:
        return f"kv_bits = {self.bits}" if self.bits else f"unquantized ({self.dtype})"


def make_engine(model, bits: int | None, args: argparse.Namespace, max_running: int):
    from mlxd.config.schema import EngineConfig
    from mlxd.engine.engine import BatchedEngine

    config = EngineConfig(max_running=max_running, prefix_cache_bytes=0, warmup_tokens=1, kv_bits=bits,
                          kv_group_size=args.group_size, max_waiting=1024)
    engine = BatchedEngine(model, config)
    engine.start()
    return engine


async def _stream(engine, request) -> list[tuple[float, int]]:
    from mlxd.engine.base import Failed, Finished, Token

    out = []
    async for event in engine.submit(request).events():
        if isinstance(event, Token):
            out.append((time.perf_counter(), event.token))
        elif isinstance(event, Failed):
            raise RuntimeError(f"{request.request_id} failed: {event}")
        elif isinstance(event, Finished):
            return out
    raise RuntimeError("no final event")


def generate(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> list[list[tuple[float, int]]]:
    from mlxd.engine.base import EngineRequest, SamplingParams

    greedy = SamplingParams(temperature=0.0)
    requests = [EngineRequest(request_id=f"{tag}-{i}", prompt=p, max_tokens=max_tokens, sampling=greedy)
                for i, p in enumerate(prompts)]

    async def all_of() -> list[list[tuple[float, int]]]:
        return await asyncio.gather(*(_stream(engine, r) for r in requests))

    return asyncio.run(all_of())


def decode_tok_s(streams: list[list[tuple[float, int]]]) -> float:
    """Tokens emitted after the last stream's first token, over the time from then to the last token."""
    start = max(s[0][0] for s in streams)
    end = max(s[-1][0] for s in streams)
    count = sum(1 for s in streams for t, _ in s if t > start)
    return count / (end - start) if end > start else 0.0


def held_bytes_per_token(model, bits: int | None, group_size: int, num_tokens: int) -> float:
    """Bytes a real request cache holds after ``num_tokens`` prompt tokens (its snapshot, as the prefix cache keeps
    it), per token."""
    import mlx.core as mx

    from mlxd.cache.quantized import KVQuantization
    from mlxd.cache.store import take_snapshot
    from mlxd.engine.step.row import make_request_cache

    kv = KVQuantization(bits, group_size) if bits else None
    cache = make_request_cache(model, 0, kv)
    mx.eval(model(mx.array([[1 + i % 500 for i in range(num_tokens)]]), cache=cache))
    return take_snapshot(cache).num_bytes / num_tokens


def longest_context(kv_cost, budget: int) -> int:
    low, high = 0, 1 << 26
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if kv_cost.num_bytes(middle) <= budget else (low, middle - 1)
    return low


def agreement_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    text = (ROOT / "README.md").read_text()
    ids = tokenizer.encode(text)
    stride = max(1, (len(ids) - length) // max(1, count))
    return [ids[i * stride : i * stride + length] for i in range(count)]


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(min(100, vocab // 2), vocab) for _ in range(length)] for _ in range(count)]


def measure(loaded, args: argparse.Namespace, streams: list[int]) -> list[Setting]:
    """Each setting measured on an engine of its own; a setting the engine refuses at start-up (a device with no
    quantized attention for it, say) is reported with the reason."""
    from mlxd.errors import ConfigError

    agree = agreement_prompts(loaded.tokenizer, args.prompts, args.prompt_tokens) if args.prompts else []
    results = []
    for bits in SETTINGS:
        setting = Setting(bits, dtype=loaded.dtype)
        try:
            engine = make_engine(loaded.model, bits, args, max(streams))
        except ConfigError as e:
            setting.refused = str(e)
            print(f"{setting.name}: refused: {e}", flush=True)  # noqa: T201
        else:
            try:
                measure_setting(setting, engine, loaded.model, args, streams, agree)
            finally:
                engine.stop()
        results.append(setting)
    return results


def measure_setting(setting: Setting, engine, model, args: argparse.Namespace, streams: list[int],
                    agree: list[list[int]]) -> None:
    cost = engine.core.memory.kv
    setting.admitted_per_token = cost.num_bytes_per_token_total
    setting.longest = longest_context(cost, int(args.budget_gib * 1024**3))
    setting.held_per_token = held_bytes_per_token(model, setting.bits, args.group_size, HELD_TOKENS)
    for n in streams:
        setting.loads.append(load_avg())
        prompts = random_prompts(n, args.context, engine.vocab_size, seed=n)
        setting.tok_s[n] = decode_tok_s(generate(engine, prompts, args.max_tokens, f"s{n}"))
        print(f"{setting.name}: {n} streams {setting.tok_s[n]:.1f} tok/s (load {setting.loads[-1]})",  # noqa: T201
              flush=True)
    for start in range(0, len(agree), max(streams)):
        batch = agree[start : start + max(streams)]
        setting.outputs += [[t for _, t in s] for s in generate(engine, batch, args.agree_tokens, "a")]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, int, list[int]]:
    """(share of identical tokens position by position, prompts identical throughout, first divergences)."""
    same = total = whole = 0
    firsts = []
    for a, b in zip(reference, other, strict=True):
        total += len(a)
        same += sum(x == y for x, y in zip(a, b, strict=False))
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None:
            whole += 1
        else:
            firsts.append(first)
    return same / total if total else 0.0, whole, firsts


def report(args: argparse.Namespace, device: str, results: list[Setting], streams: list[int], shape: str) -> str:
    base = results[0]
    command = shlex.join(["python", "benchmarks/kv_bits.py", *sys.argv[1:]])
    lines = [
        f"<!-- kv_bits.py {device}: start -->",
        f"## KV-cache quantization, {args.label or device} ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`; {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}. Model `{args.source}` "
        f"({shape}), as mlxd serves it (dtype {base.dtype}), in process through `BatchedEngine` (prefix cache off); "
        f"kv_group_size {args.group_size}. Decode: {args.context}-token prompts, {args.max_tokens} tokens a stream; "
        "tok/s counts the tokens after the last stream's first one. Load average (1 minute) at each run: "
        + "; ".join(f"{r.name} {', '.join(f'{x:.1f}' for x in r.loads)}" for r in results) + ".",
        "",
        f"| KV cache | bytes/token (admission) | bytes/token held | vs unquantized | longest context in "
        f"{args.budget_gib:g} GiB | " + " | ".join(f"decode tok/s, {n} stream{'s' * (n > 1)}" for n in streams) + " |",
        "|---|---|---|---|---|" + "---|" * len(streams),
    ]
    for r in results:
        if r.refused:
            lines.append(f"| {r.name} | refused at start-up: {r.refused} |" + " |" * (3 + len(streams)))
            continue
        lines.append(f"| {r.name} | {r.admitted_per_token:,} | {r.held_per_token:,.0f} | "
                     f"{r.held_per_token / base.held_per_token:.3f} | {r.longest:,} | "
                     + " | ".join(f"{r.tok_s[n]:.1f}" for n in streams) + " |")
    if args.prompts:
        lines += ["", f"Greedy agreement with the unquantized cache: {args.prompts} prompts of {args.prompt_tokens} "
                  f"tokens (windows of README.md), {args.agree_tokens} tokens each.", "",
                  "| KV cache | identical tokens | prompts identical throughout | first divergence (median, min, max) |",
                  "|---|---|---|---|"]
        for r in (r for r in results[1:] if not r.refused):
            share, whole, firsts = agreement(base.outputs, r.outputs)
            where = (f"{statistics.median(firsts):.0f}, {min(firsts)}, {max(firsts)}" if firsts else "none")
            lines.append(f"| {r.name} | {share:.1%} | {whole} of {len(r.outputs)} | {where} |")
    return "\n".join([*lines, "", f"<!-- kv_bits.py {device}: end -->"])


def write(out: Path, device: str, section: str) -> None:
    start, end = f"<!-- kv_bits.py {device}: start -->", f"<!-- kv_bits.py {device}: end -->"
    text = out.read_text() if out.exists() else "# Memory\n\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        title, _, body = text.partition("\n\n")
        text = f"{title}\n\n{section}\n\n{body}"
    out.write_text(text.rstrip("\n") + "\n")


def model_shape(model) -> str:
    args = getattr(model, "args", None)
    if args is None:
        return "shape unknown"
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    return f"{args.num_hidden_layers} layers, {heads} key-value heads of {dim}"


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    with_openblas()  # benchmarks/load.py: re-run with OpenBLAS preloaded, as mlxd runs itself
    import mlx.core as mx

    from mlxd.config.schema import ModelConfig
    from mlxd.models.load import load

    streams = [int(n) for n in args.streams.split(",")]
    loaded = load(ModelConfig(source=args.source))
    device = "cpu" if mx.default_device() == mx.cpu else "gpu"
    results = measure(loaded, args, streams)
    section = report(args, device, results, streams, model_shape(loaded.model))
    print(section)  # noqa: T201
    if args.out:
        write(args.out, device, section)


if __name__ == "__main__":
    main(sys.argv[1:])
