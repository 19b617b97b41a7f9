"""Where a decode step's time goes at 1, 8 and 16 streams: the model's own floor against the engine.

In one process, on one model, for each batch size B:

* **matmul**: one projection of the model's shape (hidden → MLP width, ``x @ W.T``) for B rows alone, timed over a
  queue of independent calls (device time per call, and the weight bytes it reads per second);
* **forward floor**: mlx-lm's model decoding B rows with nothing else: a batched KV cache (mlx-lm's
  ``BatchKVCache``; B = 1 also with the plain ``KVCache`` that ``generate_step`` uses), greedy argmax, pipelined
  like ``generate_step`` (the next step is built while the device runs this one). Per step: the host's time to
  build it (Python building the graph, then MLX dispatching it), the time spent waiting for the device, and the
  total;
* **host**: the stepping thread's CPU time per step (Python, and MLX building and dispatching graphs) of mlx-lm's
  forward alone on mlxd's own batched cache (greedy argmax, pipelined), of mlxd's decode batch with greedy rows, rows
  asking for log-probabilities and rows with penalties (logits processors), and of ``BatchGenerator``: what mlxd's
  step adds to the model's forward on the host, apart from the device's work;
* **BatchGenerator**: mlx-lm's batched generator (its decode rate, all rows in one batch);
* **mlxd engine**: the engine, in process (no HTTP), B concurrent requests; its aggregate decode rate and its own
  per-step breakdown (``/v1/status`` ``step_ms``: schedule, prefill, decode build, decode wait, post-process).

    python benchmarks/step_breakdown.py --tiny qwen3                       # CPU smoke run
    python benchmarks/step_breakdown.py --tiny qwen3 --parts host --streams 1,8,16,32,64 --max-tokens 32 --rounds 3
    python benchmarks/step_breakdown.py --model ../models/qwen3-8b --out docs/benchmarks/x.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import direct_batch_generator, model_folder, pick_prompts, versions  # noqa: E402
from speculative_engine import stream_times  # noqa: E402


def matmul_us(hidden: int, width: int, rows: int, dtype, calls: int = 200) -> float:
    """Device microseconds of one ``(rows, hidden) @ (width, hidden).T`` product, from a queue of ``calls``."""
    import mlx.core as mx

    weight = mx.random.normal((width, hidden)).astype(dtype)
    xs = [mx.random.normal((rows, hidden)).astype(dtype) for _ in range(calls)]
    mx.eval(weight, *xs)
    mx.eval([x @ weight.T for x in xs[:10]])
    start = time.perf_counter()
    mx.eval([x @ weight.T for x in xs])
    return (time.perf_counter() - start) / calls * 1e6


def forward_floor(model, prompts: list[list[int]], steps: int, batched: bool) -> tuple[float, float, float, float]:
    """``(graph ms, dispatch ms, wait ms, total ms)`` per decode step of mlx-lm's model alone, pipelined: Python
    building the step's graph, MLX dispatching it (``async_eval``), waiting for the previous step's tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    rows = len(prompts)
    length = min(len(p) for p in prompts)
    tokens = mx.array([p[:length] for p in prompts])
    cache = ([BatchKVCache(left_padding=[0] * rows) for _ in model.layers] if batched
             else make_prompt_cache(model))
    logits = model(tokens, cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)

    def decode(y):
        return model(y[:, None], cache=cache)[:, -1, :]

    for _ in range(2):  # the first steps of a batch shape build what MLX keeps per shape
        y = mx.argmax(decode(y), axis=-1)
        mx.eval(y)
    graph = dispatch = wait = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = mx.argmax(decode(y), axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.tolist()
        t3 = time.perf_counter()
        graph, dispatch, wait, y = graph + t1 - t0, dispatch + t2 - t1, wait + t3 - t2, nxt
    y.tolist()
    total = time.perf_counter() - start
    return tuple(x / steps * 1000 for x in (graph, dispatch, wait, total))


def batch_alone(model, prompts: list[list[int]], steps: int) -> float:
    """Milliseconds per step of mlxd's decode batch (:class:`~mlxd.engine.step.batch.DecodeBatch`) driven in a loop on
    this thread, greedy rows joined through one prompt pass as the engine joins them: the batch step with no
    engine thread, scheduler, event queue or client around it."""
    batch = joined_batch(model, prompts)
    batch.step()
    start = time.perf_counter()
    for _ in range(steps):
        batch.step()
    return (time.perf_counter() - start) / steps * 1000


def joined_batch(model, prompts: list[list[int]], sampling=None, num_logprobs: int | None = None):
    """mlxd's decode batch with one row per prompt (greedy, unless ``sampling`` says otherwise), joined through one
    prompt pass as the engine joins them."""
    from mlxd.engine.base import SamplingParams
    from mlxd.engine.step.batch import DecodeBatch
    from mlxd.engine.step.prompts import process_prompt, process_prompts
    from mlxd.engine.step.row import Row

    rows = [Row.for_request(f"r{i}", sampling or SamplingParams(), model, 0, num_logprobs=num_logprobs)
            for i in range(len(prompts))]
    batch = DecodeBatch(model)
    if len(rows) == 1:
        batch.add(rows[0], process_prompt(model, rows[0], prompts[0], last=True))
    else:
        batch.add_batch(rows, *process_prompts(model, rows, prompts))
    return batch


# Rows of each kind the host part steps: greedy; greedy with 5 log-probability alternatives; greedy with a logit bias
# and a repetition penalty (mlx-lm's logits processors, one pair per row).
HOST_KINDS = {"greedy": {}, "logprobs": {"num_logprobs": 5},
              "penalties": {"sampling": {"repetition_penalty": 1.1, "logit_bias": {5: -1.0}}}}


HOST_LABELS = {"floor": "mlx-lm forward alone", "generator": "BatchGenerator"}


def host_ms(model, prompts: list[list[int]], steps: int, kind: str) -> tuple[float, float]:
    """``(host ms, wall ms)`` per step of ``kind``: mlxd's decode batch with rows of a :data:`HOST_KINDS` kind, mlx-lm's
    forward alone on such a batch's cache ("floor"), or ``BatchGenerator`` ("generator"). Host: the stepping thread's
    own CPU time (Python, and MLX building and dispatching the graphs; MLX's CPU backend computes on a stream thread
    of its own, so on the CPU this leaves the model's arithmetic out)."""
    import mlx.core as mx

    if kind == "generator":
        return generator_host_ms(model, prompts, steps)
    from mlxd.engine.base import SamplingParams

    options = dict(HOST_KINDS.get(kind, {}))
    if "sampling" in options:
        options["sampling"] = SamplingParams(**options["sampling"])
    batch = joined_batch(model, prompts, **options)
    step = floor_step(batch) if kind == "floor" else batch.step
    step()
    step()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        step()
    host = (time.thread_time() - cpu) / steps * 1000
    mx.eval(batch.inputs)
    return host, (time.perf_counter() - wall) / steps * 1000


def floor_step(batch):
    """A step of mlx-lm's model alone on ``batch``'s cache and inputs, greedy and pipelined as the batch steps."""
    import mlx.core as mx

    def step() -> None:
        fed = batch.inputs
        batch.inputs = mx.argmax(batch.model(fed[:, None], cache=batch.cache)[:, -1, :], axis=-1)
        mx.async_eval(batch.inputs)
        fed.tolist()

    return step


def generator_host_ms(model, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """``(host ms, wall ms)`` per ``BatchGenerator`` step (``next_generated``), all rows decoding."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, max_tokens=steps + 8, completion_batch_size=len(prompts),
                               prefill_batch_size=len(prompts))
    generator.insert(prompts, max_tokens=[steps + 8] * len(prompts))
    for _ in range(3):  # the prompt pass, then two steps
        generator.next_generated()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        generator.next_generated()
    host, wall = (time.thread_time() - cpu) / steps * 1000, (time.perf_counter() - wall) / steps * 1000
    generator.close()
    return host, wall


def engine_run(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[float, dict[str, float]]:
    """Aggregate decode tok/s of ``prompts`` as concurrent requests, and the engine's step breakdown (ms per step)
    over the run."""
    from mlxd.engine.base import EngineRequest

    clock = engine.step_times
    before, steps_before = dict(clock.seconds), clock.num_steps

    async def one(i: int, prompt: list[int]) -> list[float]:
        request = EngineRequest(request_id=f"{tag}-{i}-{time.monotonic_ns()}", prompt=prompt, max_tokens=max_tokens)
        times, _ = await stream_times(engine, request)
        return times

    async def run() -> list[list[float]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(run())
    first, last = min(t[0] for t in results), max(t[-1] for t in results)
    steps = max(clock.num_steps - steps_before, 1)
    phases = {k: (clock.seconds[k] - before[k]) / steps * 1000 for k in clock.seconds}
    phases["steps"] = steps
    return sum(len(t) - 1 for t in results) / (last - first), phases


def kernel_modes(model) -> dict:
    """Label suffix → a switch that sends the model's 2-16-row products to mlxd's kernel, or to MLX's matmul (what
    ``nn.Linear`` itself calls), through the same swapped layers."""
    import mlx.core as mx

    from mlxd.runtime.small_batch import run
    from mlxd.runtime.small_batch_linear import use_small_batch_kernel

    on = [True]

    def matmul(launch, x, weight, bias):
        if on[0]:
            return run(launch, x, weight, bias)
        return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)

    use_small_batch_kernel(model, matmul)
    return {", small-batch kernel": lambda: on.__setitem__(0, True),
            ", MLX matmul": lambda: on.__setitem__(0, False)}


def report(args, path: str, rows: dict[tuple[str, int], str], best: dict[tuple[str, int], float]) -> None:
    """Print the best of each point as a markdown table (and write it to ``--out``; the points to ``--json``)."""
    lines = [f"Model: `{path}`; {args.max_tokens} greedy tokens a stream; best of {args.rounds} rounds.", "",
             "| what | streams | result |", "|---|---|---|"]
    lines += [f"| {label} | {n} | {rows[(label, n)]} |" for label, n in rows]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions(None).items())]
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}
    lines += ["", "MLX settings from the environment: " + (", ".join(f"`{k}={v}`" for k, v in settings.items())
                                                         or "none (MLX's defaults)")]
    if args.json:
        Path(args.json).write_text(json.dumps([{"what": label, "streams": n, "score": best[(label, n)],
                                                "text": rows[(label, n)]} for label, n in rows], indent=1))
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)  # noqa: T201 - the report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder")
    parser.add_argument("--tiny", help="build a tiny random model of this arch instead")
    parser.add_argument("--streams", default="1,8,16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the best of each point is kept")
    parser.add_argument("--switch-interval", type=float, default=0.0,
                        help="also run the engine with this sys.setswitchinterval (seconds)")
    parser.add_argument("--parts", default="matmul,floor,batch,generator,engine",
                        help="comma list of what to measure: matmul, floor, batch, host, generator, engine")
    parser.add_argument("--kernel-ab", action="store_true",
                        help="CUDA: run every part with mlxd's small-batch kernel and with MLX's matmul, in turn")
    parser.add_argument("--prefix-cache-gb", type=float, default=0.0,
                        help="the engine's [engine] prefix_cache_bytes in GiB (the server's default is 2; 0: off)")
    parser.add_argument("--memory-gb", type=float, default=0.0,
                        help="the engine's [engine] memory_limit_bytes in GiB (0: the device's default)")
    parser.add_argument("--prompt-words", type=int, default=8,
                        help="tag words added to each prompt (load.py's --prompt-words: 240 gives ~256 tokens)")
    parser.add_argument("--out", help="write a markdown section here (else print it)")
    parser.add_argument("--json", help="also write every point's best result here (label, streams, score)")
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm import load

    from mlxd.config.schema import EngineConfig
    from mlxd.engine.engine import BatchedEngine

    path = model_folder(args.model, args.tiny)
    model, tokenizer = load(path)
    levels = [int(s) for s in args.streams.split(",")]
    parts = set(args.parts.split(","))
    texts = pick_prompts(model, tokenizer, max(levels), args.max_tokens, args.prompt_words)
    prompts = [tokenizer.encode(t) for t in texts]
    modes = kernel_modes(model) if args.kernel_ab else {"": lambda: None}
    engine = BatchedEngine(model, EngineConfig(max_running=max(levels),
                                               prefix_cache_bytes=int(args.prefix_cache_gb * 1024**3),
                                               memory_limit_bytes=int(args.memory_gb * 1024**3)))
    engine.start()
    embed = model.model.embed_tokens.weight if hasattr(model, "model") else None
    dtype = embed.dtype if embed is not None else mx.bfloat16
    args_ = model.args
    rows: dict[tuple[str, int], str] = {}
    best: dict[tuple[str, int], float] = {}

    def keep(key: tuple[str, int], score: float, text: str, higher: bool = True) -> None:
        if key not in best or (score > best[key]) == higher:
            best[key], rows[key] = score, text
        print(f"{key}: {text}", flush=True)  # noqa: T201 - progress

    try:
        for _ in range(args.rounds):
            for n, (mode, switch) in ((n, m) for n in levels for m in modes.items()):
                switch()
                if "matmul" in parts:
                    us = matmul_us(args_.hidden_size, args_.intermediate_size, n, dtype)
                    gbps = args_.hidden_size * args_.intermediate_size * dtype.size / us / 1e3
                    keep(("matmul" + mode, n), us, f"{us:.1f} µs, {gbps:.0f} GB/s of weights", higher=False)
                floors = [*([False] if n == 1 else []), True] if "floor" in parts else []
                for batched in floors:
                    g, d, w, t = forward_floor(model, prompts[:n], args.max_tokens, batched)
                    label = "forward floor, " + ("BatchKVCache" if batched else "KVCache") + mode
                    keep((label, n), t, f"build {g + d:.2f} ms (graph {g:.2f}, dispatch {d:.2f}), wait {w:.2f} ms, "
                                        f"step {t:.2f} ms, {n * 1000 / t:.0f} tok/s", higher=False)
                if "batch" in parts:
                    ms = batch_alone(model, prompts[:n], args.max_tokens)
                    keep(("mlxd DecodeBatch alone" + mode, n), ms, f"step {ms:.2f} ms, {n * 1000 / ms:.0f} tok/s",
                         higher=False)
                for kind in ("floor", *HOST_KINDS, "generator") if "host" in parts else ():
                    host, wall = host_ms(model, prompts[:n], args.max_tokens, kind)
                    keep((f"host CPU a step, {HOST_LABELS.get(kind, f'DecodeBatch, {kind} rows')}" + mode, n), host,
                         f"host {host:.2f} ms a step, {host * 1000 / n:.0f} µs a row (wall {wall:.2f} ms)", higher=False)
                if "generator" in parts:
                    result = direct_batch_generator(model, tokenizer, texts[:n], args.max_tokens)
                    keep(("BatchGenerator" + mode, n), result.tokens_per_s, f"{result.tokens_per_s:.0f} tok/s")
                if "engine" not in parts:
                    continue
                rate, phases = engine_run(engine, prompts[:n], args.max_tokens, "b")
                detail = ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if k != "steps")
                keep(("mlxd engine" + mode, n), rate, f"{rate:.0f} tok/s; ms per step: {detail} "
                                               f"({phases['steps']} steps)")
                if args.switch_interval:
                    default = sys.getswitchinterval()
                    sys.setswitchinterval(args.switch_interval)
                    rate, phases = engine_run(engine, prompts[:n], args.max_tokens, "s")
                    sys.setswitchinterval(default)
                    detail = ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if k != "steps")
                    keep((f"mlxd engine, switch interval {args.switch_interval * 1000:g} ms", n), rate,
                         f"{rate:.0f} tok/s; ms per step: {detail}")
    finally:
        engine.stop()
    report(args, path, rows, best)


if __name__ == "__main__":
    main()
