"""Embeddings per second through HTTP: mlxd's ``POST /v1/embeddings`` against vllm-mlx's, side by side.

    python benchmarks/embeddings_http.py --build ../models --vllm-python ../vllm-py --out docs/benchmarks/models.md
    python benchmarks/embeddings_http.py --model ../models/bert-bge-small --servers mlxd

Both servers run at once, each as its own process on 127.0.0.1, serving the same embedding folder (a BERT-family
folder: vllm-mlx's ``--embedding-model`` serves mlx-embeddings models only; vllm-mlx also needs a chat model to
start, ``--chat-model``, which it keeps loaded and this script never calls). In interleaved rounds, for each server:
one request of 64 short texts, and 64 requests of one text sent at once. Reported: the median seconds of each way
and embeddings per second, with the servers' start-up time. ``--build DIR`` first writes the random BERT of
bge-small's shape and the tiny Qwen3 chat folder of ``benchmarks/embeddings.py`` under DIR. ``--out`` replaces this
script's section of the markdown document.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from embeddings import NUM_TEXTS, build_bert, make_texts  # noqa: E402
from load import free_port, serve, with_openblas  # noqa: E402

START, END = "<!-- embeddings_http.py start -->", "<!-- embeddings_http.py end -->"
WAYS = ("one request of 64", "64 requests at once")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="an embedding folder both servers serve (BERT family)")
    parser.add_argument("--chat-model", type=Path, help="the chat folder vllm-mlx needs to start")
    parser.add_argument("--build", type=Path, help="write a random BERT (bge-small shape) and a tiny Qwen3 here")
    parser.add_argument("--servers", default="mlxd,vllm_mlx", help="comma list: mlxd, vllm_mlx")
    parser.add_argument("--vllm-python", default=sys.executable, help="the python that imports vllm_mlx")
    parser.add_argument("--words", default="6,16", help="words per text, the least and the most (default 6,16)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    parser.add_argument("--out", type=Path, help="markdown document whose section this run replaces")
    return parser.parse_args(argv)


def mlxd_command(folder: Path, port: int, tmp: Path) -> list[str]:
    config = tmp / "mlxd-embeddings.toml"
    config.write_text(f'[server]\nport = {port}\n[model]\nsource = "{folder}"\nname = "{folder.name}"\n'
                      f'kind = "embedding"\n[engine]\nmax_waiting = {4 * NUM_TEXTS}\n'
                      '[logging]\nlevel = "warning"\nformat = "json"\n')
    return [sys.executable, "-m", "mlxd", "--config", str(config), "--port", str(port)]


def vllm_command(args: argparse.Namespace, folder: Path, port: int) -> list[str]:
    if args.chat_model is None:
        raise SystemExit("vllm_mlx needs --chat-model DIR (or --build DIR)")
    return [args.vllm_python, "-c", "import sys; from vllm_mlx.cli import main; sys.exit(main())", "serve",
            str(args.chat_model), "--port", str(port), "--embedding-model", str(folder)]


async def post(client, port: int, model: str, inputs: list[str]) -> None:
    response = await client.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"model": model, "input": inputs})
    if response.status_code != 200:
        raise RuntimeError(f"port {port}: {response.status_code} {response.text[:400]}")
    data = response.json()["data"]
    if len(data) != len(inputs) or not data[0]["embedding"]:
        raise RuntimeError(f"port {port}: {len(data)} vectors for {len(inputs)} inputs")


async def measure(port: int, model: str, texts: list[str]) -> dict[str, float]:
    """Seconds for the 64 texts, each way, once."""
    import httpx

    seconds = {}
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=NUM_TEXTS)) as client:
        for way in WAYS:
            started = time.perf_counter()
            if way == WAYS[0]:
                await post(client, port, model, texts)
            else:
                await asyncio.gather(*(post(client, port, model, [text]) for text in texts))
            seconds[way] = time.perf_counter() - started
    return seconds


def run(args: argparse.Namespace, folder: Path, texts: list[str]) -> tuple[dict, dict]:
    """Start every server, then interleaved rounds: {(server, way): median seconds}, {server: start-up seconds}."""
    samples: dict[tuple[str, str], list[float]] = {}
    startup: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        ports, names = {}, {"mlxd": folder.name, "vllm_mlx": str(folder)}  # vllm-mlx knows it by its path
        for name in args.servers.split(","):
            port = free_port()
            if name == "mlxd":
                command, health = mlxd_command(folder, port, Path(tmp)), "/health"
            elif name == "vllm_mlx":
                command, health = vllm_command(args, folder, port), "/v1/models"
            else:
                raise SystemExit(f"unknown server {name!r}; known: mlxd, vllm_mlx")
            started = time.perf_counter()
            stack.enter_context(serve(command, port, Path(tmp) / f"{name}.log", health))
            startup[name], ports[name] = time.perf_counter() - started, port
        for name, port in ports.items():  # first shapes met: not counted
            asyncio.run(measure(port, names[name], texts))
        for _ in range(args.rounds):
            for name, port in ports.items():
                for way, value in asyncio.run(measure(port, names[name], texts)).items():
                    samples.setdefault((name, way), []).append(value)
    return {key: statistics.median(values) for key, values in samples.items()}, startup


def table(args: argparse.Namespace, folder: Path, medians: dict, startup: dict, command: str) -> str:
    import mlx.core as mx

    lines = [START, "## Embeddings through HTTP against vllm-mlx (`benchmarks/embeddings_http.py`)", "",
             f"{NUM_TEXTS} short texts ({args.words.replace(',', '-')} words) on `{folder.name}`, median of "
             f"{args.rounds} interleaved rounds, both servers alive side by side. Device {mx.default_device()}, "
             f"{platform.machine()}. Start-up to ready: "
             + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in startup.items())
             + f". Command: `{command}`.", "",
             "| server | way | seconds | embeddings/s |", "|---|---|---|---|"]
    for (name, way), seconds in medians.items():
        lines.append(f"| {name} | {way} | {seconds:.4f} | {NUM_TEXTS / seconds:,.0f} |")
    if "mlxd" in startup and "vllm_mlx" in startup:
        ratios = [f"{way}: {medians[('vllm_mlx', way)] / medians[('mlxd', way)]:.2f}x" for way in WAYS]
        lines += ["", "mlxd / vllm-mlx (embeddings per second): " + ", ".join(ratios) + "."]
    return "\n".join(lines + [END])


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    with_openblas()  # benchmarks/load.py: re-run with OpenBLAS preloaded, as mlxd runs itself
    if args.build:
        from random_model import build

        args.model = build_bert(args.build / "bert-bge-small")
        args.chat_model = args.chat_model or build(args.build / "qwen3-tiny", "tiny", 4096, "float32")
    if args.model is None:
        raise SystemExit("give --model DIR or --build DIR")
    texts = make_texts(args.words, 4096)
    medians, startup = run(args, args.model, texts)
    section = table(args, args.model, medians, startup, "python benchmarks/embeddings_http.py " + " ".join(argv))
    print(section)  # noqa: T201 - the benchmark's output
    if args.out:
        write_section_between(args.out, section)


def write_section_between(out: Path, section: str) -> None:
    """Replace this script's section of ``out`` (or append it)."""
    text = out.read_text()
    if START in text and END in text:
        head, rest = text.split(START, 1)
        out.write_text(head + section + rest.split(END, 1)[1])
    else:
        out.write_text(text.rstrip("\n") + "\n\n" + section + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
