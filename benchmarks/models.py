"""Two models in one daemon (``[models.NAME]``): load and unload times, and streams on both at once against each alone.

    python benchmarks/models.py --build ../models --out docs/benchmarks/models.md
    python benchmarks/models.py --model ../models/a --model ../models/b --streams 8 --max-tokens 128

In process (the app through Litestar's test client, no sockets): model ``a`` loads at start, ``b`` on its first
request (timed: the request's wall time and the load itself). Then, in interleaved rounds, ``--streams`` streaming
completions on ``a`` alone, on ``b`` alone, and on both at once (``--streams`` each); the aggregate tokens per second
of each, the median over rounds. Last, ``b`` is unloaded (timed) and the MLX active memory it gave back is read.
``--build DIR`` first writes two random-weight Qwen3 folders (``benchmarks/random_model.py``, preset ``--preset``).
``--out`` replaces this script's section of the markdown document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import with_openblas  # noqa: E402

START, END = "<!-- models.py start -->", "<!-- models.py end -->"
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, action="append", default=[], help="an mlx-lm model folder (twice)")
    parser.add_argument("--build", type=Path, help="write two random Qwen3 folders here and measure them")
    parser.add_argument("--preset", default="small", help="random_model.py preset for --build (default small)")
    parser.add_argument("--streams", type=int, default=8, help="streams per model (default 8)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    parser.add_argument("--out", type=Path, help="markdown document whose section this run replaces")
    return parser.parse_args(argv)




def build_models(folder: Path, preset: str) -> list[Path]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from random_model import build

    return [build(folder / f"qwen3-{preset}-{name}", preset, 4096, "float32") for name in ("a", "b")]


def write_config(folder: Path, a: Path, b: Path, args: argparse.Namespace) -> Path:
    sampling = f"temperature = 0.0\nmax_tokens = {args.max_tokens}\n"
    text = (f'[engine]\nmax_running = {2 * args.streams}\n'
            f'[models.a]\nsource = "{a}"\n[models.a.sampling]\n{sampling}'
            f'[models.b]\nsource = "{b}"\n[models.b.sampling]\n{sampling}'
            '[logging]\nlevel = "warning"\nformat = "json"\n')
    path = folder / "models.toml"
    path.write_text(text)
    return path


def stream(client: Any, model: str, tokens: list[int]) -> None:
    body = {"model": model, "prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[len("data: "):]).get("usage")
                if usage:
                    tokens.append(usage["completion_tokens"])


def burst(client: Any, models: list[str], streams: int) -> dict[str, float]:
    """``streams`` streams on each of ``models`` at once: each model's aggregate tokens per second."""
    tokens: dict[str, list[int]] = {model: [] for model in models}
    threads = [threading.Thread(target=stream, args=(client, model, tokens[model]))
               for model in models for _ in range(streams)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {model: sum(tokens[model]) / wall for model in models}


def measure(config_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx
    from litestar.testing import TestClient

    from mlxd.api.app import create_app
    from mlxd.assemble import load_everything
    from mlxd.daemon import Daemon
    from mlxd.log import configure_logging

    configure_logging("warning", "json")
    config, pipeline = load_everything(config_path)
    daemon = Daemon(config, pipeline, base_dir=config_path.parent)
    with TestClient(create_app(daemon), timeout=600) as client:
        daemon.wait_loaded(600)
        started = time.perf_counter()
        client.post("/v1/completions", json={"model": "b", "prompt": PROMPT, "max_tokens": 1})
        first_request_s = time.perf_counter() - started
        slot = daemon.models.resolve("b")
        rounds: dict[str, list[float]] = {"a alone": [], "b alone": [], "a beside b": [], "b beside a": []}
        for _ in range(args.rounds):
            rounds["a alone"].append(burst(client, ["a"], args.streams)["a"])
            rounds["b alone"].append(burst(client, ["b"], args.streams)["b"])
            both = burst(client, ["a", "b"], args.streams)
            rounds["a beside b"].append(both["a"])
            rounds["b beside a"].append(both["b"])
        before = mx.get_active_memory()
        started = time.perf_counter()
        asyncio.run(daemon.models.unload(slot, "benchmark"))  # what idle_unload_s and the budget do
        unload_s = time.perf_counter() - started
        freed = before - mx.get_active_memory()
    return {"load_s": slot.load_s, "first_request_s": first_request_s, "unload_s": unload_s, "freed": freed,
            "weight_bytes": slot.weight_bytes, "rates": {k: statistics.median(v) for k, v in rounds.items()}}


def table(result: dict[str, Any], args: argparse.Namespace, names: list[str]) -> str:
    rates = result["rates"]
    both = rates["a beside b"] + rates["b beside a"]
    lines = [START, "## Two models in one daemon (`benchmarks/models.py`)", "",
             f"{platform.platform()}, models {', '.join(names)}, {args.streams} streams a model, "
             f"{args.max_tokens} tokens each, median of {args.rounds} rounds.", "",
             "| | value |", "|---|---|",
             f"| load of b on its first request (the load / the request) | {result['load_s']:.2f} s / "
             f"{result['first_request_s']:.2f} s |",
             f"| unload of b (engine stopped, memory given back) | {result['unload_s']:.3f} s, "
             f"{result['freed'] / 1e6:.1f} MB freed of {result['weight_bytes'] / 1e6:.1f} MB weights |",
             f"| a alone: tokens/s | {rates['a alone']:.0f} |",
             f"| b alone: tokens/s | {rates['b alone']:.0f} |",
             f"| a and b at once: tokens/s (a + b) | {both:.0f} ({rates['a beside b']:.0f} + "
             f"{rates['b beside a']:.0f}) |",
             "", END]
    return "\n".join(lines)


def write_section(out: Path, section: str) -> None:
    text = out.read_text() if out.exists() else "# Models: several in one daemon, and embeddings\n\n"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    out.write_text(text)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    with_openblas()  # benchmarks/load.py: re-run with OpenBLAS preloaded, as mlxd runs itself
    with tempfile.TemporaryDirectory() as tmp:
        folders = list(args.model) or (build_models(args.build or Path(tmp), args.preset))
        if len(folders) != 2:
            raise SystemExit("give --model DIR twice, or --build DIR")
        result = measure(write_config(Path(tmp), *folders, args), args)
    section = table(result, args, [folder.name for folder in folders])
    print(section)  # noqa: T201 - the benchmark's output
    if args.out:
        write_section(args.out, section)


if __name__ == "__main__":
    main(sys.argv[1:])
