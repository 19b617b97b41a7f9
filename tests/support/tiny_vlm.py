"""Tiny random-weight vision-language model folders for mlx-vlm, with the tokenizer of ``tiny.py``.

Each family's folder is shaped like a converted checkpoint: config.json (with ``vision_config``, the image token ids
and the end-of-sequence ids), generation_config.json, model.safetensors saved from mlx-vlm's own model classes,
the tokenizer trained by ``tiny.build_tokenizer`` plus the family's special tokens and a chat template, and the
processor files that keep mlx-vlm's processors off the hub. Builds are deterministic and offline.

    path = tiny_vlm_cached(tmp_root, "qwen3_vl")
    model, processor = mlx_vlm.load(str(path))
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.tiny import (
    _BIAS_FEATURE,
    _EMBED_STD,
    _EOS_DAMPING,
    _LM_HEAD_SCALE,
    _SUPPRESS,
    EOS_TOKEN,
    PAD_TOKEN,
    _rescale,
    _vocab,
    build_once,
    build_tokenizer,
)
from tests.support.vlm_templates import CHATML_TEMPLATE, GEMMA_TEMPLATE, IDEFICS_TEMPLATE, TEMPLATE_HEAD

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3")

# Bump when the builder's output changes, so that ``tiny_vlm_cached`` folders from an older build are not reused.
_BUILD_VERSION = 1

_HIDDEN = 64
_LAYERS = 2
_HEADS = 4
_KV_HEADS = 2
_HEAD_DIM = 16
_VISION_HIDDEN = 32  # not below the patch size: mlx-vlm guesses the conv weight layout from its shape
# Every family turns a 64x64 image into 16 image tokens. Qwen resizes to multiples of patch * merge within these
# bounds (64x64 becomes 112x112 or 128x128, 8x8 patches merged 2x2); larger images give at most 64 tokens.
_QWEN_MIN_PIXELS = 112 * 112
_QWEN_MAX_PIXELS = 224 * 224
_GEMMA_IMAGE_SIZE = 64
_GEMMA_PATCH = 8
_GEMMA_TOKENS_PER_IMAGE = 16  # 8x8 patches average-pooled 2x2
_IDEFICS_IMAGE_SIZE = 64
_IDEFICS_PATCH = 8
_IDEFICS_SCALE_FACTOR = 2
_IDEFICS_TOKENS_PER_IMAGE = (_IDEFICS_IMAGE_SIZE // _IDEFICS_PATCH) ** 2 // _IDEFICS_SCALE_FACTOR**2
# Projections into the text model are scaled up: at their random init, image features come out far smaller than the
# text embeddings (std _EMBED_STD), and two images then hardly move greedy decoding apart.
_VISION_OUT_SCALE = 4.0
_GEMMA_BRANCH_GAIN = 32.0
_GEMMA_BIAS_GAIN = 40.0

@dataclass(frozen=True)
class _Family:
    special_tokens: tuple[str, ...]  # added to tiny's tokenizer, in this order, after its vocabulary
    eos_tokens: tuple[str, ...]  # the first is the tokenizer's eos_token
    template: str
    image: str  # what the template writes for an image part
    video: str = ""
    named_tokens: tuple[tuple[str, str], ...] = ()  # tokenizer attributes (``image_token``) the processor reads


_QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
_QWEN = _Family(
    special_tokens=_QWEN_TOKENS,
    eos_tokens=(EOS_TOKEN, PAD_TOKEN),
    template=CHATML_TEMPLATE,
    image="<|vision_start|><|image_pad|><|vision_end|>",
    video="<|vision_start|><|video_pad|><|vision_end|>",
)
_FAMILY_SPECS = {
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": _QWEN,
    "gemma3": _Family(
        special_tokens=("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        eos_tokens=("<end_of_turn>", PAD_TOKEN),
        template=GEMMA_TEMPLATE,
        image="<start_of_image>",
        named_tokens=(
            ("boi_token", "<start_of_image>"),
            ("eoi_token", "<end_of_image>"),
            ("image_token", "<image_soft_token>"),
        ),
    ),
    "idefics3": _Family(
        special_tokens=(
            "<fake_token_around_image>",
            "<image>",
            "<end_of_utterance>",
            "<global-img>",
            *(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)),
        ),
        eos_tokens=("<end_of_utterance>", PAD_TOKEN),
        template=IDEFICS_TEMPLATE,
        image="<image>",
    ),
}


def chat_template(family: str) -> str:
    """The Jinja chat template written into ``family``'s tokenizer_config.json."""
    spec = _spec(family)
    return (TEMPLATE_HEAD + spec.template).replace("@IMAGE@", spec.image).replace("@VIDEO@", spec.video)


