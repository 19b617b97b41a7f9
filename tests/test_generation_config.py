"""Sampling defaults: the config's [model.sampling], else the model's generation_config.json, else mlxd's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog

from mlxd.cli import main
from mlxd.config.sampling import MLXD_SAMPLING, resolve_sampling
from mlxd.config.schema import SamplingDefaults
from mlxd.models.generation_config import model_sampling, read_generation_config
from tests.helpers import app_client


def write_generation(folder: Path, values: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def test_the_model_file_gives_the_sampling_fields_it_sets(tmp_path):
    folder = write_generation(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                         "repetition_penalty": 1.0, "max_new_tokens": 32, "eos_token_id": 2})
    # max_new_tokens is a cap, not an answer length; repetition_penalty 1 is no penalty.
    assert read_generation_config(folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_bad_values_in_the_model_file_are_left_out_and_named(tmp_path):
    folder = write_generation(tmp_path, {"temperature": -1, "top_p": "high", "top_k": 2.5, "min_p": 0.05,
                                         "repetition_penalty": 1.1})
    with structlog.testing.capture_logs() as logs:
        assert read_generation_config(folder) == {"min_p": 0.05, "repetition_penalty": 1.1}
    assert sorted(e["key"] for e in logs if e["event"] == "generation_config_value_ignored") == [
        "temperature", "top_k", "top_p"]
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_config(tmp_path) == {}
    assert read_generation_config(tmp_path / "absent") == {}


def test_the_config_wins_over_the_model_and_the_model_over_mlxd():
    configured = SamplingDefaults(temperature=0.3, max_tokens=64)
    resolved, origins = resolve_sampling(configured, {"temperature": 0.9, "top_k": 20})
    assert (resolved.temperature, resolved.top_k, resolved.top_p, resolved.max_tokens) == (0.3, 20, 1.0, 64)
    assert origins == {"temperature": "file", "top_k": "model", "top_p": "default", "min_p": "default",
                       "repetition_penalty": "default"}
    resolved, _ = resolve_sampling(SamplingDefaults(), {})
    assert resolved == MLXD_SAMPLING


def test_the_embedded_model_ships_its_own_defaults_over_its_folder(tmp_path):
    folder = write_generation(tmp_path, {"temperature": 0.8, "top_p": 0.9})
    assert model_sampling("embedded:smollm2-135m", folder) == {"temperature": 0.0, "top_p": 0.9}
    assert model_sampling("embedded:smollm2-135m", None) == {"temperature": 0.0}
    assert model_sampling(str(folder), folder) == {"temperature": 0.8, "top_p": 0.9}


def test_check_config_shows_where_each_sampling_value_came_from(tmp_path, capsys):
    folder = write_generation(tmp_path / "model", {"temperature": 0.6, "top_k": 20})
    (folder / "config.json").write_text("{}")
    config = tmp_path / "mlxd.toml"
    config.write_text(f'[model]\nsource = "{folder}"\n[model.sampling]\ntop_k = 5\n')
    assert main(["check-config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for expected in ("[model.sampling] temperature = 0.6  (model)", "[model.sampling] top_k = 5  (file)",
                     "[model.sampling] top_p = 1.0  (default)", "[model.sampling] max_tokens = 1024  (default)"):
        assert expected in lines


def test_a_model_only_config_for_the_embedded_model_shows_its_defaults(tmp_path, capsys):
    config = tmp_path / "mlxd.toml"
    config.write_text('[model]\nsource = "embedded:smollm2-135m"\n')
    assert main(["check-config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "[model.sampling] temperature = 0.0  (model)" in lines


def test_the_daemon_samples_with_the_model_s_defaults(tmp_path, tiny_model_dir):
    # The tiny model's own folder is shared: a copy of links to its files, plus a generation_config.json.
    folder = tmp_path / "model"
    folder.mkdir()
    for item in tiny_model_dir.iterdir():
        if item.name != "generation_config.json":
            (folder / item.name).symlink_to(item)
    write_generation(folder, {"temperature": 0.0, "top_k": 7, "repetition_penalty": 1.2})
    config = tmp_path / "mlxd.toml"
    config.write_text(f'[model]\nsource = "{folder}"\nname = "tiny"\n[model.sampling]\nmax_tokens = 12\n'
                      '[logging]\nformat = "json"\n')
    with app_client(config) as (client, daemon):
        sampling = daemon.config.model.sampling
        assert (sampling.temperature, sampling.top_k, sampling.repetition_penalty, sampling.top_p) == (
            0.0, 7, 1.2, 1.0)
        # Greedy from the model's file, although the config sets no temperature (mlxd's own would be 0.7).
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}]}
        texts = {client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
                 for _ in range(3)}
    assert len(texts) == 1


def test_the_embedded_model_is_served_as_the_readme_names_it(tmp_path):
    from mlxd.cli import load_everything
    from mlxd.daemon import Daemon
    from mlxd.errors import ModelNotFound

    config = tmp_path / "mlxd.toml"
    config.write_text('[model]\nsource = "embedded:smollm2-135m"\n')
    daemon = Daemon(*load_everything(config), base_dir=tmp_path)
    assert daemon.models.names() == ["smollm2-135m"]  # the registry: what the API resolves a request's model by
    assert daemon.models.resolve("smollm2-135m") is daemon.models.resolve("embedded:smollm2-135m")
    assert daemon.models.resolve("embedded:smollm2-135m").name == "smollm2-135m"
    with pytest.raises(ModelNotFound):
        daemon.models.resolve("smollm2")
