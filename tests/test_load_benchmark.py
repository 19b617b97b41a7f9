"""benchmarks/load.py's bookkeeping: the engine step phases it reads from mlxd's /v1/status between two readings,
an in-process BatchGenerator run that runs out of device memory reported as failed instead of ending the
comparison (it did, beside three servers on one H200), and the servers' order turning from round to round."""

from __future__ import annotations

import pytest

from tests.helpers import benchmark_module


@pytest.fixture(scope="module")
def load_py():
    return benchmark_module("load")


def test_step_phases_between_two_readings(load_py):
    status = {"models": {"bench": {"engine": {"num_steps": 30, "step_ms": {"prefill": 3.0, "decode_build": 5.0}}}}}
    after = load_py._find_steps(status)
    assert after["num_steps"] == 30
    steps, phases = load_py.step_phases((10, {"prefill": 2.0, "decode_build": 5.0}), (30, after["step_ms"]))
    # 90 ms of prefill over 30 steps, 20 of them over the first 10: 70 over the 20 steps between
    assert steps == 20 and phases == {"prefill": 3.5, "decode_build": 5.0}
    assert load_py.step_phases((30, {}), (30, {})) == (None, None)  # no step ran
    assert load_py._find_steps([{"other": 1}, {"x": {"num_steps": 1, "step_ms": {}}}]) == {"num_steps": 1,
                                                                                          "step_ms": {}}
    assert load_py._find_steps({"engine": None}) is None


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [1, 2, 3]


def test_a_batch_generator_run_out_of_device_memory_is_a_failed_run(load_py, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")

    monkeypatch.setattr(load_py, "_batch_generator_run", out_of_memory)
    result = load_py.direct_batch_generator(object(), _Tokenizer(), ["a", "b"], 8)
    assert (result.label, result.concurrency, result.tokens, result.failed) == ("mlx-lm BatchGenerator", 2, 0, 2)
    assert result.tokens_per_s == 0.0

    def broken(*args, **kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(load_py, "_batch_generator_run", broken)
    with pytest.raises(RuntimeError, match="something else"):
        load_py.direct_batch_generator(object(), _Tokenizer(), ["a"], 8)


def test_every_server_runs_first_after_the_in_process_run_in_turn(load_py):
    servers = ["mlxd", "baseline", "vllm-mlx"]
    orders = [load_py.rotated(servers, shift) for shift in range(6)]
    assert [order[0] for order in orders] == servers * 2  # each one first, in turn
    assert all(sorted(order) == sorted(servers) for order in orders)
    assert orders[1] == ["baseline", "vllm-mlx", "mlxd"]  # the cycle's order is kept
    assert load_py.rotated([], 3) == []
