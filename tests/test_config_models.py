"""Several models in one config: ``[models.NAME]`` tables read as one list with ``[model]`` (mlxd.config.models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.assemble import load_everything
from mlxd.config.models import served_models
from mlxd.errors import ConfigError

TWO = """
[engine]
max_running = 4
[models.chat]
source = "a"
aliases = ["gpt-*"]
idle_unload_s = 30
[models.chat.sampling]
temperature = 0.5
[models.small]
source = "b"
name = "fast"
pin = true
pipeline = "chat"
[models.small.engine]
max_running = 2
prefill_chunk = 64
[models.small.sampling]
max_tokens = 7
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mlxd.toml"
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_everything(path)
    return info.value.message


def test_one_model_table_is_a_one_model_list(tmp_path):
    config, _ = load_everything(write(tmp_path, '[model]\nsource = "x"\nname = "one"\n'))
    [served] = served_models(config)
    assert (served.name, served.load, served.pin, served.config.model.source) == ("one", "at_start", True, "x")
    assert served.config.engine == config.engine


def test_models_tables_each_with_their_engine_sampling_and_policy(tmp_path):
    config, _ = load_everything(write(tmp_path, TWO))
    chat, small = served_models(config)
    assert (chat.name, chat.load, chat.idle_unload_s, chat.pin, chat.table) == ("chat", "at_start", 30, False,
                                                                                 "models.chat")
    assert chat.config.model.aliases == ["gpt-*"] and chat.config.model.sampling.temperature == 0.5
    assert chat.config.engine.max_running == 4  # the top-level [engine]
    assert (small.name, small.load, small.pin) == ("fast", "on_request", True)
    assert (small.config.engine.max_running, small.config.engine.prefill_chunk) == (2, 64)
    assert small.config.model.sampling.max_tokens == 7 and small.config.model.sampling.temperature is None
    assert config.model == chat.config.model  # what single-model tools read: the first model
    assert not small.config.models


def test_load_policy_can_be_set(tmp_path):
    text = '[models.a]\nsource = "a"\nload = "on_request"\n[models.b]\nsource = "b"\nload = "at_start"\n'
    config, _ = load_everything(write(tmp_path, text))
    assert [s.load for s in served_models(config)] == ["on_request", "at_start"]


@pytest.mark.parametrize(("text", "expected"), [
    ('[models.a]\nsource = "a"\nlaod = "at_start"\n', "models.a"),
    ('[models.a]\nsource = "a"\nload = "sometimes"\n', "models.a.load"),
    ('[models.a]\nsource = "a"\nidle_unload_s = -1\n', "models.a.idle_unload_s"),
    ('[models.a]\nsource = "a"\n[models.a.engine]\nmax_running = "x"\n', "models.a.engine.max_running"),
    ('[models.a]\nsource = "a"\n[models.a.sampling]\ntop_p = 3\n', "models.a.sampling.top_p"),
    ('[models.a]\nsource = "a"\n[models.a.engine.speculative]\nngram_min = 3\nngram_max = 2\n',
     "models.a.engine.speculative.ngram_min"),
    ('[models.a]\nsource = "a"\n[models.b]\nsource = "b"\nname = "a"\n', "models.b.name"),
    ('[model]\nsource = "a"\n[models.b]\nsource = "b"\n', "not both"),
    ('[models.a]\nsource = "a"\npipeline = "nonesuch"\n', "[models.a] pipeline: "),
    ('[models.a]\nsource = "a"\n[models.b]\nsource = "b"\npipeline = "nonesuch"\n', "[models.b] pipeline: "),
    ('[models.e]\nsource = "e"\nkind = "embedding"\n[distributed]\n', "models.e.kind: an embedding model"),
    ('[model]\nsource = "e"\nkind = "embedding"\n[distributed]\n', "model.kind: an embedding model"),
    ('[models.a]\nsource = "a"\n[models.b]\nsource = "b"\n[distributed]\n', "models: a [distributed] job serves one"),
    ('[models.a]\nsource = "a"\n[models.b]\nsource = "b"\n[models.b.engine]\nvision_encoder_thread = true\n',
     "models.b.engine.vision_encoder_thread: "),
    ('[engine]\nvision_encoder_thread = true\n[models.a]\nsource = "a"\n[models.b]\nsource = "b"\n',
     ": engine.vision_encoder_thread: "),
])
def test_errors_name_the_file_and_the_model_field(tmp_path, text, expected):
    path = write(tmp_path, text)
    message = error_of(path)
    assert str(path) in message and expected in message, message


