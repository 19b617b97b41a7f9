"""``[engine] kv_bits`` over a tensor-parallel group: each rank quantizes the key and value heads it holds (the
same groups of features as one process: a head is never split), so two ranks serve what one process serves with the
same setting, token for token, and the next turn of a conversation hits the quantized prefix cache on both ranks.

Started as users start a group (``mlxd launch``: two processes over MLX's ``ring`` backend on loopback), like
``tests/test_distributed.py``, whose helpers these are.
"""

from __future__ import annotations

import time

import httpx

from tests.helpers import SHORT_HITS, free_port, serve_subprocess, write_config
from tests.support.tiny import tiny_model_cached
from tests.test_distributed import (
    conversation,
    distributed_config,
    eight_at_once,
    launched,
    ranks,
    separated_model,
)
from tests.test_kv_bits import HEADS_OF_32

KV_BITS = SHORT_HITS + "kv_bits = 8\nkv_group_size = 32\n"


def test_two_ranks_serve_quantized_keys_as_one_process_does(tiny_models_root, tmp_path):
    model = separated_model(tiny_model_cached(tiny_models_root, "qwen3", **HEADS_OF_32), tmp_path / "model")
    single_port, group_port = free_port(), free_port()
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    single = write_config(tmp_path / "one", model, port=single_port, extra=KV_BITS)
    group = distributed_config(tmp_path / "two", model, group_port, extra=KV_BITS)
    with serve_subprocess(single, single_port) as (base, _):
        expected = eight_at_once(base)
        expected_turn2, _ = conversation(base)
    with launched(group, group_port) as (base, _, _):
        before = ranks(base)
        served = eight_at_once(base)
        assert [text for text, _ in served] == [text for text, _ in expected]
        turn2, usage = conversation(base)
        assert turn2 == expected_turn2
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        time.sleep(1.5)  # the ranks' counters travel with rank 0's next message (a heartbeat while idle)
        after = ranks(base)
        for rank_before, rank_after in zip(before, after, strict=True):
            assert rank_after["prefix_hits"] > rank_before["prefix_hits"]  # turn 2 hit on every rank
        assert httpx.get(base + "/v1/status", timeout=10).json()["distributed"]["size"] == 2
