"""A tiny random-weight Qwen3.5 checkpoint (hybrid: gated delta-net and attention layers) with its MTP head.

The folder is laid out like an MLX conversion of a native Qwen3.5 checkpoint that keeps its multi-token-prediction
tensors: one model.safetensors (``format: mlx``) holding the model's weights under mlx-vlm's names and the MTP
head's under ``mtp.*``. mlx-vlm reads both from it:

    model, processor = mlx_vlm.load(str(path))          # Model.sanitize drops the mtp.* tensors
    drafter, kind = mlx_vlm.speculative.drafters.load_drafter(str(path), kind="mtp")
    # -> Qwen3_5MTPDraftModel, "mtp": Qwen3_5MTPSplitter splits the mtp.* tensors in memory

The tokenizer, chat template and processor files are the Qwen3-VL ones of ``tiny_vlm``; weights are float32 and
rescaled like tiny.py's. Builds are deterministic, offline, and take about a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.tiny import PAD_TOKEN, _rescale, build_once
from tests.support.tiny_vlm import _build_tokenizer, _init_model, _qwen_files, _spec

# Bump when the builder's output changes, so that ``tiny_qwen3_5_mtp_cached`` folders are not reused.
_BUILD_VERSION = 1
# The tokenizer, template and processor are Qwen3-VL's: Qwen3.5 uses the same vision tokens and processor.
_TOKENIZER_FAMILY = "qwen3_vl"

_HIDDEN = 64
_LAYERS = 4  # full_attention_interval 2: linear attention in layers 0 and 2, full attention in 1 and 3
_HEAD_DIM = 16
_PARTIAL_ROTARY = 0.5  # 8 rotary dims: the mRoPE sections below sum to 4 (half of them)
_MROPE_SECTION = [2, 1, 1]


def _text_config(vocab_size: int, eos_ids: list[int]) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_text",
        "hidden_size": _HIDDEN,
        "intermediate_size": 2 * _HIDDEN,
        "num_hidden_layers": _LAYERS,
        "full_attention_interval": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": _HEAD_DIM,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,  # Metal's gated-delta kernel needs a multiple of 32
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "type": "default",
            "mrope_section": _MROPE_SECTION,
            "rope_theta": 10000.0,
            "partial_rotary_factor": _PARTIAL_ROTARY,
        },
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
        "eos_token_id": eos_ids,
    }


def _files(ids: dict[str, int], vocab_size: int, eos_ids: list[int]) -> dict[str, dict[str, Any]]:
    """config.json, generation_config.json and the Qwen3-VL processor files, for model_type ``qwen3_5``."""
    files = _qwen_files(_TOKENIZER_FAMILY, ids, vocab_size)
    config = files["config.json"]
    # Qwen3.5's vision tower is Qwen3-VL's without deepstack features.
    config["vision_config"].update(model_type="qwen3_5", deepstack_visual_indexes=[])
    config.update(
        model_type="qwen3_5",
        text_config=_text_config(vocab_size, eos_ids),
        eos_token_id=eos_ids,
        pad_token_id=ids[PAD_TOKEN],
        bos_token_id=None,
    )
    files["generation_config.json"] = {"eos_token_id": eos_ids, "pad_token_id": ids[PAD_TOKEN]}
    return files


def _init_mtp(text_config: dict[str, Any], seed: int) -> Any:
    """mlx-vlm's Qwen3.5 MTP head for ``text_config``, with seeded float32 weights rescaled like the target's."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig, Qwen3_5MTPDraftModel

    mx.random.seed(seed + 2)
    mtp = Qwen3_5MTPDraftModel(ModelConfig.from_dict({"text_config": json.loads(json.dumps(text_config))}))
    mtp.update(tree_map_with_path(_rescale(mtp), mtp.parameters()))
    mx.eval(mtp.parameters())
    return mtp


def _init_final_norm(norm: Any, seed: int) -> None:
    """Final-norm weights other than ones, so that the hidden state after the norm (the one the MTP head reads) and
    the one before it give different tokens. Feature 0 keeps weight 1: it carries tiny.py's output bias."""
    import mlx.core as mx

    weight = mx.random.uniform(0.5, 1.5, norm.weight.shape, key=mx.random.key(seed + 3))
    weight[0] = 1.0
    norm.weight = weight


def build_tiny_qwen3_5_mtp(folder: Path, *, seed: int = 0) -> Path:
    """Build a random-weight Qwen3.5 folder with an MTP head (``mtp.*`` tensors) in ``folder``; returns it.

    Text model: hidden 64, 4 layers (gated delta-net, attention, gated delta-net, attention), the ~1000-token
    tokenizer of tiny.py plus Qwen's vision tokens; a 2-layer vision tower; one MTP layer. The bytes depend only
    on the arguments.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    spec = _spec(_TOKENIZER_FAMILY)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size, ids, suppressed = _build_tokenizer(folder, _TOKENIZER_FAMILY)
    eos_ids = [ids[t] for t in spec.eos_tokens]
    files = _files(ids, vocab_size, eos_ids)

    model = _init_model("qwen3_5", files["config.json"], seed, suppressed, eos_ids)
    _init_final_norm(model.language_model.model.norm, seed)
    mtp = _init_mtp(files["config.json"]["text_config"], seed)
    weights = dict(tree_flatten(model.parameters()))
    weights.update({f"mtp.{name}": value for name, value in tree_flatten(mtp.parameters())})
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    for name, data in files.items():
        (folder / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


def tiny_qwen3_5_mtp_cached(root: Path, *, seed: int = 0) -> Path:
    """``build_tiny_qwen3_5_mtp`` into ``root/qwen3_5_mtp-v<version>-<seed>`` once; later calls reuse it."""
    path = Path(root) / f"qwen3_5_mtp-v{_BUILD_VERSION}-{seed}"
    return build_once(path, lambda out: build_tiny_qwen3_5_mtp(out, seed=seed))
