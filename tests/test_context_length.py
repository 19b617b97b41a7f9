"""``[model] context_length``: the configured length replaces the trained one; above it is allowed, with a warning."""

from __future__ import annotations

import json

import pytest
from structlog.testing import capture_logs

from mlxd.config.load import convert
from mlxd.config.schema import ModelConfig
from mlxd.errors import ConfigError
from mlxd.models.load import choose_context_length, load


def trained_length(folder) -> int:
    return json.loads((folder / "config.json").read_text())["max_position_embeddings"]


@pytest.mark.parametrize("configured", [0, 512, "trained", "above"])
def test_loaded_context_length_is_the_setting(tiny_model_dir, configured):
    trained = trained_length(tiny_model_dir)
    setting = {"trained": trained, "above": trained * 2}.get(configured, configured)
    with capture_logs() as logs:
        loaded = load(ModelConfig(source=str(tiny_model_dir), context_length=setting))
    assert loaded.context_length == (setting or trained)
    warnings = [e for e in logs if e["event"] == "context_length_above_trained"]
    if configured == "above":
        assert warnings == [{"event": "context_length_above_trained", "log_level": "warning",
                             "context_length": trained * 2, "trained_context_length": trained}]
    else:
        assert warnings == []


def test_choose_context_length_without_a_model():
    assert choose_context_length(0, 4096) == 4096
    assert choose_context_length(2048, 4096) == 2048
    assert choose_context_length(8192, 4096) == 8192


def test_negative_context_length_is_a_config_error():
    with pytest.raises(ConfigError, match="context_length"):
        convert({"source": "m", "context_length": -1}, ModelConfig, "mlxd.toml")
