"""mlxd.models.vision_attention against mlx-vlm's own ``VisionAttention`` (the oracle): the module alone, with and
without masks, and whole SigLIP-style towers (Gemma 3, Idefics3) on the same weights and image."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_vlm.models.attention import VisionAttention

from mlxd.models.vision_attention import CpuVisionAttention, replace_modules, use_cpu_vision_attention
from tests.test_vision_engine import Prompts, last_logits, loaded_model


def attention(dims: int = 32, heads: int = 4) -> VisionAttention:
    module = VisionAttention(dims, heads)
    rng = np.random.default_rng(dims + heads)
    module.update(nn.utils.tree_map(lambda p: mx.array(rng.standard_normal(p.shape).astype(np.float32) * 0.3),
                                    module.parameters()))
    return module


@pytest.mark.parametrize("mask_kind", [None, "keys", "additive", "causal"])
def test_module_equals_mlx_vlm_attention(mask_kind):
    theirs = attention()
    ours = CpuVisionAttention(theirs)
    x = mx.array(np.random.default_rng(1).standard_normal((2, 20, 32)).astype(np.float32))
    mask = None
    if mask_kind == "keys":  # the second image's last 6 patches are padding
        mask = mx.array(np.arange(20)[None, :] < np.array([20, 14])[:, None])[:, None, None, :]
    elif mask_kind == "causal":
        mask = "causal"
    elif mask_kind == "additive":
        mask = mx.array(np.where(np.arange(20)[None, :] < np.array([20, 14])[:, None], 0.0, -1e9)
                        .astype(np.float32))[:, None, None, :]
    want = theirs(x, mask)
    got = ours(x, mask)
    assert got.shape == want.shape == (2, 20, 32)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "idefics3"])
def test_tower_equals_mlx_vlm_tower(tiny_vlm, family):
    """``load`` swaps every ``VisionAttention`` on the CPU; an image prompt's logits are those with mlx-vlm's own
    attention put back on the same weights."""
    loaded = loaded_model(tiny_vlm(family))
    modules = [m for _, m in loaded.model.vlm.named_modules()]
    num_swapped = sum(isinstance(m, CpuVisionAttention) for m in modules)
    assert num_swapped and not any(type(m) is VisionAttention for m in modules)
    prompt, media = Prompts(loaded)("What is in it?", 3)
    got = np.array(last_logits(loaded.model, prompt, media, chunk=4096))
    restored = replace_modules(loaded.model.vlm, lambda m: isinstance(m, CpuVisionAttention), mlx_vlm_attention)
    assert restored == num_swapped
    want = np.array(last_logits(loaded.model, prompt, media, chunk=4096))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()) + 1e-5)
    assert use_cpu_vision_attention(loaded.model.vlm) == num_swapped


def mlx_vlm_attention(ours: CpuVisionAttention) -> VisionAttention:
    """mlx-vlm's own module holding ``ours``'s layers."""
    theirs = VisionAttention(ours.q_proj.weight.shape[0], ours.num_heads, query_input_dims=ours.q_proj.weight.shape[1],
                             key_input_dims=ours.k_proj.weight.shape[1], value_input_dims=ours.v_proj.weight.shape[1],
                             value_dims=ours.v_proj.weight.shape[0], value_output_dims=ours.out_proj.weight.shape[0],
                             bias="bias" in ours.q_proj)
    theirs.update_modules({"q_proj": ours.q_proj, "k_proj": ours.k_proj, "v_proj": ours.v_proj,
                           "out_proj": ours.out_proj})
    return theirs
