"""What tensor parallelism can give on this backend, without a server: mlx-lm's own sharded model driven directly.

One process on one device, then ``--ranks`` processes under ``mlx.launch`` with mlx-lm's ``Model.shard(group)``,
each running mlx-lm's ``BatchGenerator`` on the same greedy prompts at every width of ``--concurrency``. No HTTP, no
scheduler, no mlxd: the ceiling any tensor-parallel server built on MLX and mlx-lm can reach on these devices, to
read mlxd's own group (``distributed.py``) against. Per width:

* decode-only tok/s: tokens / (last token − first token), and with the prompt pass: tokens / (last token − insert);
* the first round at each width is a warm-up (kernels compiled, graphs cached) and is not kept; the best of the
  other rounds is;
* greedy agreement: every stream's tokens of the group against the one device's, and where they part, the one
  device's margin between its top two log-probabilities at that token (a near-tie that the ranks' other order of
  additions can flip in bf16).

    python benchmarks/tp_floor.py --tiny qwen3 --backend ring --concurrency 1,16
    python benchmarks/tp_floor.py --model ../models/qwen3-8b --backend nccl --concurrency 1,16,64 \\
        --out docs/benchmarks/distributed.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import emit, free_port, model_folder, pick_prompts, versions, with_openblas  # noqa: E402

from mlxd.launch import local_threads, mlx_launch  # noqa: E402

# ---- one process's runs (a rank of the group, or the one device) ----

def generate(model, tokenizer, prompts: list[str], max_tokens: int, margins: bool = False) -> dict:
    """mlx-lm's BatchGenerator on all ``prompts`` at once: rates, each stream's tokens, and (``margins``) the
    margin between the top two log-probabilities at each token (slower: one read a token; never timed)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    generator = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=n, prefill_batch_size=n)
    start = time.perf_counter()
    uids = generator.insert([tokenizer.encode(p) for p in prompts], max_tokens=[max_tokens] * n)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    gaps: dict[int, list[float]] = {uid: [] for uid in uids}
    first = last = None
    while responses := generator.next_generated():
        last = time.perf_counter()
        first = first or last
        for response in responses:
            tokens[response.uid].append(response.token)
            if margins:
                top = mx.topk(response.logprobs.astype(mx.float32), 2).tolist()
                gaps[response.uid].append(abs(top[0] - top[1]))
    generator.close()
    count = sum(map(len, tokens.values()))
    return {"decode_tps": count / (last - first) if last > first else 0.0, "wall_tps": count / (last - start),
            "tokens": [tokens[uid] for uid in uids], "margins": [gaps[uid] for uid in uids] if margins else None}


def run_process(spec: dict) -> None:
    """What one process does: load (sharded over the group when there is one), pick the prompts if none were
    given, run every width ``rounds`` times (the first a warm-up), and (rank 0) write the results."""
    import mlx.core as mx
    from mlx_lm import load

    group = mx.distributed.init(strict=True, backend=spec["backend"]) if spec["ranks"] > 1 else None
    model, tokenizer = load(spec["model"], lazy=group is not None)
    if group is not None:
        model.shard(group)
        mx.eval(model.parameters())
    levels, rounds = spec["levels"], spec["rounds"]
    prompts = spec["prompts"] or pick_prompts(model, tokenizer, max(levels), spec["max_tokens"])
    results: dict[int, list[dict]] = {level: [] for level in levels}
    for _ in range(rounds):
        for level in levels:
            results[level].append(generate(model, tokenizer, prompts[:level], spec["max_tokens"]))
    best: dict[str, dict] = {}
    for level, runs in results.items():  # the best run after the first (a warm-up), with every run's rates
        best[str(level)] = {**max(runs[1:], key=lambda r: r["decode_tps"]),
                            "runs": [[round(r["decode_tps"], 1), round(r["wall_tps"], 1)] for r in runs]}
    top = str(max(levels))
    if spec["ranks"] == 1:  # the margins of the one device's streams, where the group's tokens may part from them
        best[top]["margins"] = generate(model, tokenizer, prompts[:max(levels)], spec["max_tokens"],
                                        margins=True)["margins"]
    if group is None or group.rank() == 0:
        Path(spec["out"]).write_text(json.dumps({"prompts": prompts, "best": best,
                                                 "device": str(mx.default_device())}))


# ---- the comparison ----

