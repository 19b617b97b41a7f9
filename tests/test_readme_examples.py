"""The README's plugin example, run as written: its stage module and its `[[pipeline.stages]]` table, in a served
pipeline, redact what the model says."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.helpers import app_client

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CHAT_PIPELINE = ROOT / "mlxd" / "pipelines" / "chat.toml"


def readme_block(language: str, containing: str) -> str:
    """The one fenced ``language`` block of README.md that contains ``containing``."""
    blocks = [b for b in re.findall(rf"^```{language}\n(.*?)^```$", README, re.S | re.M) if containing in b]
    assert len(blocks) == 1, f"README.md has {len(blocks)} {language} blocks containing {containing!r}"
    return blocks[0]


def write_plugin(tmp_path: Path) -> None:
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "stages.py").write_text(readme_block("python", "class Redact(Stage)"))


def write_config(tmp_path: Path, model_dir: Path, words: list[str] | None) -> Path:
    """The built-in chat pipeline inline, plus (``words`` given) the README's stage table with those words."""
    stages = CHAT_PIPELINE.read_text().replace("[[stages]]", "[[pipeline.stages]]")
    if words is not None:
        table = readme_block("toml", 'type = "my_package.stages:Redact"')
        stages += "\n" + table.replace('words = ["secret"]', f"words = {json.dumps(words)}")
    path = tmp_path / f"mlxd-{words is not None}.toml"
    path.write_text(f'[model]\nsource = "{model_dir}"\nname = "tiny"\n[model.sampling]\ntemperature = 0.0\n'
                    f'max_tokens = 16\n[logging]\nformat = "json"\n{stages}')
    return path


def answer(config: Path, stream: bool) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a secret"}], "stream": stream}
    with app_client(config) as (client, _):
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]["message"]["content"]
    frames = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    return "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f["choices"])


def test_the_readme_plugin_stage_redacts_served_text(tmp_path, tiny_model_dir, monkeypatch):
    write_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    plain = answer(write_config(tmp_path, tiny_model_dir, None), stream=False)
    # Greedy output of a random model: redact two characters it is sure to contain, as the README's words.
    words = sorted(c for c in set(plain) if c.isalnum())[:2]
    assert words, plain
    expected = plain
    for word in words:
        expected = expected.replace(word, "█" * len(word))
    config = write_config(tmp_path, tiny_model_dir, words)
    assert answer(config, stream=False) == expected != plain
    assert answer(config, stream=True) == expected


def test_ci_prepares_its_machine_with_the_readme_s_block_only():
    """`.ci/run` installs nothing of its own: what a user following the README lacks, CI lacks too."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "apt-get" not in ci and "pip install" not in ci
    assert "readme_block prepare-command" in ci and "readme_block test-command" in ci
    block = readme_block("sh", "apt-get install")
    assert f"<!-- prepare-command -->\n```sh\n{block}```" in README
