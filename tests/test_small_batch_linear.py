"""Linear layers that send 2-16 rows to mlxd's own CUDA kernel (mlxd.runtime.small_batch_linear).

The kernel itself needs an NVIDIA GPU: ``benchmarks/small_batch_matmul.py`` checks it against a float32 reference
for every weight shape of the model and exits non-zero on a mismatch. These tests check everything around it on
the CPU, with the kernel replaced by the reference product: which layers are swapped, that they keep their arrays
and names, which calls reach the kernel, and that a swapped model computes what it computed before.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlxd.config.schema import ModelConfig
from mlxd.models.load import load
from mlxd.runtime import cuda
from mlxd.runtime.small_batch import MAX_ROWS, fits, plan
from mlxd.runtime.small_batch_linear import SmallBatchLinear, use_small_batch_kernel


class Reference:
    """Stands in for the kernel: the product it must compute, and the rows of every call."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, launch, x, weight, bias):
        self.rows.append(x.size // x.shape[-1])
        assert launch.columns == weight.shape[0] and launch.has_bias == (bias is not None)
        return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


def bf16_model(folder):
    from mlx_lm.utils import load as mlx_lm_load

    model, _ = mlx_lm_load(str(folder))
    model.set_dtype(mx.bfloat16)
    return model


def test_eligible_layers_are_swapped_and_keep_their_arrays_and_names(tiny_qwen3_dir):
    model = bf16_model(tiny_qwen3_dir)
    before = dict(tree_flatten(model.parameters()))
    linears = [name for name, m in model.named_modules() if type(m) is nn.Linear]

    assert use_small_batch_kernel(model, Reference()) == len(linears) > 0

    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    swapped = {name for name, m in model.named_modules() if isinstance(m, SmallBatchLinear)}
    assert swapped == set(linears)
    assert all(isinstance(m, nn.Linear) for name, m in model.named_modules() if name in swapped)


def test_only_two_to_sixteen_rows_of_the_weight_dtype_reach_the_kernel():
    layer = nn.Linear(64, 24)
    layer.set_dtype(mx.bfloat16)
    holder = nn.Module()
    holder.layer = layer
    reference = Reference()
    use_small_batch_kernel(holder, reference)
    for rows in (1, 2, 9, MAX_ROWS, MAX_ROWS + 1):
        holder.layer(mx.zeros((rows, 1, 64), dtype=mx.bfloat16))
    holder.layer(mx.zeros((4, 64), dtype=mx.float32))  # another dtype: MLX's matmul promotes it
    assert reference.rows == [2, 9, MAX_ROWS]


def test_a_swapped_model_computes_what_it_did(tiny_qwen3_dir):
    model = bf16_model(tiny_qwen3_dir)
    tokens = mx.array([[5, 9, 13, 2, 7]] * 4) + mx.arange(4)[:, None]
    before = model(tokens[:, -1:])  # one decode position for four rows, no cache
    reference = Reference()
    use_small_batch_kernel(model, reference)
    after = model(tokens[:, -1:])
    assert reference.rows and set(reference.rows) == {4}
    assert mx.array_equal(before, after).item()


@pytest.mark.parametrize(("shape", "dtype", "expected"), [
    ((128, 4096), mx.bfloat16, True),
    ((151936, 4096), mx.float16, True),
    ((128, 96), mx.bfloat16, False),   # K not a multiple of 64
    ((12, 128), mx.bfloat16, False),   # N not a multiple of 8
    ((128, 128), mx.float32, False),   # float32 stays on MLX's matmul
])
def test_which_weights_the_kernel_takes(shape, dtype, expected):
    assert fits(mx.zeros(shape, dtype=dtype)) is expected


def test_quantized_layers_are_left_alone():
    holder = nn.Module()
    holder.layer = nn.QuantizedLinear(128, 64)
    assert use_small_batch_kernel(holder, Reference()) == 0
    assert type(holder.layer) is nn.QuantizedLinear


@pytest.mark.parametrize(("columns", "k"), [(8, 64), (24, 64), (1024, 4096), (4096, 12288), (12288, 4096),
                                             (151936, 4096)])
def test_a_launch_covers_every_column_once(columns, k):
    launch = plan(mx.zeros((columns, k), dtype=mx.bfloat16), False)
    per_block = 8 * launch.tiles
    blocks = launch.grid[0] // launch.threadgroup[0]
    assert launch.grid[0] % launch.threadgroup[0] == 0 and launch.threadgroup[0] == 32 * launch.warps
    assert blocks * per_block >= columns > (blocks - 1) * per_block
    assert launch.bf16 is True and launch.dtypes == [mx.bfloat16] and launch.has_bias is False


def test_every_kernel_variant_has_its_own_name_and_constants(monkeypatch):
    """MLX keeps compiled kernels by name: two variants sharing one would run each other's code."""
    from mlxd.runtime import small_batch

    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kwargs: made.append(kwargs) or kwargs)
    small_batch._kernel.cache_clear()
    variants = [(bias, bf16, tiles, warps) for bias in (False, True) for bf16 in (False, True) for tiles in (2, 4)
                for warps in (4, 8)]
    try:
        for variant in variants:
            small_batch._kernel(*variant)
    finally:
        small_batch._kernel.cache_clear()
    assert len({kernel["name"] for kernel in made}) == len(variants)
    for (bias, bf16, tiles, warps), kernel in zip(variants, made, strict=True):
        source = kernel["source"]
        assert f"constexpr bool IS_BF16 = {str(bf16).lower()};" in source
        assert f"constexpr int TILES = {tiles};" in source and f"constexpr int WARPS = {warps};" in source
        assert ("bias[col]" in source) == bias and ("bias" in kernel["input_names"]) == bias


@pytest.mark.parametrize("enabled", [True, False])
def test_loading_on_cuda_swaps_the_layers_unless_turned_off(monkeypatch, tiny_qwen3_dir, enabled):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setenv(cuda.CUDNN_ATTENTION, "0")
    loaded = load(ModelConfig(source=str(tiny_qwen3_dir), dtype="bfloat16", small_batch_kernel=enabled))
    kinds = {type(m) for _, m in loaded.model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds == ({SmallBatchLinear} if enabled else {nn.Linear})


def test_loading_off_cuda_leaves_the_layers(monkeypatch, tiny_qwen3_dir):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    loaded = load(ModelConfig(source=str(tiny_qwen3_dir), dtype="bfloat16"))
    assert not any(isinstance(m, SmallBatchLinear) for _, m in loaded.model.named_modules())
