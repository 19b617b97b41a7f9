"""Config and pipeline validation: every error names the file, the table or stage index, and the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.cli import load_everything, main
from mlxd.errors import ConfigError
from mlxd.pipeline.registry import BUILTIN_STAGES

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str, name: str = "mlxd.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_everything(path)
    return info.value.message


@pytest.mark.parametrize("name", ["default.toml", "qwen3vl.toml"])
def test_shipped_configs_validate(name):
    config, pipeline = load_everything(ROOT / "configs" / name)
    assert [t for t, _ in pipeline.stages] == list(BUILTIN_STAGES)
    assert config.model.source


def test_unknown_field_names_file_table_and_field(tmp_path):
    path = write(tmp_path, '[model]\nsource = "x"\n[server]\nprot = 1\n')
    message = error_of(path)
    assert str(path) in message and "server" in message and "`prot`" in message


def test_wrong_type_names_field(tmp_path):
    message = error_of(write(tmp_path, '[model]\nsource = "x"\n[server]\nport = "eighty"\n'))
    assert "server.port" in message and "Expected `int`" in message


@pytest.mark.parametrize("sizes", ["[8]", "[5000]", "[224, 224, 224, 224, 224, 224, 224, 224, 224]", '"224"'])
def test_warm_up_image_sizes_out_of_range_name_the_field(tmp_path, sizes):
    message = error_of(write(tmp_path, f'[model]\nsource = "x"\n[vision]\nwarm_up_image_sizes = {sizes}\n'))
    assert "vision.warm_up_image_sizes" in message


def test_missing_model_table(tmp_path):
    assert "`model`" in error_of(write(tmp_path, "[server]\nport = 1\n"))


def test_invalid_toml(tmp_path):
    assert "invalid TOML" in error_of(write(tmp_path, "[model\n"))


def test_unknown_stage_lists_known_names(tmp_path):
    path = write(tmp_path, '[model]\nsource = "x"\n[[pipeline.stages]]\ntype = "normalize"\n'
                           '[[pipeline.stages]]\ntype = "teleport"\n')
    message = error_of(path)
    assert "stage 1" in message and "'teleport'" in message
    assert all(name in message for name in BUILTIN_STAGES)


def test_bad_stage_option_names_stage_and_field(tmp_path):
    path = write(tmp_path, '[model]\nsource = "x"\n[[pipeline.stages]]\ntype = "normalize"\nmerge_consecutive = "no"\n')
    message = error_of(path)
    assert "stage 0 (normalize)" in message and "merge_consecutive" in message
    path = write(tmp_path, '[model]\nsource = "x"\n[[pipeline.stages]]\ntype = "prefill"\nchunk = 8\n')
    assert "unknown field `chunk`" in error_of(path)


def test_pipeline_file_errors_name_that_file(tmp_path):
    (tmp_path / "pipelines").mkdir()
    bad = write(tmp_path / "pipelines", '[[stages]]\ntype = "decode"\nfast = true\n', "mine.toml")
    message = error_of(write(tmp_path, 'pipeline = "mine"\n[model]\nsource = "x"\n'))
    assert str(bad) in message and "stage 0 (decode)" in message and "`fast`" in message


def test_missing_pipeline_says_where_it_looked(tmp_path):
    message = error_of(write(tmp_path, 'pipeline = "nowhere"\n[model]\nsource = "x"\n'))
    assert "'nowhere' not found" in message and "nowhere.toml" in message


def test_import_path_that_is_not_a_stage(tmp_path):
    path = write(tmp_path, '[model]\nsource = "x"\n[[pipeline.stages]]\ntype = "json:dumps"\n')
    assert "not a class" in error_of(path)


def test_check_config_cli_prints_pipeline(capsys):
    assert main(["check-config", str(ROOT / "configs" / "default.toml")]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "prefill" in out and "[engine] prefill_chunk = 512  (default)" in out


def test_check_config_cli_fails_with_message(tmp_path):
    # The prefill stage's chunk_size moved to [engine] prefill_chunk: a config that still sets it is told where.
    path = write(tmp_path, '[model]\nsource = "x"\n[[pipeline.stages]]\ntype = "prefill"\nchunk_size = 256\n')
    result = subprocess.run([sys.executable, "-m", "mlxd", "check-config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert str(path) in result.stderr and "stage 0 (prefill)" in result.stderr and "chunk_size" in result.stderr
    assert "[engine] prefill_chunk" in result.stderr


def test_help_explains_commands():
    result = subprocess.run([sys.executable, "-m", "mlxd", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "check-config" in result.stdout and "--port" in result.stdout and "--config" in result.stdout


def test_http_layer_does_not_import_mlx():
    code = "import sys, mlxd.api.app; print(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


# Where pipelines are found: a path, then pipelines/ beside the config, then the built-ins inside the package.

BUILTIN_CHAT = ROOT / "mlxd" / "pipelines" / "chat.toml"


def test_pipeline_name_falls_back_to_the_builtin(tmp_path):
    _, pipeline = load_everything(write(tmp_path, '[model]\nsource = "x"\n'))
    assert Path(pipeline.source) == BUILTIN_CHAT
    assert [t for t, _ in pipeline.stages] == list(BUILTIN_STAGES)


def test_pipeline_beside_the_config_takes_the_builtins_place(tmp_path):
    (tmp_path / "pipelines").mkdir()
    mine = write(tmp_path / "pipelines", '[[stages]]\ntype = "normalize"\n', "chat.toml")
    _, pipeline = load_everything(write(tmp_path, '[model]\nsource = "x"\n'))
    assert Path(pipeline.source) == mine and [t for t, _ in pipeline.stages] == ["normalize"]


def test_pipeline_path_is_relative_to_the_config(tmp_path):
    (tmp_path / "sub").mkdir()
    mine = write(tmp_path / "sub", '[[stages]]\ntype = "normalize"\n', "p.toml")
    _, pipeline = load_everything(write(tmp_path, 'pipeline = "sub/p.toml"\n[model]\nsource = "x"\n'))
    assert Path(pipeline.source) == mine


def test_missing_pipeline_lists_the_builtins(tmp_path):
    message = error_of(write(tmp_path, 'pipeline = "nowhere"\n[model]\nsource = "x"\n'))
    assert str(tmp_path / "pipelines" / "nowhere.toml") in message and "built-in pipelines: chat" in message


@pytest.mark.parametrize("example", sorted((ROOT / "pipelines").glob("*.toml")), ids=lambda p: p.name)
def test_example_pipelines_keep_the_builtin_stages(example, tmp_path):
    _, pipeline = load_everything(write(tmp_path, f'pipeline = "{example}"\n[model]\nsource = "x"\n'))
    _, builtin = load_everything(write(tmp_path, '[model]\nsource = "x"\n', "builtin.toml"))
    assert [t for t, _ in pipeline.stages] == [t for t, _ in builtin.stages]


# One source of truth: the prefill chunk is [engine] prefill_chunk.

def test_prefill_stage_chunk_size_names_its_new_place(tmp_path):
    path = write(tmp_path, '[model]\nsource = "x"\n[[pipeline.stages]]\ntype = "prefill"\nchunk_size = 512\n')
    message = error_of(path)
    assert "stage 0 (prefill)" in message and "chunk_size" in message and "[engine] prefill_chunk" in message


def test_prefill_stage_uses_the_engine_chunk(tmp_path):
    from mlxd.pipeline.job import Job
    from mlxd.pipeline.stage import ModelInfo, PipelineContext

    config, pipeline = load_everything(write(tmp_path, '[model]\nsource = "x"\n[engine]\nprefill_chunk = 48\n'))
    prefill = dict(pipeline.stages)["prefill"]
    model = ModelInfo(name="m", context_length=128, eos_token_ids=frozenset({0}), special_token_ids=frozenset())
    prefill.warm_up(PipelineContext(config, model, tokenizer=None, engine=None))
    job = Job(request_id="r", model="m", prompt_ids=[1, 2, 3])
    prefill.prepare(job)
    assert job.chunk_plan.chunk_tokens == 48


# check-config: every setting's effective value and where it came from.

def test_check_config_prints_each_setting_with_its_origin(tmp_path, capsys):
    path = write(tmp_path, '[model]\nsource = "embedded:smollm2-135m"\n[model.sampling]\ntemperature = 0.2\n'
                           '[server]\nhost = "0.0.0.0"\nport = 8000\n')
    assert main(["check-config", str(path), "--port", "9000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for expected in ('[model] source = "embedded:smollm2-135m"  (file)', '[model] kind = "auto"  (default)',
                     "[model.sampling] temperature = 0.2  (file)", "[model.sampling] top_p = 1.0  (default)",
                     '[server] host = "0.0.0.0"  (file)', "[server] port = 9000  (flag)",
                     "[engine] prefill_chunk = 512  (default)", 'pipeline = "chat"  (default)'):
        assert expected in lines
    assert any(line.startswith("  0. normalize") and 'merge_consecutive = "auto" (file)' in line for line in lines)


def test_effective_settings_cover_every_field():
    import msgspec

    from mlxd.config.effective import effective_settings
    from mlxd.config.schema import DaemonConfig, EngineConfig, SamplingDefaults, SpeculativeConfig

    config = msgspec.convert({"model": {"source": "x"}, "engine": {"max_running": 2}}, DaemonConfig)
    settings = {(s.table, s.name): s for s in effective_settings(config, {"model": {"source": "x"},
                                                                          "engine": {"max_running": 2}})}
    tables = ((EngineConfig, "engine"), (SamplingDefaults, "model.sampling"), (SpeculativeConfig, "engine.speculative"))
    for struct, table in tables:
        fields = [f for f in msgspec.structs.fields(struct) if f.name != "speculative"]  # a table of its own
        assert all((table, f.name) in settings for f in fields)
    assert settings[("engine", "max_running")].origin == "file"
    assert settings[("engine", "max_waiting")].origin == "default"
    assert {s.origin for s in settings.values()} == {"file", "default"}


def test_serve_flags_override_the_file():
    import msgspec

    from mlxd.config.effective import apply_flags
    from mlxd.config.schema import DaemonConfig

    config = msgspec.convert({"model": {"source": "x"}, "server": {"port": 1, "host": "h"}}, DaemonConfig)
    changed = apply_flags(config, {"server.port": 2})
    assert (changed.server.port, changed.server.host, changed.model) == (2, "h", config.model)
