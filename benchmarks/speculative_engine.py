"""The speculative mechanism's ceiling and overhead, in-process on the engine (no HTTP), side by side in rounds.

* ceiling: an oracle drafter proposes the target's own greedy continuation (every draft accepted), k = 2, 4, 8;
* overhead: a drafter that is always wrong (every draft rejected), k = 4, with back-off off (fixed k) and on;

each against plain decoding on the same engine, at one stream (also against mlx-lm's ``generate_step``) and at
``--streams`` concurrent streams. Rates are decode rates: tokens after the first / (last token time − first token
time), per stream at one stream, aggregate over all streams otherwise.

    python benchmarks/speculative_engine.py --tiny qwen3                      # CPU smoke run
    python benchmarks/speculative_engine.py --model ../models/qwen3-8b --out docs/benchmarks/speculative.md
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import direct_generate_step, model_folder, pick_prompts, versions  # noqa: E402


def engine_for(model, drafter, max_running: int):
    from mlxd.config.schema import EngineConfig, SpeculativeConfig
    from mlxd.engine.engine import BatchedEngine

    config = EngineConfig(max_running=max_running, warmup_tokens=2,
                          speculative=SpeculativeConfig(drafter=drafter.name, k=8, max_step_tokens=4096))
    engine = BatchedEngine(model, config, drafter=drafter)
    engine.start()
    return engine


async def stream_times(engine, request) -> tuple[list[float], dict]:
    """A request's token arrival times on an in-process engine, and its decode summary."""
    from mlxd.engine.base import Failed, Finished, Token

    times = []
    async for event in engine.submit(request).events():
        if isinstance(event, Token):
            times.append(time.perf_counter())
        elif isinstance(event, Failed):
            raise RuntimeError(event.message)
        elif isinstance(event, Finished):
            return times, event.decode or {}
    raise RuntimeError("no final event")


def measure(engine, prompts: list[list[int]], max_tokens: int, decode, tag: str) -> tuple[float, dict]:
    """Decode tokens/s (per stream for one prompt, aggregate for several) and the decode summary of the first."""
    from mlxd.engine.base import EngineRequest

    requests = [EngineRequest(request_id=f"{tag}-{i}-{time.monotonic_ns()}", prompt=p, max_tokens=max_tokens,
                              decode=decode) for i, p in enumerate(prompts)]

    async def run():
        return await asyncio.gather(*(stream_times(engine, r) for r in requests))

    results = asyncio.run(run())
    first = min(times[0] for times, _ in results)
    last = max(times[-1] for times, _ in results)
    tokens = sum(len(times) - 1 for times, _ in results)
    return tokens / (last - first), results[0][1]


def greedy_outputs(engine, prompts: list[list[int]], max_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's plain greedy continuation on this engine: what an oracle drafter proposes."""
    from mlxd.engine.base import EngineRequest, Finished, Token

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens = []
        async for event in engine.submit(EngineRequest(request_id=f"ref-{i}", prompt=prompt,
                                                       max_tokens=max_tokens)).events():
            if isinstance(event, Token):
                tokens.append(event.token)
            elif isinstance(event, Finished):
                return tokens
        raise RuntimeError("no final event")

    return {tuple(p): asyncio.run(one(i, p)) for i, p in enumerate(prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder")
    parser.add_argument("--tiny", help="build a tiny random model of this arch instead")
    parser.add_argument("--k", default="2,4,8")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best of each point is kept")
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()

    from mlx_lm import load

    from mlxd.engine.base import Plain, Speculative
    from tests.support.oracle_drafter import OracleDrafter

    path = model_folder(args.model, args.tiny)
    model, tokenizer = load(path)
    texts = pick_prompts(model, tokenizer, args.streams, args.max_tokens)
    prompts = [tokenizer.encode(t) for t in texts]
    ks = [int(k) for k in args.k.split(",")]

    # The oracle's continuations: what plain greedy decoding of this engine produces.
    right = OracleDrafter({})
    engine = engine_for(model, right, args.streams)
    outputs = greedy_outputs(engine, prompts, args.max_tokens)
    right.continuations.update(outputs)
    vocab = engine.vocab_size
    wrong_engine = engine_for(model, OracleDrafter({k: [(t + 1) % vocab for t in v] for k, v in outputs.items()}),
                              args.streams)

    points: dict[tuple[str, int], list[float]] = {}
    info: dict[tuple[str, int], dict] = {}

    def keep(label: str, n: int, rate: float, decode: dict | None = None) -> None:
        points.setdefault((label, n), []).append(rate)
        print(f"{label}, {n} stream(s): {rate:.1f} tok/s {decode or ''}", flush=True)  # noqa: T201 - progress
        if decode:
            info[(label, n)] = decode

    for _ in range(args.rounds):
        result = direct_generate_step(model, tokenizer, texts[0], args.max_tokens)
        keep("mlx-lm generate_step", 1, (result.tokens - 1) / (result.tokens / result.tokens_per_s))
        for n in (1, args.streams):
            batch = prompts[:n]
            keep("plain", n, *measure(engine, batch, args.max_tokens, Plain(), "plain"))
            for k in ks:
                keep(f"oracle k={k}", n, *measure(engine, batch, args.max_tokens,
                                                  Speculative(drafter="oracle", k=k, adaptive=False), f"o{k}"))
            for adaptive in (False, True):
                label = "always wrong k=4, back-off " + ("on" if adaptive else "off")
                keep(label, n, *measure(wrong_engine, batch, args.max_tokens,
                                        Speculative(drafter="oracle", k=4, adaptive=adaptive), label))
    engine.stop()
    wrong_engine.stop()
    print_report(args, path, points, info)


def print_report(args, path, points, info) -> None:
    lines = [f"Command: `python benchmarks/speculative_engine.py {' '.join(sys.argv[1:])}`", "",
             f"Model: `{path}`; {args.max_tokens} greedy tokens a stream; best of {args.rounds} interleaved rounds.",
             "", "| decode | streams | tok/s (best) | tok/s (median) | acceptance | tokens / step |",
             "|---|---|---|---|---|---|"]
    for (label, n), rates in points.items():
        decode = info.get((label, n), {})
        lines.append(f"| {label} | {n} | {max(rates):.1f} | {statistics.median(rates):.1f} | "
                     f"{decode.get('acceptance', '–')} | {decode.get('tokens_per_step', '–')} |")
    lines.append("")
    for n in (1, args.streams):
        plain = max(points[("plain", n)])
        for (label, m), rates in points.items():
            if m == n and label != "plain":
                lines.append(f"- {label}, {n} stream(s): {max(rates) / plain:.2f}x plain")
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions(None).items()), ""]
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    print(text)


if __name__ == "__main__":
    main()
