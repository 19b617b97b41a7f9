"""Prompt lookup on the real embedded model (SmolLM2-135M-Instruct): asked to return a code snippet with one
change, it copies most of it, and the copied spans come back as accepted drafts; its greedy output is the one
plain decoding gives."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from mlxd.models.default_model import locate_default_gguf
from tests.helpers import app_client

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
    with app_client(config) as (client, _), capture_logs() as logs:
        speculative = client.post("/v1/chat/completions", json=body).json()
        plain = client.post("/v1/chat/completions", json={**body, "speculative": False}).json()
    text = speculative["choices"][0]["message"]["content"]
    assert text == plain["choices"][0]["message"]["content"]
    assert "perimeter" in text  # it did copy the code
    decode = next(e for e in logs if e["event"] == "request")["decode"]
    assert decode["acceptance"] > 0.5 and decode["tokens_per_step"] > 1.5, decode