def agreement(one: list[list[int]], group: list[list[int]], margins: list[list[float]] | None) -> dict:
    """How many streams of the group equal the one device's token for token; for each that parts, where, and the
    one device's top-2 margin there."""
    parted = []
    for i, (a, b) in enumerate(zip(one, group, strict=True)):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            margin = margins[i][at] if margins and at < len(margins[i]) else None
            parted.append({"stream": i, "at": at, "margin": margin})
    return {"streams": len(one), "equal": len(one) - len(parted), "parted": parted}


def report(one: dict, group: dict, ranks: int, levels: list[int]) -> str:
    lines = ["| streams | one device: decode-only / with the prompt pass (tok/s) | "
             f"{ranks} ranks: decode-only / with the prompt pass | {ranks} ranks / one device (decode-only; with "
             "the prompt pass) |", "|---|---|---|---|"]
    for level in levels:
        a, b = one["best"][str(level)], group["best"][str(level)]
        lines.append(f"| {level} | {a['decode_tps']:,.0f} / {a['wall_tps']:,.0f} | {b['decode_tps']:,.0f} / "
                     f"{b['wall_tps']:,.0f} | {b['decode_tps'] / a['decode_tps']:.2f}x; "
                     f"{b['wall_tps'] / a['wall_tps']:.2f}x |")
    top = str(max(levels))
    same = agreement(one["best"][top]["tokens"], group["best"][top]["tokens"], one["best"][top]["margins"])
    parted = ", ".join(f"stream {p['stream']} at token {p['at']} (margin {p['margin']:.4f})"
                       if p["margin"] is not None else f"stream {p['stream']} at token {p['at']}"
                       for p in same["parted"][:12])
    known = [p["margin"] for p in same["parted"] if p["margin"] is not None]
    ties = (f" The one device's top-2 margin where they part: {sum(m == 0 for m in known)} of {len(known)} exact "
            f"ties, the largest {max(known):.4f}." if known else "")
    lines += ["", f"Greedy agreement at {top} streams: {same['equal']} of {same['streams']} streams equal the one "
                  "device's token for token" + (f"; parted: {parted}" if parted else "") + "." + ties,
              "Runs a width (tok/s decode-only, with the prompt pass; the first a warm-up): one device "
              + "; ".join(f"{lv}: {one['best'][str(lv)]['runs']}" for lv in levels)
              + f"; {ranks} ranks " + "; ".join(f"{lv}: {group['best'][str(lv)]['runs']}" for lv in levels)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder")
    parser.add_argument("--tiny", help="build a tiny random model of this arch instead")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="ring", help="the group's backend: nccl on GPUs, ring on a CPU")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="runs a width in each process; the first is a warm-up")
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    parser.add_argument("--process", help=argparse.SUPPRESS)  # one process's spec (JSON), run by this script
    args = parser.parse_args()
    with_openblas()
    if args.process:
        run_process(json.loads(Path(args.process).read_text()))
        return
    tmp = Path(tempfile.mkdtemp())
    levels = [int(c) for c in args.concurrency.split(",")]
    spec = {"model": model_folder(args.model, args.tiny or "qwen3", tmp), "levels": levels, "rounds": max(args.rounds, 2),
            "max_tokens": args.max_tokens, "backend": args.backend, "prompts": None}
    one = _run({**spec, "ranks": 1, "out": str(tmp / "one.json")}, tmp, [sys.executable, __file__],
               {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]})
    launch = [*mlx_launch(), "-n", str(args.ranks), "--backend", args.backend,
              "--starting-port", str(free_port()), *local_threads(args.ranks), "--", sys.executable, __file__]
    group = _run({**spec, "ranks": args.ranks, "prompts": one["prompts"], "out": str(tmp / "group.json")}, tmp,
                 launch, dict(os.environ))
    emit("\n".join([f"Command: `python {' '.join(sys.argv)}`", "",
                    f"Machine: {platform.platform()}; one device: {one['device']}; "
                    + ", ".join(f"{k} {v}" for k, v in versions(None).items()), "",
                    report(one, group, args.ranks, levels)]), args.out)


def _run(spec: dict, tmp: Path, command: list[str], env: dict[str, str]) -> dict:
    path = tmp / f"spec-{spec['ranks']}.json"
    path.write_text(json.dumps(spec))
    subprocess.run([*command, "--process", str(path)], check=True, env=env)
    return json.loads(Path(spec["out"]).read_text())


if __name__ == "__main__":
    main()
