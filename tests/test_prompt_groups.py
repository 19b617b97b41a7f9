"""Whole prompts processed together (mlxd.engine.prompts.process_prompts), padded to a rounded length as on GPU
backends: the padding is invisible. Oracle: the same rows processed with no padding beyond the longest prompt give
the same first tokens and the same greedy continuations; attention-only and hybrid (recurrent) tiny models."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import RotatingKVCache

from mlxd.engine.base import SamplingParams
from mlxd.engine.batch import DecodeBatch
from mlxd.engine.prompts import group_width, process_prompts
from mlxd.engine.row import Row

PROMPTS = [[5, 9, 13, 2, 7, 11], [3, 4], [8, 8, 1, 6, 2, 9, 4, 7, 12, 3, 5], [10, 14, 6]]


@pytest.fixture(params=["llama", "qwen3_next"])
def model(request, tiny_model_dir, tiny_qwen3_next_dir):
    return load(str(tiny_model_dir if request.param == "llama" else tiny_qwen3_next_dir))[0]


def greedy_group(model, monkeypatch, bucket: int, steps: int = 8) -> tuple[list[list[int]], int]:
    """Each row's first token and ``steps`` more, the rows prompted together with ``bucket``; and the pass width."""
    monkeypatch.setattr("mlxd.engine.prompts.group_bucket", lambda: bucket)
    rows = [Row.for_request(f"r{i}", SamplingParams(), model, 0) for i in range(len(PROMPTS))]
    cache, first = process_prompts(model, rows, PROMPTS)
    width = cache[0].offset if hasattr(cache[0], "offset") else None
    batch = DecodeBatch(model)
    batch.add_batch(rows, cache, first)
    emitted = [[] for _ in rows]
    for _ in range(steps):
        for i, tokens in enumerate(batch.step()):
            emitted[i] += tokens
    return emitted, width


def test_padding_a_group_to_a_rounded_length_changes_no_token(model, monkeypatch):
    exact, _ = greedy_group(model, monkeypatch, bucket=1)
    rounded, _ = greedy_group(model, monkeypatch, bucket=16)
    assert rounded == exact


@pytest.mark.parametrize(("longest", "bucket", "width"), [(27, 16, 32), (32, 16, 32), (33, 16, 48), (1, 16, 16),
                                                         (27, 1, 27)])
def test_group_width_rounds_up_to_the_bucket(monkeypatch, tiny_model_dir, longest, bucket, width):
    monkeypatch.setattr("mlxd.engine.prompts.group_bucket", lambda: bucket)
    model = load(str(tiny_model_dir))[0]
    assert group_width([Row.for_request("r", SamplingParams(), model, 0)], longest) == width


def test_sliding_window_rows_keep_their_exact_length(monkeypatch):
    monkeypatch.setattr("mlxd.engine.prompts.group_bucket", lambda: 16)
    row = SimpleNamespace(cache=[RotatingKVCache(max_size=64, keep=0)])  # all group_width reads of a row
    assert group_width([row], 27) == 27


def test_the_bucket_is_one_on_the_cpu():
    from mlxd.engine.prompts import GROUP_BUCKET, group_bucket

    assert group_bucket() == (1 if mx.default_device() == mx.cpu else GROUP_BUCKET)
