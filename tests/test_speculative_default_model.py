"""Prompt lookup on the real embedded model (SmolLM2-135M-Instruct): asked to return a code snippet with one
change, it copies most of it, and the copied spans come back as accepted drafts (more than 1.5 tokens a step); its
greedy output is the one plain decoding gives."""

from __future__ import annotations

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
    config = tmp_path / "default.toml"
    config.write_text((ROOT / "configs" / "default.toml").read_text()
                      + '\n[engine.speculative]\ndrafter = "prompt_lookup"\n')
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": ASK}], "temperature": 0,
            "max_tokens": 96}
    port = free_port()
    with serve_subprocess(config, port, timeout=300) as (base, _):  # as users run it: OpenBLAS preloaded
        speculative = httpx.post(base + "/v1/chat/completions", json=body, timeout=300).json()
        plain = httpx.post(base + "/v1/chat/completions", json={**body, "speculative": False}, timeout=300).json()
        totals = httpx.get(base + "/v1/status", timeout=30).json()["speculative"]  # speculative requests only
    text = speculative["choices"][0]["message"]["content"]
    assert text == plain["choices"][0]["message"]["content"]
    assert "perimeter" in text  # it did copy the code
    assert totals["acceptance"] > 0.3 and totals["tokens_per_step"] > 1.5, totals
