"""Settings mlxd makes for MLX's CUDA backend before a model runs (mlxd.runtime.cuda)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.runtime import cuda


@pytest.mark.parametrize("kind", ["text", "vision"])
def test_models_on_cuda_run_attention_without_cudnn(monkeypatch, kind):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.delenv(cuda.CUDNN_ATTENTION, raising=False)
    cuda.prepare_attention(kind)
    assert cuda.os.environ[cuda.CUDNN_ATTENTION] == "0"
    assert not cuda.cudnn_attention()


def test_the_operator_setting_wins(monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setenv(cuda.CUDNN_ATTENTION, "1")
    cuda.prepare_attention("text")
    assert cuda.os.environ[cuda.CUDNN_ATTENTION] == "1"
    assert cuda.cudnn_attention()  # then verify passes are padded to repeat cuDNN's plans (mlxd.engine.padded)


def test_nothing_is_set_off_cuda(monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    monkeypatch.delenv(cuda.CUDNN_ATTENTION, raising=False)
    cuda.prepare_attention("text")
    assert cuda.CUDNN_ATTENTION not in cuda.os.environ
    assert not cuda.cudnn_attention()
