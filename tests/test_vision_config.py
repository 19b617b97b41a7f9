"""The product's own vision config, `configs/qwen3vl.toml`, serves an image request (its source swapped for the tiny
Qwen3-VL fixture; everything else as shipped)."""

from __future__ import annotations

import re
import subprocess
import sys

from mlxd.cli import main
from tests.helpers import ROOT, app_client
from tests.vision_helpers import user_with_images


def shipped_config_with_source(tmp_path, source) -> object:
    text = (ROOT / "configs" / "qwen3vl.toml").read_text()
    text, count = re.subn(r'^source = ".*"$', f'source = "{source}"', text, flags=re.MULTILINE)
    assert count == 1
    path = tmp_path / "qwen3vl.toml"
    path.write_text(text)
    return path


def test_the_shipped_qwen3vl_config_serves_an_image(tiny_vlm, tmp_path, capsys):
    config = shipped_config_with_source(tmp_path, tiny_vlm("qwen3_vl"))
    assert main(["check-config", str(config)]) == 0
    capsys.readouterr()
    with app_client(config) as (client, daemon):
        assert daemon.model_info.kind == "vision"
        body = {"model": "qwen3-vl-4b", "max_tokens": 6,
                "messages": [{"role": "system", "content": "Describe images."}, user_with_images("What is it?", 5)]}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        body["messages"][1] = {"role": "user", "content": "What is it?"}
        without = client.post("/v1/chat/completions", json=body).json()
        # The image's placeholder tokens count as prompt tokens.
        assert answer["usage"]["completion_tokens"] == 6
        assert answer["usage"]["prompt_tokens"] >= without["usage"]["prompt_tokens"] + 8
        assert client.get("/v1/status").json()["vision"]["num_vision_calls"] == 2  # the warm-up's image, then this


def test_the_openai_sdk_sends_images_as_the_readme_shows(tiny_vlm, tmp_path):
    """The README's OpenAI SDK example against a real server process: an image turn, non-streamed and streamed."""
    from openai import OpenAI

    from tests.helpers import free_port, serve_subprocess, write_config
    from tests.vision_helpers import image_part

    port = free_port()
    with serve_subprocess(write_config(tmp_path, tiny_vlm("gemma3"), port=port), port) as (base, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        messages = [{"role": "system", "content": "You read charts."},
                    {"role": "user", "content": [image_part(7), {"type": "text", "text": "What does this show?"}]}]
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        text_only = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0,
                                                   messages=[messages[0], {"role": "user", "content": "Hi"}])
        assert reply.usage.completion_tokens == 6
        assert reply.usage.prompt_tokens >= text_only.usage.prompt_tokens + 16  # the image's placeholder tokens
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert streamed == reply.choices[0].message.content
        # The README's script itself, run where its chart.png is, with this server's address and model name.
        from PIL import Image

        from tests.test_readme_examples import readme_block

        Image.new("RGB", (96, 64), (200, 40, 40)).save(tmp_path / "chart.png")
        script = readme_block("python", 'open("chart.png", "rb")')
        assert script.count("http://127.0.0.1:8080") == 1 and script.count('model="qwen3-vl-4b"') == 1
        script = script.replace("http://127.0.0.1:8080", base).replace('model="qwen3-vl-4b"', 'model="tiny"')
        run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300, check=False)
        assert run.returncode == 0, run.stderr[-2000:]
        assert int(run.stdout.split()[-1]) >= text_only.usage.prompt_tokens + 16  # it printed the image's tokens
