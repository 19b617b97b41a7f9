"""Prefill and decode speed of the embedded default model through HTTP, with and without OpenBLAS.

Starts `python -m mlxd --config configs/default.toml` once per BLAS setting (side by side in one run: the
cmeel-openblas wheel, the system's OpenBLAS when installed, the mlx-cpu wheel's bundled reference BLAS),
measures prefill tok/s (prompt tokens / time to first token, long prompt) and decode tok/s (streamed tokens
after the first / time between first and last), and writes docs/benchmarks/default-model.md.

    python benchmarks/default_model.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "default-model.md"
PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "knowledge spread across Europe. Workshops appeared in many cities, and books became cheaper. "
)


def start(port: int, env: dict[str, str], dtype: str) -> subprocess.Popen:
    text = (ROOT / "configs" / "default.toml").read_text()
    text = text.replace('name = "smollm2-135m"', f'name = "smollm2-135m"\ndtype = "{dtype}"')
    config = Path(tempfile.mkdtemp()) / "bench.toml"
    config.write_text(text)
    proc = subprocess.Popen([sys.executable, "-m", "mlxd", "--config", str(config),
                             "--port", str(port)], env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy")


def stream(port: int, messages: list[dict], max_tokens: int) -> tuple[float, list[float], int]:
    """(seconds to first token, arrival times of content chunks, prompt tokens)."""
    body = {"model": "smollm2-135m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {"0": -100, "2": -100}}
    started, times, prompt_tokens = time.perf_counter(), [], 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    return times[0] - started, times, prompt_tokens


def measure(port: int, repeats: int) -> dict[str, float]:
    long_prompt = [{"role": "user", "content": PARAGRAPH * 12 + "Summarize."}]
    short_prompt = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    stream(port, short_prompt, 8)  # warm
    prefill, decode = [], []
    for _ in range(repeats):
        httpx.delete(f"http://127.0.0.1:{port}/v1/cache").raise_for_status()  # a cold prompt every time
        ttft, _, num_prompt = stream(port, long_prompt, 1)
        prefill.append(num_prompt / ttft)
        _, times, _ = stream(port, short_prompt, 128)
        decode.append((len(times) - 1) / (times[-1] - times[0]))
    return {"prefill": statistics.median(prefill), "decode": statistics.median(decode), "prompt": num_prompt}


DIRECT = """
import json, statistics, sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.utils import dequantize_model
from mlxd.models.default_model import resolve_embedded
model, tok = load(str(resolve_embedded()))
model = dequantize_model(model)
model.set_dtype(mx.float32)
mx.eval(model.parameters())
messages = [{"role": "user", "content": sys.argv[2]}]
long = mx.array(tok.apply_chat_template(messages, add_generation_prompt=True))
short = mx.array(tok.encode("Tell me a long story about a lighthouse keeper."))
mx.eval(model(long[None]))
prefill, decode = [], []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    mx.eval(model(long[None]))
    prefill.append(long.size / (time.perf_counter() - start))
    times = [time.perf_counter() for _ in generate_step(short, model, max_tokens=128)]
    decode.append((len(times) - 1) / (times[-1] - times[0]))
print(json.dumps({"prefill": statistics.median(prefill), "decode": statistics.median(decode), "prompt": long.size}))
"""


def direct(repeats: int) -> dict[str, float]:
    """mlx-lm's generate_step in a process of its own, OpenBLAS preloaded: the ceiling for the default row."""
    from mlxd.runtime.blas import find_openblas, preload_environment

    lib = find_openblas()
    env = preload_environment(lib, os.environ) if lib else {**os.environ, "LD_PRELOAD": ""}
    out = subprocess.run([sys.executable, "-c", DIRECT, str(repeats), PARAGRAPH * 12 + "Summarize."],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _pip_version() -> str:
    from importlib import metadata

    try:
        return f"cmeel-openblas {metadata.version('cmeel-openblas')}"
    except metadata.PackageNotFoundError:
        return "(cmeel-openblas not installed)"


def _resolved(path: Path | None) -> str:
    return str(path.resolve()) if path else "(none)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--note", default="", help="a sentence for the report (e.g. what else ran on the machine)")
    args = parser.parse_args()
    rows = {}
    from mlxd.runtime.blas import pip_openblas, system_openblas

    no_preload = {"LD_PRELOAD": "", "MLXD_OPENBLAS_REEXECED": ""}
    settings = [("float32 + pip OpenBLAS (default)", {**no_preload, "MLXD_OPENBLAS": "pip"}, "auto"),
                ("float32 + system OpenBLAS", {**no_preload, "MLXD_OPENBLAS": "system"}, "auto"),
                ("float32, bundled BLAS", {**no_preload, "MLXD_OPENBLAS": "0"}, "auto"),
                ("native Q4_1/Q8_0, bundled BLAS", {**no_preload, "MLXD_OPENBLAS": "0"}, "native")]
    if pip_openblas() is None or system_openblas() is None:  # the default row is whichever is installed
        settings = [(label, env, dtype) for label, env, dtype in settings if "OpenBLAS" not in label]
        settings.insert(0, ("float32 + OpenBLAS (default)", no_preload, "auto"))
    for label, env, dtype in settings:
        proc = start(18765, env, dtype)
        try:
            rows[label] = measure(18765, args.repeats)
        finally:
            proc.terminate()
            proc.wait(30)
        print(label, rows[label], flush=True)
    rows["mlx-lm generate_step, float32 + OpenBLAS (no HTTP)"] = direct(args.repeats)
    print("direct", rows["mlx-lm generate_step, float32 + OpenBLAS (no HTTP)"], flush=True)
    base = next(iter(rows.values()))
    lines = [
        "# Default model (SmolLM2-135M-Instruct) through HTTP",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; {time.strftime('%Y-%m-%d')}.",
        f"Command: `python benchmarks/default_model.py --repeats {args.repeats}` (servers run one after another in one",
        "run; medians). Prefill: a long prompt, `max_tokens=1`, prompt tokens / time to first token.",
        "Decode: streamed tokens after the first / time from first to last token, 128 tokens.",
        f"OpenBLAS: pip {_pip_version()} (`MLXD_OPENBLAS=pip`), system `{system_openblas()}` "
        f"(`MLXD_OPENBLAS=system`, resolving to `{_resolved(system_openblas())}`).",
        *([args.note] if args.note else []),
        "",
        "| setting | prompt tokens | prefill tok/s | decode tok/s | prefill vs default | decode vs default |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['prompt']} | {r['prefill']:.1f} | {r['decode']:.1f} | "
                     f"{r['prefill'] / base['prefill']:.2f} | {r['decode'] / base['decode']:.2f} |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print(OUT.read_text())


if __name__ == "__main__":
    main()