def _spec(family: str) -> _Family:
    if family not in _FAMILY_SPECS:
        raise ValueError(f"unknown tiny VLM family {family!r}; known: {', '.join(FAMILIES)}")
    return _FAMILY_SPECS[family]


def _build_tokenizer(out_dir: Path, family: str) -> tuple[int, dict[str, int], list[int]]:
    """tiny.py's tokenizer plus the family's special tokens and template; returns ``_vocab``'s triple, extended."""
    from tokenizers import AddedToken, Tokenizer

    spec = _spec(family)
    build_tokenizer(out_dir)
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special_tokens])
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")

    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(eos_token=spec.eos_tokens[0], chat_template=chat_template(family))
    if spec.named_tokens:
        config["extra_special_tokens"] = dict(spec.named_tokens)
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    vocab_size, ids, suppressed = _vocab(out_dir)
    ids.update({t: tokenizer.token_to_id(t) for t in spec.special_tokens})
    markup = [i for t, i in ids.items() if t not in spec.eos_tokens]  # tiny's special and added tokens, and ours
    return vocab_size, ids, sorted({*suppressed, *markup})


def _text_config(vocab_size: int, **fields: Any) -> dict[str, Any]:
    return {
        "hidden_size": _HIDDEN,
        "num_hidden_layers": _LAYERS,
        "intermediate_size": 2 * _HIDDEN,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        **fields,
    }


def _vision_config(**fields: Any) -> dict[str, Any]:
    return {"hidden_size": _VISION_HIDDEN, "intermediate_size": 2 * _VISION_HIDDEN, **fields}


_NORMALIZE = {
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
}


def _qwen_files(family: str, ids: dict[str, int], vocab_size: int) -> dict[str, dict[str, Any]]:
    """config.json and the processor files of Qwen2.5-VL (patch 14) or Qwen3-VL (patch 16)."""
    qwen2_5 = family == "qwen2_5_vl"
    patch = 14 if qwen2_5 else 16
    vision = _vision_config(
        model_type=family, depth=2, num_heads=2, out_hidden_size=_HIDDEN, in_channels=3, patch_size=patch,
        spatial_merge_size=2, temporal_patch_size=2,
    )
    config: dict[str, Any] = {
        "model_type": family,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "vision_config": vision,
    }
    if qwen2_5:
        # mlx-vlm reads Qwen2.5-VL's text dimensions from the top level (and rebuilds text_config from them).
        config.update(_text_config(vocab_size), rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
        vision.update(spatial_patch_size=patch, window_size=112, fullatt_block_indexes=[1], tokens_per_second=2)
    else:
        rope = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
        config.update(
            text_config=_text_config(vocab_size, model_type="qwen3_vl_text", rope_scaling=rope),
            vocab_size=vocab_size,
            tie_word_embeddings=False,
        )
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])  # an 8x8 grid, interpolated
    processor = "Qwen2_5_VLProcessor" if qwen2_5 else "Qwen3VLProcessor"
    image = {
        **_NORMALIZE,
        "processor_class": processor,
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": _QWEN_MIN_PIXELS,
        "max_pixels": _QWEN_MAX_PIXELS,
        "size": {"shortest_edge": _QWEN_MIN_PIXELS, "longest_edge": _QWEN_MAX_PIXELS},
    }
    return {
        "config.json": config,
        "preprocessor_config.json": {**image, "image_processor_type": "Qwen2VLImageProcessor"},
        # Without it mlx-vlm asks the hub for one.
        "video_preprocessor_config.json": {
            **image,
            "video_processor_type": "Qwen2VLVideoProcessor",
            "fps": 2.0,
            "min_frames": 2,
            "max_frames": 8,
        },
        "processor_config.json": {"processor_class": processor},
    }


