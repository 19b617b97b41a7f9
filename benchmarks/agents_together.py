"""Several agents at once, each continuing its own conversation after a shared system prompt: time to first token.

``--agents`` conversations share a system prompt of ``--system-words`` words and open with messages of their own.
Each round, every agent sends its next turn at the same moment: its whole conversation so far (its previous prompt,
the reply it got, and a new message of 10-60 words). From round 2 on, each request finds its own earlier turn in
the prefix cache (a different cached length per agent) and has only the rest of its prompt to process: what a
server does with several such rests arriving together is what this measures. Greedy, streaming
``/v1/completions``; the model's word-level tokenizer (``benchmarks/random_model.py``) re-tokenizes the reply text
exactly, so a turn's prompt extends the tokens of the one before.

Servers run one at a time, each from a fresh start: this tree's mlxd and, with ``--baseline-mlxd``, another
mlxd source tree, in alternating order over ``--repeats``.

    python benchmarks/agents_together.py --baseline-mlxd ../base --agents 8 --out docs/benchmarks/x.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load as loadgen  # noqa: E402
from dispatch_costs import emit  # noqa: E402
from random_model import build  # noqa: E402


def words(seed: int, n: int, vocab: int) -> str:
    return " ".join(f"t{(seed * 7919 + k * 104729) % (vocab - 2) + 2}" for k in range(n))


async def one_turn(port: int, prompt: str, max_tokens: int) -> tuple[float, str]:
    """(time to first token, the reply's text) of one streaming completion."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True}).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    first, parts = None, []
    while line := await reader.readline():
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("text"):
                first = first or time.perf_counter()
                parts.append(choices[0]["text"])
    writer.close()
    return (first or time.perf_counter()) - start, "".join(parts)


async def everyone(port: int, prompts: list[str], max_tokens: int) -> list[tuple[float, str]]:
    return await asyncio.gather(*[one_turn(port, p, max_tokens) for p in prompts])


def conversation_rounds(port: int, args) -> list[list[float]]:
    """Each round's times to first token, one per agent."""
    prompts = [f"{words(0, args.system_words, args.vocab)} {words(100 + i, 20 + 5 * i, args.vocab)}"
               for i in range(args.agents)]
    rounds = []
    for round_ in range(args.rounds):
        results = asyncio.run(everyone(port, prompts, args.max_tokens))
        rounds.append([ttft for ttft, _ in results])
        prompts = [f"{p}{text} {words(1000 * round_ + i, 10 + (17 * i + 11 * round_) % 51, args.vocab)}"
                   for i, (p, (_, text)) in enumerate(zip(prompts, results, strict=True))]
    return rounds


def serve_and_run(label: str, env: dict | None, model: str, args, tmp: Path) -> list[list[float]]:
    port = loadgen.free_port()
    command = loadgen.mlxd_command(model, port, tmp / label.replace(" ", "-"), args.agents)
    with loadgen.serve(command, port, tmp / f"{label.replace(' ', '-')}.log", "/health", env):
        return conversation_rounds(port, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder with a word-level tokenizer (else one is built)")
    parser.add_argument("--preset", default="small", help="random_model.py preset of the model built")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--baseline-mlxd", help="another mlxd source tree, served the same way")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp())
    model = args.model or str(build(tmp / "model", args.preset, args.vocab, "float32"))
    servers = [("mlxd", None)]
    if args.baseline_mlxd:
        base = str(Path(args.baseline_mlxd).resolve())
        servers.append(("mlxd baseline", {"PYTHONPATH": os.pathsep.join([base, os.environ.get("PYTHONPATH", "")]),
                                          "PYTHONSAFEPATH": "1"}))
    rows = []
    for repeat in range(args.repeats):
        for label, env in servers if repeat % 2 == 0 else servers[::-1]:
            rounds = serve_and_run(f"{label}-{repeat}", env, model, args, tmp)
            later = [t for r in rounds[1:] for t in r]
            rows.append(f"| {label} | {repeat + 1} | {statistics.mean(rounds[0]):.3f} | {statistics.mean(later):.3f} | "
                        f"{statistics.median(later):.3f} | {max(later):.3f} | "
                        f"{', '.join(f'{statistics.mean(r):.3f}' for r in rounds[1:])} |")
            print(rows[-1], flush=True)  # noqa: T201 - progress
    import mlx.core as mx

    command = " ".join(["python", "benchmarks/agents_together.py", *sys.argv[1:]])
    text = "\n".join([
        f"### Agents continuing together ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
        f"`{command}`", "",
        f"{mx.default_device()}, mlx {mx.__version__}, {platform.platform()}; model `{args.model or args.preset}`; "
        f"{args.agents} agents, a {args.system_words}-word system prompt, {args.max_tokens} tokens a reply, "
        f"{args.rounds} rounds.", "",
        "| server | repeat | round 1 mean TTFT (s) | later rounds: mean (s) | median (s) | max (s) | each later round's mean (s) |",
        "|---|---|---|---|---|---|---|", *rows, "", ""])
    emit(text, args.out)


if __name__ == "__main__":
    main()
