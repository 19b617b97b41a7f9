"""Models whose modules keep arrays beside their weights start and serve.

Scaled RoPE variants (Llama 3's, YaRN, LongRoPE) compute their frequency tables in ``__init__``, as private arrays
that ``parameters()`` leaves out. MLX makes them lazily on the loading thread's stream; the engine thread that
first evaluates them has no such stream (``RuntimeError: There is no Stream(cpu, 0) in current thread``), so
such a model (Llama 3.1 and later, YaRN-extended Qwen) could not start. The load evaluates them on its own thread.
Oracle: the engine's greedy tokens equal mlx-lm's ``generate_step`` on the same folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from mlxd.config.schema import EngineConfig, ModelConfig
from mlxd.engine.base import EngineRequest, SamplingParams
from mlxd.engine.engine import BatchedEngine
from mlxd.models.load import load
from tests.helpers import run_request
from tests.support.tiny import tiny_model_cached

SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def scaled_model_dir(request: Any, tmp_path_factory: Any) -> Path:
    root = tmp_path_factory.getbasetemp().parent / "rope-models"
    return tiny_model_cached(root, "llama", rope_scaling=SCALINGS[request.param])


def solo(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    model, _ = mlx_lm_load(str(folder))
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(token) for token, _ in steps]


def test_a_model_with_private_rope_tables_serves_its_solo_tokens(scaled_model_dir: Path) -> None:
    loaded = load(ModelConfig(source=str(scaled_model_dir)))
    engine = BatchedEngine(loaded.model, EngineConfig(max_running=2))
    engine.start()
    try:
        prompt = [5 + i % 40 for i in range(90)]  # past original_max_position_embeddings: the scaled part runs
        tokens, _ = run_request(engine, EngineRequest(request_id="r", prompt=prompt, max_tokens=12,
                                                      sampling=SamplingParams(temperature=0.0)))
    finally:
        engine.stop()
    assert tokens == solo(scaled_model_dir, prompt, 12)
