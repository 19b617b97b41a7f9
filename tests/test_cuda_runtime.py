"""Settings mlxd makes for MLX's CUDA backend before a vision model runs (mlxd.runtime.cuda)."""

from __future__ import annotations

import mlx.core as mx

from mlxd.runtime import cuda


def test_vision_models_on_cuda_run_attention_without_cudnn(monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.delenv(cuda.CUDNN_ATTENTION, raising=False)
    cuda.prepare_for_vision()
    assert cuda.os.environ[cuda.CUDNN_ATTENTION] == "0"


def test_the_operator_setting_wins(monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setenv(cuda.CUDNN_ATTENTION, "1")
    cuda.prepare_for_vision()
    assert cuda.os.environ[cuda.CUDNN_ATTENTION] == "1"


def test_nothing_is_set_off_cuda(monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    monkeypatch.delenv(cuda.CUDNN_ATTENTION, raising=False)
    cuda.prepare_for_vision()
    assert cuda.CUDNN_ATTENTION not in cuda.os.environ
