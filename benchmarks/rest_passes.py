"""The prompt passes of a burst in which some prompts start from a cached state, in process: each pass timed.

A burst of ``--whole`` fresh prompts and ``--hits`` prompts that begin with the ``--shared`` tokens of a prompt the
engine served just before (a prefix-cache hit: the rest of each runs in a pass of rests), submitted at once to
mlxd's engine, ``--bursts`` times with new prompts. Every forward pass of more than one position is timed to its
last logits (the model is wrapped; decode steps are not timed): rows x positions and milliseconds, pass by pass,
so that a first shape's cost shows against the same shapes met again.

    python benchmarks/rest_passes.py --tiny qwen3 --whole 29 --hits 3 --max-pass-tokens 32768   # CPU
    python benchmarks/rest_passes.py --model ../models/qwen3-8b --whole 61 --hits 3 --bursts 4
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import model_folder, with_openblas  # noqa: E402


class TimedPasses:
    """The model with its real interface; records ``(rows, positions, ms)`` of each pass of more than one position
    (evaluated here, on the engine's thread)."""

    def __init__(self, model: Any) -> None:
        self.model, self.passes = model, []

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        import mlx.core as mx

        started = time.perf_counter()
        out = self.model(inputs, cache=cache, **kwargs)
        if inputs.shape[1] > 1:
            mx.eval(out[:, -1, :])
            self.passes.append((inputs.shape[0], inputs.shape[1], (time.perf_counter() - started) * 1000))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


async def finish(engine: Any, request: Any) -> None:
    from mlxd.engine.base import Failed, Finished

    async for event in engine.submit(request).events():
        if isinstance(event, Failed):
            raise RuntimeError(event.message)
        if isinstance(event, Finished):
            return


def burst_prompts(args, vocab: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """The shared start and the burst's prompts, the hits spread among them: token ids over the vocabulary."""
    def ids(start: int, n: int, stride: int) -> list[int]:
        return [1 + (start + j * stride) % (vocab - 1) for j in range(n)]

    rows = args.whole + args.hits
    hits = {(2 * j + 1) * rows // (2 * args.hits) for j in range(args.hits)}  # spread over the burst
    shared = ids(1000, args.shared, 1)
    return shared, [[*shared, *ids(20000 + i * 7919 + seed * 31, args.rest, 104729)] if i in hits
                    else ids(20000 + i * 7919 + seed * 31, args.shared + args.rest, 104729) for i in range(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder")
    parser.add_argument("--tiny", help="build a tiny random model of this arch instead")
    parser.add_argument("--whole", type=int, default=61, help="fresh prompts in a burst")
    parser.add_argument("--hits", type=int, default=3, help="prompts of a burst that start from a cached state")
    parser.add_argument("--shared", type=int, default=35, help="tokens they share with the prompt served before")
    parser.add_argument("--rest", type=int, default=250, help="tokens of each prompt after the shared ones")
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--memory-gb", type=float, default=48.0, help="[engine] memory_limit_bytes in GiB")
    parser.add_argument("--max-pass-tokens", type=int, default=0,
                        help="tokens a burst's pass may hold (0: what the engine measured; the CPU's is small)")
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    with_openblas()

    from mlx_lm import load

    from mlxd.config.schema import EngineConfig
    from mlxd.engine.base import EngineRequest
    from mlxd.engine.engine import BatchedEngine

    path = model_folder(args.model, args.tiny)
    model, _ = load(path)
    timed = TimedPasses(model)
    rows = args.whole + args.hits
    engine = BatchedEngine(timed, EngineConfig(max_running=rows, max_waiting=rows, prefix_cache_bytes=2 * 1024**3,
                                               memory_limit_bytes=int(args.memory_gb * 1024**3)))
    engine.start()
    if args.max_pass_tokens:
        engine.scheduler.max_pass_tokens = args.max_pass_tokens
    lines = [f"Model: `{path}`; bursts of {args.whole} whole prompts of {args.shared + args.rest} tokens and "
             f"{args.hits} of {args.shared} cached + {args.rest}.", "",
             "| burst | wall s | passes (rows x positions: ms) |", "|---|---|---|"]

    async def burst(k: int) -> None:
        shared, prompts = burst_prompts(args, model.args.vocab_size, k * 1000)
        await finish(engine, EngineRequest(request_id=f"seed{k}", prompt=[*shared, *range(5, 15)], max_tokens=2))
        timed.passes.clear()
        started = time.perf_counter()
        await asyncio.gather(*(finish(engine, EngineRequest(request_id=f"b{k}-{i}", prompt=p, max_tokens=4))
                               for i, p in enumerate(prompts)))
        passes = ", ".join(f"{b} x {n}: {ms:.1f}" for b, n, ms in timed.passes)
        lines.append(f"| {k + 1} | {time.perf_counter() - started:.3f} | {passes} |")
        print(lines[-1], flush=True)  # noqa: T201 - progress

    try:
        for k in range(args.bursts):
            asyncio.run(burst(k))
    finally:
        engine.stop()
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)  # noqa: T201 - the report


if __name__ == "__main__":
    main()
