"""Embeddings per second of a ``kind = "embedding"`` model: a batch of 64 short texts, in process (no HTTP).

    python benchmarks/embeddings.py --build ../models --out docs/benchmarks/models.md
    python benchmarks/embeddings.py --model ../models/qwen3-tiny --model ../models/qwen3-small --device gpu

For each model, side by side in one run and in interleaved rounds: mlxd's embedding engine given one request of 64
inputs, and 64 requests of one input sent at once (they share passes); the same engine given the 64 one request at a
time (no batching); and the model run directly in one padded pass of 64 (the ceiling: no engine, no
tokenizer). ``--build DIR`` first writes random-weight Qwen3 folders of the ``tiny`` and ``small`` shapes of
``benchmarks/random_model.py`` under DIR (with its word-level tokenizer, so each text is a run of ``tN`` words), and
with mlx-embeddings installed a random BERT of bge-small's shape (served through mlx-embeddings; vllm-mlx's
``--embedding-model`` can serve the same folder). The
model loads as mlxd loads it (``[model] dtype = "auto"``: float32 on the Linux CPU); on Linux, OpenBLAS is preloaded
first, as ``mlxd serve`` does. ``--out`` replaces this script's section of the markdown document.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import with_openblas  # noqa: E402

START, END = "<!-- embeddings.py start -->", "<!-- embeddings.py end -->"
NUM_TEXTS = 64


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, action="append", default=[], help="an mlx-lm model folder (repeat)")
    parser.add_argument("--build", type=Path, help="write random Qwen3 folders (tiny, small) here and measure them")
    parser.add_argument("--device", default="auto", help='"cpu", "gpu" or "auto" (as [model] device)')
    parser.add_argument("--pooling", choices=("auto", "last", "mean", "cls"), default="auto")
    parser.add_argument("--words", default="6,16", help="words per text, the least and the most (default 6,16)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    parser.add_argument("--out", type=Path, help="markdown document whose section this run replaces")
    return parser.parse_args(argv)




# bge-small-en-v1.5's shape (a BERT encoder, served through mlx-embeddings).
BERT_SMALL = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": 4096, "hidden_size": 384,
              "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 1536,
              "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0}


def build_models(folder: Path) -> list[Path]:
    """Random Qwen3 folders (tiny, small) and, with mlx-embeddings installed, a random BERT of bge-small's shape."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from random_model import build

    folders = [build(folder / f"qwen3-{preset}", preset, 4096, "float32") for preset in ("tiny", "small")]
    try:
        folders.append(build_bert(folder / "bert-bge-small"))
    except ImportError:
        print("mlx-embeddings is not installed: no BERT folder")  # noqa: T201 - the benchmark's output
    return folders


def build_bert(out: Path) -> Path:
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert
    from random_model import write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    model = bert.Model(bert.ModelArgs.from_dict(BERT_SMALL))
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(BERT_SMALL, indent=2))
    write_tokenizer(out, BERT_SMALL["vocab_size"])
    return out


def make_texts(words: str, vocab: int) -> list[str]:
    import numpy as np

    least, most = (int(part) for part in words.split(","))
    rng = np.random.default_rng(0)
    return [" ".join(f"t{i}" for i in rng.integers(2, vocab, rng.integers(least, most + 1)))
            for _ in range(NUM_TEXTS)]


def load_engine(folder: Path, device: str, pooling: str) -> Any:
    from mlxd.config.schema import EngineConfig, ModelConfig
    from mlxd.engine.embedding import make_embedding_engine
    from mlxd.models.encoder import encoder_type, load_encoder
    from mlxd.models.load import load

    config = ModelConfig(source=str(folder), kind="embedding", device=device, pooling=pooling)
    loaded = load_encoder(config) if encoder_type(config) else load(config)
    engine = make_embedding_engine(config, EngineConfig(max_waiting=NUM_TEXTS), loaded, folder.name)
    engine.start()
    return engine, loaded


def measure(engine: Any, loaded: Any, texts: list[str], pooling: str) -> dict[str, float]:
    """Seconds for the 64 texts, each way, once."""
    from mlxd.engine.embedding import EmbeddingRequest
    from mlxd.engine.pooling import make_pool

    def request(batch: list[str]) -> EmbeddingRequest:
        return EmbeddingRequest(request_id="bench", texts=batch)

    async def one_request() -> None:
        await engine.embed(request(texts))

    async def concurrent() -> None:
        await asyncio.gather(*(engine.embed(request([text])) for text in texts))

    async def one_at_a_time() -> None:
        for text in texts:
            await engine.embed(request([text]))

    rows = [list(loaded.tokenizer.encode(text)) for text in texts]
    pool = make_pool(loaded)
    seconds = {}
    for name, run in (("one request of 64", one_request), ("64 requests at once", concurrent),
                      ("64 requests one at a time", one_at_a_time)):
        started = time.perf_counter()
        asyncio.run(run())
        seconds[name] = time.perf_counter() - started
    started = time.perf_counter()
    pool(rows, pooling, True)  # on this thread's default stream: the model's device
    seconds["the model alone, one pass (no engine)"] = time.perf_counter() - started
    return seconds


def run_model(folder: Path, args: argparse.Namespace) -> tuple[str, dict[str, float], int]:
    engine, loaded = load_engine(folder, args.device, args.pooling)
    try:
        texts = make_texts(args.words, engine.vocab_size)
        num_tokens = sum(len(loaded.tokenizer.encode(text)) for text in texts)
        measure(engine, loaded, texts, engine.pooling)  # first shapes met: not counted
        samples: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, value in measure(engine, loaded, texts, engine.pooling).items():
                samples.setdefault(name, []).append(value)
        label = f"{folder.name} (hidden {engine.hidden_size}, {loaded.dtype}, pooling {engine.pooling})"
        return label, {name: statistics.median(values) for name, values in samples.items()}, num_tokens
    finally:
        engine.stop()


def table(results: list[tuple[str, dict[str, float], int]], args: argparse.Namespace) -> str:
    import mlx.core as mx

    lines = [START, "## Embeddings per second (`benchmarks/embeddings.py`)", "",
             f"{NUM_TEXTS} short texts ({args.words.replace(',', '-')} words), normalized; "
             f"median of {args.rounds} rounds. Device {mx.default_device()}, {platform.machine()}, "
             f"{os.cpu_count()} CPUs, load average {_load():.1f}, MLX {mx.__version__}. Command: `python benchmarks/embeddings.py "
             f"{' '.join(sys.argv[1:])}`.", "",
             "| model | tokens | way | seconds | embeddings/s |", "|---|---|---|---|---|"]
    for label, seconds, num_tokens in results:
        for name, value in seconds.items():
            lines.append(f"| {label} | {num_tokens} | {name} | {value:.4f} | {NUM_TEXTS / value:,.0f} |")
    lines += ["", "Not measured here: vllm-mlx's `--embedding-model`, which serves mlx-embeddings models (BERT, "
              "XLM-RoBERTa, ModernBERT) only: set it beside the BERT row (its folder is what `--build` writes).",
              END]
    return "\n".join(lines)


def _load() -> float:
    """The 1-minute load average (0 where the system does not report it): on a shared machine it explains spread."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


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
    folders = list(args.model) + (build_models(args.build) if args.build else [])
    if not folders:
        raise SystemExit("give --model DIR (repeatable) or --build DIR")
    results = [run_model(folder, args) for folder in folders]
    section = table(results, args)
    print(section)  # noqa: T201 - the benchmark's output
    if args.out:
        write_section(args.out, section)


if __name__ == "__main__":
    main(sys.argv[1:])
