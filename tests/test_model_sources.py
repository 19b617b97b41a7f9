"""Model sources: folders, GGUF files, the embedded model; hub ids and missing paths fail with clear messages."""

from __future__ import annotations

import pytest

from mlxd.errors import ModelLoadError
from mlxd.models.load import detect_kind, resolve_source


def test_hub_id_is_refused_with_a_clear_message():
    with pytest.raises(ModelLoadError, match="looks like a hub id.*does not download models"):
        resolve_source("Qwen/Qwen3-0.6B")


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_source(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="GGUF file .* not found"):
        resolve_source(str(tmp_path / "model.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_source(str(tmp_path / "empty"))


def test_folders_resolve_relative_to_the_config(tiny_model_dir):
    assert resolve_source(tiny_model_dir.name, base_dir=tiny_model_dir.parent) == tiny_model_dir
    assert detect_kind(tiny_model_dir, "auto") == "text"
    with pytest.raises(ModelLoadError, match="is a text model"):
        detect_kind(tiny_model_dir, "vision")
