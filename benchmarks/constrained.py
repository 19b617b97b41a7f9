"""The per-token cost of grammar-constrained decoding: tokens per second with and without a JSON-schema grammar, for
one stream and for 8 streams, through the batching engine (no HTTP), side by side in one run.

    python benchmarks/constrained.py --model DIR [--tokenizer DIR] --out docs/benchmarks/constrained.md

``--model`` is any mlx-lm model folder. The grammar needs a real tokenizer: ``--tokenizer`` points at a folder
with one (e.g. the embedded SmolLM2's, converted into ~/.cache/mlxd); the model's logits may be wider than its
vocabulary (the extra ids are always masked). Every row generates exactly ``--tokens`` tokens: the schema is an
array of strings long enough never to close (``minItems``), so constrained rows never stop early.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxd.engine.base import EngineRequest
    from mlxd.engine.engine import BatchedEngine

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 24},
                                                     "minItems": 400}},
          "required": ["notes"]}


async def run_batch(engine: BatchedEngine, requests: list[EngineRequest]) -> tuple[int, float]:
    """All requests at once; returns (tokens generated, seconds from the first token to the last)."""
    from mlxd.engine.base import Failed, Finished, Token

    first: list[float] = []

    async def one(request: EngineRequest) -> int:
        count = 0
        async for event in engine.submit(request).events():
            if isinstance(event, Token):
                count += 1
                if count == 2:  # the clock starts after every prompt is in: decode speed only
                    first.append(time.perf_counter())
            elif isinstance(event, Failed):
                raise RuntimeError(event.message)
            elif isinstance(event, Finished):
                return count - 2
        return count

    counts = await asyncio.gather(*(one(r) for r in requests))
    return sum(counts), time.perf_counter() - max(first)


def requests(tokenizer: Any, num: int, tokens: int, factory: Any, tag: str) -> list[EngineRequest]:
    from mlxd.engine.base import EngineRequest, SamplingParams

    prompt = tokenizer.encode("Write a list of short notes about the weather, as JSON.")
    sampling = SamplingParams(temperature=1.0, logit_bias={i: -100.0 for i in tokenizer.eos_token_ids})
    return [EngineRequest(request_id=f"{tag}-{i}", prompt=prompt, max_tokens=tokens, sampling=sampling,
                          logits_processors=factory) for i in range(num)]


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from mlx_lm import load
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxd.config.schema import EngineConfig
    from mlxd.constraints import GrammarCompiler, make_constraint_factory
    from mlxd.engine.engine import BatchedEngine

    model, model_tokenizer = load(args.model)
    tokenizer = load_tokenizer(Path(args.tokenizer)) if args.tokenizer else model_tokenizer
    engine = BatchedEngine(model, EngineConfig(max_running=max(args.streams), prefix_cache_bytes=0))
    engine.start()
    compiler = GrammarCompiler(tokenizer, n_vocab=engine.vocab_size)
    grammar = compiler.json_schema(SCHEMA)
    factory = make_constraint_factory(grammar, compiler, sorted(tokenizer.eos_token_ids))
    rows = []
    try:
        for streams in args.streams:
            for kind, made in (("plain", None), ("json_schema", factory)):
                rates = []
                for repeat in range(args.repeats):
                    batch = requests(tokenizer, streams, args.tokens, made, f"{kind}-{streams}-{repeat}")
                    count, seconds = asyncio.run(run_batch(engine, batch))
                    rates.append(count / seconds)
                rows.append({"streams": streams, "kind": kind, "tok_s": statistics.median(rates)})
    finally:
        engine.stop()
    return rows


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    import mlx.core as mx

    lines = [f"Command: `python benchmarks/constrained.py {' '.join(args.argv)}`",
             f"Machine: {platform.machine()} {platform.system()}, MLX device {mx.default_device()}; "
             f"{args.tokens} tokens per stream, median of {args.repeats}.", "",
             "| streams | plain tok/s | json_schema tok/s | constrained / plain | extra ms per decode step "
             "| extra ms per constrained token |",
             "|---|---|---|---|---|---|"]
    for streams in args.streams:
        plain = next(r["tok_s"] for r in rows if r["streams"] == streams and r["kind"] == "plain")
        constrained = next(r["tok_s"] for r in rows if r["streams"] == streams and r["kind"] == "json_schema")
        step_ms = (streams / constrained - streams / plain) * 1000  # every row advances one token a step
        lines.append(f"| {streams} | {plain:.1f} | {constrained:.1f} | {constrained / plain:.2f} | {step_ms:.2f} "
                     f"| {step_ms / streams:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", help="a folder with the tokenizer the grammar uses (default: the model's)")
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import sys

    args.argv = sys.argv[1:]
    text = report(args, measure(args))
    print(text)  # noqa: T201 - a benchmark's output
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