def _gemma3_files(ids: dict[str, int], vocab_size: int) -> dict[str, dict[str, Any]]:
    text = _text_config(
        vocab_size,
        model_type="gemma3_text",
        query_pre_attn_scalar=_HEAD_DIM,
        sliding_window=512,
        sliding_window_pattern=2,  # layer 0 local, layer 1 global
        rope_global_base_freq=10000.0,  # mlx-vlm's name for mlx-lm's rope_theta
        rope_local_base_freq=10000.0,
        mm_tokens_per_image=_GEMMA_TOKENS_PER_IMAGE,
    )
    del text["tie_word_embeddings"]  # Gemma 3 ties its output projection to the embedding
    vision = _vision_config(
        model_type="siglip_vision_model", num_hidden_layers=2, num_attention_heads=2, patch_size=_GEMMA_PATCH,
        image_size=_GEMMA_IMAGE_SIZE, layer_norm_eps=1e-6,
    )
    config = {
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": vision,
        # mlx-vlm divides image features by sqrt(hidden_size) of the top level; mlx-lm takes vocab_size from it.
        "hidden_size": _HIDDEN,
        "vocab_size": vocab_size,
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "mm_tokens_per_image": _GEMMA_TOKENS_PER_IMAGE,
    }
    image = {"processor_class": "Gemma3Processor", "image_processor_type": "Gemma3ImageProcessor", **_NORMALIZE}
    image.update(size={"height": _GEMMA_IMAGE_SIZE, "width": _GEMMA_IMAGE_SIZE}, resample=2, do_pan_and_scan=False)
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": _GEMMA_TOKENS_PER_IMAGE}
    return {"config.json": config, "preprocessor_config.json": image, "processor_config.json": processor}


def _idefics3_files(ids: dict[str, int], vocab_size: int) -> dict[str, dict[str, Any]]:
    vision = _vision_config(
        model_type="idefics3_vision", num_hidden_layers=2, num_attention_heads=2, patch_size=_IDEFICS_PATCH,
        image_size=_IDEFICS_IMAGE_SIZE, layer_norm_eps=1e-6,
    )
    config = {
        "model_type": "idefics3",
        "text_config": _text_config(vocab_size, model_type="llama", rms_norm_eps=1e-5),
        "vision_config": vision,
        "vocab_size": vocab_size,
        "image_token_id": ids["<image>"],
        "scale_factor": _IDEFICS_SCALE_FACTOR,
        "tie_word_embeddings": False,
    }
    image = {"processor_class": "Idefics3Processor", "image_processor_type": "Idefics3ImageProcessor", **_NORMALIZE}
    edge = {"longest_edge": _IDEFICS_IMAGE_SIZE}
    image.update(do_image_splitting=False, size=edge, max_image_size=edge, resample=1, do_pad=True)
    processor = {"processor_class": "Idefics3Processor", "image_seq_len": _IDEFICS_TOKENS_PER_IMAGE}
    return {"config.json": config, "preprocessor_config.json": image, "processor_config.json": processor}


def _files(family: str, ids: dict[str, int], vocab_size: int) -> dict[str, dict[str, Any]]:
    if family == "gemma3":
        return _gemma3_files(ids, vocab_size)
    if family == "idefics3":
        return _idefics3_files(ids, vocab_size)
    return _qwen_files(family, ids, vocab_size)


