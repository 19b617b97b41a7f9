"""Tensor parallelism against one process, side by side in one run: mlxd and mlx-lm's server.

Servers, each started, measured at every concurrency, and stopped in turn (interleaved over ``--rounds``; the best
of each point is kept):

* mlxd, one process; mlxd over ``--ranks`` processes (``mlxd launch`` with a ``[distributed]`` table);
* ``mlx_lm.server``, one process; ``mlx_lm.server`` under ``mlx.launch`` with as many ranks (its own sharded
  serving: rank 0 answers HTTP).

Streaming clients through HTTP; aggregate tokens/s over all streams and mean time to first token (the same
measure as ``load.py``). On one machine with several GPUs use ``--backend nccl``; on a CPU, ``ring`` over loopback
(every rank then shares the same cores: a test of the mechanism's overhead, not of a speed-up).

    python benchmarks/distributed.py --tiny qwen3 --out docs/benchmarks/distributed.md
    python benchmarks/distributed.py --model ../models/qwen3-8b --backend nccl --concurrency 1,16
    git archive OLD | tar -x -C /tmp/old && python benchmarks/distributed.py --tiny qwen3 --mlxd-only --baseline /tmp/old
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import (  # noqa: E402
    Result,
    free_port,
    http_load,
    mlxd_command,
    pick_prompts,
    table,
    versions,
    wait_ready,
    with_openblas,
)

from mlxd.launch import local_threads  # noqa: E402


@contextlib.contextmanager
def serve(command: list[str], port: int, log: Path, health: str, tree: str | None = None) -> Iterator[None]:
    """A server in a process group of its own (mlx.launch and its ranks), all of it stopped afterwards; ``tree``:
    the mlxd source tree it runs (its folder first on the import path; None: this one)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))} if tree else None
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=tree,
                                env=env)
    try:
        wait_ready(port, health, proc, log)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def group_mlxd(model: str, port: int, tmp: Path, max_running: int, ranks: int, backend: str) -> list[str]:
    command = mlxd_command(model, port, tmp, max_running)
    config = Path(command[command.index("--config") + 1])
    config.write_text(config.read_text() + f"""
[distributed]
backend = "{backend}"
tensor_parallel = {ranks}
starting_port = {free_port()}
""")
    return [sys.executable, "-m", "mlxd", "launch", "--config", str(config), "--port", str(port)]


def mlx_lm_server(model: str, port: int, max_running: int) -> list[str]:
    return [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port), "--decode-concurrency",
            str(max_running), "--prompt-concurrency", str(max_running)]


def specs(args, tmp: Path, top: int) -> list[tuple[str, list[str], str, str | None]]:
    # The same share of this machine's cores per rank as `mlxd launch` gives its ranks (mlxd/launch.py).
    launch = [str(Path(sys.executable).parent / "mlx.launch"), "-n", str(args.ranks), "--backend",
              args.backend, "--starting-port", str(free_port()), *local_threads(args.ranks), "--"]
    ports = [free_port() for _ in range(5)]
    group = f"mlxd, tensor-parallel {args.ranks}"
    return [
        ("mlxd, 1 process", mlxd_command(args.model, ports[0], tmp / "one", top), "/health", None),
        (group, group_mlxd(args.model, ports[1], tmp / "group", top, args.ranks, args.backend), "/health", None),
        *([(f"{group}, baseline tree", group_mlxd(args.model, ports[4], tmp / "baseline", top, args.ranks,
                                                  args.backend), "/health", args.baseline)] if args.baseline else []),
        *([] if args.mlxd_only else [
            ("mlx_lm.server, 1 process", mlx_lm_server(args.model, ports[2], top), "/v1/models", None),
            (f"mlx_lm.server, mlx.launch -n {args.ranks}", [*launch, *mlx_lm_server(args.model, ports[3], top)],
             "/v1/models", None)]),
    ]


def port_of(command: list[str]) -> int:
    return int(command[command.index("--port") + 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model folder")
    parser.add_argument("--tiny", help="build a tiny random model of this arch instead")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="ring")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="append a markdown section here (else print it)")
    parser.add_argument("--mlxd-only", action="store_true", help="leave mlx_lm.server out (mlxd's servers only)")
    parser.add_argument("--baseline", help="another mlxd source tree (an earlier commit, unpacked) whose group is "
                                           "measured too, in the same rounds")
    args = parser.parse_args()
    with_openblas()

    from mlx_lm import load

    tmp = Path(tempfile.mkdtemp())
    if not args.model:
        from tests.support.tiny import tiny_model_cached

        args.model = str(tiny_model_cached(tmp, args.tiny or "qwen3", hidden_size=256, num_layers=4))
    model, tokenizer = load(args.model)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = pick_prompts(model, tokenizer, max(levels) * args.rounds * len(levels), args.max_tokens)
    del model
    best: dict[tuple[str, int], Result] = {}
    used = 0
    for _ in range(args.rounds):
        for label, command, health, tree in specs(args, tmp, max(levels)):
            with serve(command, port_of(command), tmp / f"{label.replace(' ', '_').replace(',', '')}.log", health,
                       tree):
                for level in levels:
                    batch = prompts[used % len(prompts):][:level]
                    used += level
                    name = "bench" if label.startswith("mlxd") else args.model
                    result = asyncio.run(http_load(label, port_of(command), name, batch, args.max_tokens))
                    print(f"{label}, {level} stream(s): {result.tokens_per_s:.1f} tok/s", flush=True)  # noqa: T201
                    key = (label, level)
                    if key not in best or result.tokens_per_s > best[key].tokens_per_s:
                        best[key] = result
    report = "\n".join([
        f"Command: `python {' '.join(sys.argv)}`", "",
        f"Machine: {platform.platform()}; " + ", ".join(f"{k} {v}" for k, v in versions(None).items()), "",
        table(sorted(best.values(), key=lambda r: (r.concurrency, r.label))), "", ratios(best, args.ranks, levels),
    ])
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(report + "\n")
    print(report)  # noqa: T201


def ratios(best: dict[tuple[str, int], Result], ranks: int, levels: list[int]) -> str:
    lines = []
    for level in levels:
        one, group = best[("mlxd, 1 process", level)], best[(f"mlxd, tensor-parallel {ranks}", level)]
        theirs = best.get((f"mlx_lm.server, mlx.launch -n {ranks}", level))
        baseline = best.get((f"mlxd, tensor-parallel {ranks}, baseline tree", level))
        lines.append(f"- {level} stream(s): mlxd tensor-parallel {ranks} / mlxd one process: "
                     f"{group.tokens_per_s / one.tokens_per_s:.2f}x"
                     + (f"; / mlx_lm.server under mlx.launch: {group.tokens_per_s / theirs.tokens_per_s:.2f}x"
                        if theirs is not None else "")
                     + (f"; / the baseline tree's group: {group.tokens_per_s / baseline.tokens_per_s:.2f}x"
                        if baseline is not None else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
