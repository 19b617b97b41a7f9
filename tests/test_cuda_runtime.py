"""Settings mlxd makes for MLX's CUDA backend before a model runs (mlxd.runtime.cuda)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.runtime import cuda

SETTINGS = (cuda.CUDNN_ATTENTION, cuda.GRAPH_CACHE)


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("kind", ["text", "vision"])
def test_models_on_cuda_run_attention_without_cudnn_and_a_larger_graph_cache(on_cuda, kind):
    cuda.prepare_cuda(kind)
    assert cuda.os.environ[cuda.CUDNN_ATTENTION] == "0"
    assert not cuda.cudnn_attention()
    assert cuda.os.environ[cuda.GRAPH_CACHE] == str(cuda.GRAPH_CACHE_SIZE)
    assert cuda.GRAPH_CACHE_SIZE > 400  # MLX's default, which warm-up's graphs outnumber


def test_the_operator_settings_win(on_cuda, monkeypatch):
    monkeypatch.setenv(cuda.CUDNN_ATTENTION, "1")
    monkeypatch.setenv(cuda.GRAPH_CACHE, "123")
    cuda.prepare_cuda("text")
    assert cuda.os.environ[cuda.CUDNN_ATTENTION] == "1"
    assert cuda.cudnn_attention()  # then verify passes are padded to repeat cuDNN's plans (mlxd.engine.step.padded)
    assert cuda.os.environ[cuda.GRAPH_CACHE] == "123"


def test_each_setting_is_chosen_on_its_own(on_cuda, monkeypatch):
    monkeypatch.setenv(cuda.GRAPH_CACHE, "123")
    cuda.prepare_cuda("text")
    assert cuda.os.environ[cuda.CUDNN_ATTENTION] == "0"
    assert cuda.os.environ[cuda.GRAPH_CACHE] == "123"


def test_nothing_is_set_off_cuda(monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    cuda.prepare_cuda("text")
    assert not any(name in cuda.os.environ for name in SETTINGS)
    assert not cuda.cudnn_attention()
