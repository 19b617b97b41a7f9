"""Prompt lookup on the real embedded model (SmolLM2-135M-Instruct): asked to return a code snippet with one
change, it copies most of it, and the copied spans come back as accepted drafts (more than 1.5 tokens a step); its
greedy output is the one plain decoding gives.

The drafts are judged with ``adaptive = false``: every step drafts ``k`` tokens when the prompt holds a match, so
the counts depend on the greedy output alone (here 52 tokens in 19 steps, 35 of 72 drafts kept, run after run).
With the default ``adaptive = true`` a row backs off when a verify step is measured to cost more plain steps than its
drafts are expected to gain: wall-clock periods, so on a loaded machine the same output came in 1.53 to 2.17 tokens
a step across three requests of one server (and 1.41 once in CI). That policy is tested on its own
(tests/test_speculation_policy.py); this test asks what the drafter and the verification give."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import httpx

from mlxd.models.default_model import locate_default_gguf
from tests.helpers import free_port, serve_subprocess

ROOT = Path(__file__).resolve().parent.parent
CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
ASK = f"Rename the function `area` to `rectangle_area` and return the whole code, nothing else.\n\n```python\n{CODE}```"


def test_prompt_lookup_on_the_default_model_accepts_copied_spans(tmp_path):
    locate_default_gguf(download=False)  # fails, never skips, without the wheel's GGUF
    default = (ROOT / "configs" / "default.toml").read_text()
    assert default.count('type = "batched"\n') == 1
    config = tmp_path / "default.toml"
    # One row at a time is all this test sends; max_running = 1 keeps the start-up warm-up to that batch size.
    config.write_text(default.replace('type = "batched"\n', 'type = "batched"\nmax_running = 1\n')
                      + '\n[engine.speculative]\ndrafter = "prompt_lookup"\nadaptive = false\n')
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": ASK}], "temperature": 0,
            "max_tokens": 96}
    port = free_port()
    with serve_subprocess(config, port, timeout=300) as (base, _):  # as users run it: OpenBLAS preloaded
        speculative = httpx.post(base + "/v1/chat/completions", json=body, timeout=300).json()
        plain = httpx.post(base + "/v1/chat/completions", json={**body, "speculative": False}, timeout=300).json()
        totals = httpx.get(base + "/v1/status", timeout=30).json()["speculative"]  # speculative requests only
    text = speculative["choices"][0]["message"]["content"]
    assert text == plain["choices"][0]["message"]["content"]
    assert "def perimeter(width, height):" in text  # it did copy the code (this small model keeps `area`)
    summaries = _decode_summaries(tmp_path / f"server-{port}.log")
    assert totals["acceptance"] > 0.3 and totals["tokens_per_step"] > 1.5, (totals, summaries)


def _decode_summaries(log: Path) -> list[object]:
    """How each request decoded, from its log line (for a failure's message)."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            if isinstance(event := json.loads(line), dict) and "decode" in event:
                found.append(event["decode"])
    return found
