"""A multi-turn coding-agent conversation against mlxd, mlx_lm.server and vllm-mlx: TTFT and cached tokens per turn.

The conversation opens with a ~1,500-token system prompt plus tool definitions and grows every turn with the
model's own reply (re-rendered by the chat template, as agents resend it) and a tool result. Every server is
driven with the same requests (greedy, streaming, usage included), one server at a time, in one run.

    python benchmarks/agent.py --out docs/benchmarks/agent.md [--vllm-python /path/to/venv/bin/python]

The model is a random-weight Qwen3-0.6B-shaped float32 model (hidden 1024, 28 layers) with the test tokenizer,
built once into --model-dir.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.support
import load as loadgen  # noqa: E402  (the load generator's server helpers)

RULES = [
    "Read the relevant files before editing them, and keep every change minimal and focused on the task.",
    "Run the test suite after each change and report failures verbatim, with the command that produced them.",
    "Never invent file contents; when unsure, list the directory or search the code base first.",
    "Prefer small, reviewable commits with messages that explain why the change was made.",
    "When a tool call fails, read the error, adjust the arguments, and try again at most twice.",
]
TOOLS = [
    {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {arg: {"type": "string", "description": f"The {arg} to use."}
                                         for arg in args}, "required": list(args)}}}
    for name, desc, args in [
        ("read_file", "Read a file from the repository and return its contents.", ["path"]),
        ("write_file", "Replace a file's contents.", ["path", "content"]),
        ("run", "Run a shell command in the repository and return its output.", ["command"]),
        ("search", "Search the code base for a regular expression.", ["pattern", "path"]),
    ]
]
TURNS = [
    "The test tests/test_parser.py::test_nested_lists fails. Find out why and fix it.",
    "Here is the output of `pytest -x`: AssertionError: expected [[1, 2], [3]] but got [[1, 2, 3]]. Continue.",
    "The file src/parser.py contains `def parse(tokens):` with a loop over tokens that appends to `current`. Go on.",
    "After your edit, `pytest` reports 41 passed, 1 failed: test_empty_input. Please look at it.",
    "All tests pass now. Write a short commit message for the change.",
    "Thanks. Now also add a test for deeply nested lists, five levels deep.",
]


def system_prompt(num_rules: int = 18) -> str:
    lines = ["You are a careful coding agent working in a Python repository. Follow these rules:"]
    lines += [f"{i + 1}. {RULES[i % len(RULES)]} (rule {i + 1})" for i in range(num_rules)]
    return "\n".join(lines)


def build_model(model_dir: Path) -> Path:
    from tests.support.tiny import tiny_model_cached

    return tiny_model_cached(model_dir, "qwen3", hidden_size=1024, num_layers=28, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, intermediate_size=3072)


def turn(port: int, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started, first, text, usage = time.perf_counter(), None, [], {}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=1200) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft": (first or time.perf_counter()) - started, "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens"), "cached": details.get("cached_tokens")}


def conversation(port: int, model: str, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": system_prompt()}]
    rows = []
    for i, user in enumerate(TURNS):
        messages.append({"role": "user", "content": user})
        row = turn(port, model, messages, max_tokens)
        rows.append(row)
        print(f"  turn {i + 1}: ttft {row['ttft']:.2f}s prompt {row['prompt_tokens']} cached {row['cached']}",
              flush=True)
        messages.append({"role": "assistant", "content": row["text"]})
    return rows


def server_commands(args, model_path: Path, tmp: Path) -> list[tuple[str, list[str], str]]:
    """(label, command, the model name its requests use) per server."""
    specs = []
    for name in args.servers.split(","):
        port = loadgen.free_port()
        if name == "mlxd":
            config = tmp / "agent.toml"
            config.write_text(f'[model]\nsource = "{model_path}"\n'
                              f'name = "agent"\n[logging]\nformat = "json"\n')
            specs.append(("mlxd", [sys.executable, "-m", "mlxd", "--config", str(config), "--port", str(port)],
                          "agent"))
        elif name == "mlx_lm":
            specs.append(("mlx_lm.server", [sys.executable, "-m", "mlx_lm.server", "--model", str(model_path),
                                             "--port", str(port)], str(model_path)))
        elif name == "vllm_mlx" and args.vllm_python:
            specs.append(("vllm-mlx", [args.vllm_python, "-m", "vllm_mlx.cli", "serve", str(model_path), "--port",
                                       str(port), "--continuous-batching"], str(model_path)))
    return specs


def report(results: dict[str, list[dict]], args) -> str:
    lines = ["# Agent loop: time to first token and prefix-cache reuse per turn", "",
             f"Machine: {platform.machine()}, {platform.platform()}; {time.strftime('%Y-%m-%d')}.",
             f"Command: `{' '.join(sys.argv)}`. Model: random-weight Qwen3-0.6B shape (hidden 1024, 28 layers,"
             " 16/8 heads, head_dim 128), float32, test tokenizer. Greedy, streaming, "
             f"{args.max_tokens} completion tokens per turn; ~1,500-token system prompt plus four tools.", ""]
    header = "| turn | " + " | ".join(f"{n} TTFT (s) | {n} cached / prompt" for n in results) + " |"
    lines += [header, "|---|" + "---|---|" * len(results)]
    for i in range(len(TURNS)):
        cells = []
        for rows in results.values():
            row = rows[i] if i < len(rows) else None
            cells += [f"{row['ttft']:.2f}", f"{row['cached']} / {row['prompt_tokens']}"] if row else ["-", "-"]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, rows in results.items():
        later = rows[1:]
        if not later:
            continue
        worst_ttft = max(r["ttft"] for r in later) / rows[0]["ttft"]
        fractions = [r["cached"] / r["prompt_tokens"] for r in later if r["cached"] is not None and r["prompt_tokens"]]
        reuse = f"lowest cached share on turns 2+: {min(fractions):.0%}" if fractions else "cached tokens not reported"
        lines.append(f"- {name}: worst TTFT on turns 2+ = {worst_ttft:.0%} of the cold turn; {reuse}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="mlxd,mlx_lm,vllm_mlx")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-mlx installed")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "mlxd-bench-models"))
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out")
    args = parser.parse_args()
    loadgen.with_openblas()  # every server here computes with the same BLAS
    model_path = build_model(Path(args.model_dir))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, command, model_name in server_commands(args, model_path, Path(tmp)):
            port = loadgen.port_of(command)
            print(label, flush=True)
            with loadgen.serve(command, port, Path(tmp) / f"{port}.log", "/health" if label == "mlxd" else "/v1/models"):
                results[label] = conversation(port, model_name, args.max_tokens)
    text = report(results, args)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