def _init_model(family: str, config: dict[str, Any], seed: int, suppressed: list[int], eos_ids: list[int]) -> Any:
    """Instantiate mlx-vlm's model for ``config`` with seeded, rescaled float32 weights (see tiny.py)."""
    import mlx.core as mx
    from mlx.utils import tree_map, tree_map_with_path
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    # The same steps as mlx_vlm.utils.load_model, on a copy (Qwen2.5-VL's from_dict adds text_config to it).
    params = json.loads(json.dumps(config))
    params.setdefault("text_config", {})
    module, _ = get_model_and_args(params)
    model_config = module.ModelConfig.from_dict(params)
    model_config = update_module_configs(model_config, module, params, ["text", "vision"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    lm = model.language_model
    lm.update(tree_map_with_path(_rescale(lm), lm.parameters()))

    text = lm.model if hasattr(lm, "model") else lm  # Idefics3's language model holds embed_tokens itself
    weight = _EMBED_STD * mx.random.normal(text.embed_tokens.weight.shape, key=mx.random.key(seed))
    weight[:, 0] = _BIAS_FEATURE
    if family == "gemma3":
        _init_gemma3_text(lm, weight, suppressed, eos_ids)
    else:
        text.embed_tokens.weight = weight
        head = lm.lm_head.weight * _LM_HEAD_SCALE
        suppress = mx.zeros((head.shape[0],))
        suppress[mx.array(suppressed, dtype=mx.int32)] = -_SUPPRESS
        suppress[mx.array(eos_ids, dtype=mx.int32)] = -_EOS_DAMPING
        head[:, 0] = suppress
        lm.lm_head.weight = head
    _init_vision_output(family, model, seed)
    mx.eval(model.parameters())
    return model


def _init_gemma3_text(lm: Any, embed: Any, suppressed: list[int], eos_ids: list[int]) -> None:
    """Gemma 3 ties its output projection to the embedding, so tiny.py's output bias is carried differently.

    Its RMSNorms scale by ``1 + weight``. The residual branches are made to dominate the (sqrt(hidden)-scaled)
    token embedding, or a tied model repeats its input token; they never write feature 0, which so stays the input
    token's feature 0 (the constant for ordinary tokens, 0 for suppressed ones), and the final norm amplifies it.
    """
    import mlx.core as mx

    bias = mx.full((embed.shape[0],), _BIAS_FEATURE)
    bias[mx.array(suppressed, dtype=mx.int32)] = 0.0
    bias[mx.array(eos_ids, dtype=mx.int32)] = _BIAS_FEATURE * (1 - _EOS_DAMPING / _SUPPRESS)
    embed[:, 0] = bias
    lm.model.embed_tokens.weight = embed
    hidden = embed.shape[1]
    branch = mx.full((hidden,), _GEMMA_BRANCH_GAIN - 1.0)
    branch[0] = -1.0
    for layer in lm.model.layers:
        layer.post_attention_layernorm.weight = branch
        layer.post_feedforward_layernorm.weight = branch
    final = mx.zeros((hidden,))
    final[0] = _GEMMA_BIAS_GAIN - 1.0
    lm.model.norm.weight = final


def _init_vision_output(family: str, model: Any, seed: int) -> None:
    import mlx.core as mx

    if family == "gemma3":  # its projector starts as all ones, which gives every image token the same feature
        projector = model.multi_modal_projector
        shape = projector.mm_input_projection_weight.shape
        weight = mx.random.normal(shape, key=mx.random.key(seed + 1)) / shape[0] ** 0.5
        projector.mm_input_projection_weight = weight
        return
    if family == "idefics3":
        outputs = [model.connector.modality_projection.proj]
    elif family == "qwen2_5_vl":
        outputs = [model.vision_tower.merger.mlp[-1]]
    else:
        outputs = [m.linear_fc2 for m in [model.vision_tower.merger, *model.vision_tower.deepstack_merger_list]]
    for linear in outputs:
        linear.weight = linear.weight * _VISION_OUT_SCALE


def _save_weights(out_dir: Path, family: str, model: Any) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    if family == "gemma3":
        # Like the real checkpoints: no output projection (mlx-vlm and mlx-lm tie it to the embedding).
        del weights["language_model.lm_head.weight"]
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})


def build_tiny_vlm(out_dir: Path, family: str, *, seed: int = 0) -> Path:
    """Build a random-weight mlx-vlm model folder for ``family`` (one of ``FAMILIES``) in ``out_dir``.

    The folder loads offline with ``mlx_vlm.load`` and ``mlx_vlm.utils.load_config``: config.json and
    generation_config.json (image token ids, ``eos_token_id``), float32 model.safetensors, tokenizer files with the
    family's special tokens and chat template, and the processor's JSON files. The bytes depend only on the
    arguments. Returns ``out_dir``.
    """
    spec = _spec(family)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size, ids, suppressed = _build_tokenizer(out_dir, family)
    eos_ids = [ids[t] for t in spec.eos_tokens]
    files = _files(family, ids, vocab_size)
    # No BOS: without the key, transformers' Qwen2.5-VL config defaults it to an id outside the tiny vocabulary.
    files["config.json"].update(eos_token_id=eos_ids, pad_token_id=ids[PAD_TOKEN], bos_token_id=None)
    files["generation_config.json"] = {"eos_token_id": eos_ids, "pad_token_id": ids[PAD_TOKEN]}

    model = _init_model(family, files["config.json"], seed, suppressed, eos_ids)
    _save_weights(out_dir, family, model)
    for name, data in files.items():
        (out_dir / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out_dir


def _params_hash(family: str, kw: dict[str, Any]) -> str:
    key = json.dumps({"family": family, "version": _BUILD_VERSION, **kw}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def tiny_vlm_cached(root: Path, family: str, **kw: Any) -> Path:
    """``build_tiny_vlm`` into ``root/<family>-<hash of the arguments>`` once; later calls reuse the folder."""
    _spec(family)
    path = Path(root) / f"{family}-{_params_hash(family, kw)}"
    return build_once(path, lambda out: build_tiny_vlm(out, family, **kw))