def test_the_readme_s_several_models_config_is_valid(tmp_path):
    root = Path(__file__).resolve().parent.parent
    text = root.joinpath("README.md").read_text()
    block = text[text.index("# models.toml\n"):]
    block = block[:block.index("```")]
    config, _ = load_everything(write(tmp_path, block))
    chat, vision, embed = served_models(config)
    assert (chat.name, chat.pin, chat.load, chat.config.model.sampling.temperature) == ("chat", True, "at_start", 0.6)
    assert (vision.name, vision.load, vision.idle_unload_s) == ("vision", "on_request", 600)
    assert (embed.config.model.kind, embed.load, embed.config.engine.max_waiting) == ("embedding", "at_start", 256)
    assert config.server.models_memory_bytes == 48_000_000_000


def test_check_config_checks_every_model_s_source_and_names_each_bad_one(tmp_path, tiny_model_dir, capsys):
    from mlxd.cli import main

    text = (f'[models.a]\nsource = "{tiny_model_dir}"\n[models.b]\nsource = "no-such-folder"\n'
            f'[models.c]\nsource = "{tiny_model_dir}"\nname = "cc"\n[models.d]\nsource = "org/some-model"\n')
    path = write(tmp_path, text)
    assert main(["check-config", str(path)]) == 2
    error = capsys.readouterr().err
    assert f"{path}: [models.b] source: " in error and "no-such-folder" in error
    assert f"{path}: [models.d] source: " in error and "hub id" in error  # every bad model, not only the first
    assert "[models.a]" not in error and "[models.c]" not in error
    path.write_text(text.replace("no-such-folder", str(tiny_model_dir)).replace("org/some-model", str(tiny_model_dir)))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    for line in ("[models.a] a: source", "[models.b] b: source", "[models.c] cc: source", "[models.d] d: source"):
        assert f"{line} {tiny_model_dir}" in out, out


def test_check_config_shows_each_model_s_own_settings_and_where_they_came_from(tmp_path, tiny_model_dir, capsys):
    from mlxd.cli import main

    path = write(tmp_path, f'[engine]\nmax_waiting = 9\n[models.a]\nsource = "{tiny_model_dir}"\n'
                           '[models.a.sampling]\ntemperature = 0.2\n'
                           f'[models.b]\nsource = "{tiny_model_dir}"\nname = "fast"\nidle_unload_s = 5\n'
                           '[models.b.engine]\nmax_running = 2\n')
    assert main(["check-config", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for line in ('[models.a.sampling] temperature = 0.2  (file)', '[models.a] load = "at_start"  (default)',
                 '[models.b] name = "fast"  (file)', '[models.b] idle_unload_s = 5.0  (file)',
                 '[models.b] load = "on_request"  (default)', '[models.b.engine] max_running = 2  (file)',
                 '[models.b.engine] max_waiting = 64  (default)',  # its own table replaces [engine] whole
                 '[engine] max_waiting = 9  (file)', f'[models.a] source = "{tiny_model_dir}"  (file)'):
        assert line in lines, line
    assert [line.split(" pipeline from ")[0] for line in lines if " pipeline from " in line] == ["[models.a]",
                                                                                                  "[models.b]"]
    # Not the first model dressed as [model] (with wrong origins), nor the raw tables in one clipped line; a's
    # engine is the shared [engine], shown once.
    assert not [line for line in lines if line.startswith(("[model] ", "[model.", "models = ", "[models.a.engine]"))]
