"""Qwen-VL vision towers with one attention call a layer (mlxd.models.tower_attention), against oracles: attention
run segment by segment, and mlx-vlm's own tower on the same weights and images."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest

from mlxd.config.schema import ModelConfig
from mlxd.media.images import decode_image
from mlxd.models.load import load
from mlxd.models.tower_attention import LayoutMemo, SegmentAttention, SegmentLayout, use_segment_attention
from mlxd.pipeline.images import ImageInputs
from tests.vision_helpers import png


def segment_by_segment(q: mx.array, k: mx.array, v: mx.array, bounds: list[int], scale: float) -> mx.array:
    """The oracle: attention over each segment alone, (N, H, D) in, (N, H * D) out."""
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        seg = [t[start:end].transpose(1, 0, 2)[None] for t in (q, k, v)]
        out = mx.fast.scaled_dot_product_attention(*seg, scale=scale)
        outs.append(out[0].transpose(1, 0, 2).reshape(end - start, -1))
    return mx.concatenate(outs, axis=0)


@pytest.mark.parametrize("bounds", [
    [0, 4, 8, 12, 16],  # equal segments: one reshape
    [0, 5, 5, 12, 20, 21],  # unequal, an empty one and a one-patch one: gathered and masked
    [0, 64],  # one segment
])
def test_layout_attends_within_segments_like_one_call_each(bounds):
    rng = np.random.default_rng(len(bounds))
    q, k, v = (mx.array(rng.standard_normal((bounds[-1], 2, 8)).astype(np.float32)) for _ in range(3))
    layout = SegmentLayout.of(bounds)
    lengths = {end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True) if end > start}
    assert (layout.gather is None) == (len(lengths) == 1)
    got = layout.attend(q, k, v, 0.35)
    want = segment_by_segment(q, k, v, bounds, 0.35)
    assert got.shape == want.shape
    assert np.allclose(np.array(got), np.array(want), atol=1e-5)


def test_memo_reads_each_bounds_array_once():
    memo = LayoutMemo(size=2)
    a, b = mx.array([0, 4, 8]), mx.array([0, 8])
    first = memo.layout(a)
    assert memo.layout(a) is first and memo.layout(b) is not first
    assert memo.layout(a) is first  # still remembered: two entries
    assert memo.layout(mx.array([0, 4, 8])) is not first  # equal values, another array: read again


def tower_inputs(loaded, sizes: list[int]) -> dict[str, mx.array]:
    """The processor's inputs for square images of ``sizes`` pixels, joined as one tower call."""
    images = [decode_image(png(i, size), max_pixels=1 << 22, param="test") for i, size in enumerate(sizes)]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What are they?"}]
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                    add_generation_prompt=True)
    _, media = ImageInputs(loaded.processor, loaded.model.image_token_id).process(rendered, images)
    return {k: mx.array(media.inputs[k]) for k in ("pixel_values", "image_grid_thw")}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_tower_matches_mlx_vlm_tower(tiny_vlm, family):
    """Images whose windows are all full (224 px), and ones with partial edge windows (140 px) and of different
    sizes in one call (whole-image layers gathered too): the same features as mlx-vlm's tower on the same weights,
    to float tolerance. ``load`` makes the swap on every backend (here the CPU's attention)."""
    loaded = load(ModelConfig(source=str(tiny_vlm(family))))
    blocks = loaded.model.vlm.vision_tower.blocks
    assert all(isinstance(block.attn, SegmentAttention) for block in blocks)
    cases = [tower_inputs(loaded, sizes) for sizes in ([224], [140], [224, 140, 112])]
    got = [features(loaded, inputs) for inputs in cases]
    vision = importlib.import_module(f"mlx_vlm.models.{family}.vision")
    for block in blocks:  # mlx-vlm's own attention module on the same layers
        theirs = vision.Attention(block.attn.qkv.weight.shape[1], block.attn.num_heads)
        theirs.update_modules({"qkv": block.attn.qkv, "proj": block.attn.proj})
        block.update_modules({"attn": theirs})
    want = [features(loaded, inputs) for inputs in cases]
    for ours, reference in zip(got, want, strict=True):
        assert ours.shape == reference.shape
        assert np.allclose(ours, reference, atol=1e-4, rtol=1e-4), np.abs(ours - reference).max()
    assert use_segment_attention(loaded.model.vlm, family) == len(blocks)
    assert all(isinstance(block.attn, SegmentAttention) for block in blocks)


def features(loaded, inputs: dict[str, mx.array]) -> np.ndarray:
    """The tower's main output for ``inputs`` (one call, however many images)."""
    out = loaded.model.encode(inputs, 0, num_images=int(inputs["image_grid_thw"].shape[0]))
    return np.array(out[0] if isinstance(out, tuple) else out)
