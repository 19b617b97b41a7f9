"""A random-weight Qwen2.5-VL model folder of a real shape, for throughput work where no weights can be downloaded.

The folder loads offline with ``mlx_vlm.load`` (and with mlx-lm as a text model, mlxd's ``[model] kind = "text"``).
It starts from mlxd's tiny Qwen2.5-VL fixture (``tests.support.tiny_vlm.build_tiny_vlm``): its tokenizer (about a
thousand tokens plus Qwen's vision tokens and a ChatML template), config.json (token ids) and processor files, then
gives config.json the preset's dimensions, the processor the real pixel bounds, and replaces the weights. The
embedding and output matrices keep the preset's vocabulary (152064 rows for the 7B); the output rows of ids the
tokenizer lacks, of end-of-sequence, special and added tokens, and of tokens that do not decode to printable text
are zero, so greedy decoding always picks an ordinary token (some logit beats the zeros) and every stream runs to
``max_tokens``. Matrices are normal with std 0.02 in the chosen dtype (bf16 by default); vectors (norms at 1,
biases) stay as the modules make them. Throughput depends on the shapes only. Saved as safetensors shards with an
index, a shard evaluated at a time.

    python benchmarks/random_vlm.py ../models/qwen2_5_vl_7b                 # Qwen2.5-VL-7B shape, ~16.6 GB
    python benchmarks/random_vlm.py /tmp/small-vlm --preset tiny --dtype float32   # seconds, for a CPU check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.support

from tests.support.tiny_vlm import build_tiny_vlm

# Qwen2.5-VL-7B-Instruct's published config.json (text at the top level, as the checkpoint has it).
_QWEN2_5_VL_7B = {
    "text": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, num_attention_heads=28,
                 num_key_value_heads=4, head_dim=128, vocab_size=152064, rope_theta=1000000.0,
                 max_position_embeddings=128000, rms_norm_eps=1e-6, sliding_window=32768,
                 tie_word_embeddings=False, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
    "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                   patch_size=14, spatial_patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                   window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, in_chans=3,
                   hidden_act="silu"),
}
_TINY = {  # the same structure, small: builds and serves in seconds on a CPU
    "text": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, rope_theta=1000000.0,
                 max_position_embeddings=32768, rms_norm_eps=1e-6, sliding_window=32768,
                 tie_word_embeddings=False, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}),
    "vision": dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256,
                   patch_size=14, spatial_patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                   window_size=112, fullatt_block_indexes=[1, 3], tokens_per_second=2, in_chans=3,
                   hidden_act="silu"),
}
PRESETS = {"qwen2.5-vl-7b": _QWEN2_5_VL_7B, "tiny": _TINY}
# Qwen2.5-VL's preprocessor_config.json: 4 to 16384 merged patches of 28×28 pixels.
_MIN_PIXELS, _MAX_PIXELS = 3136, 12845056
_STD = 0.02


def reshape_config(folder: Path, preset: str) -> dict[str, Any]:
    """The fixture's config.json (token ids, mRoPE, window attention) with the preset's dimensions."""
    config = json.loads((folder / "config.json").read_text())
    shape = PRESETS[preset]
    if shape["text"]["vocab_size"] < config["vocab_size"]:
        raise ValueError(f"preset {preset!r} has fewer embedding rows than the tokenizer's {config['vocab_size']}")
    config.update(shape["text"])
    config["vision_config"].update(shape["vision"])
    return config


def ordinary_ids(folder: Path, eos_ids: list[int]) -> list[int]:
    """Ids random output may take: not end-of-sequence, special or added, and decoding to printable ASCII."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    avoid = {*eos_ids, *tokenizer.get_added_tokens_decoder()}
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    return [i for i in range(size) if i not in avoid and _printable(tokenizer.decode([i]))]


def _printable(text: str) -> bool:
    return bool(text) and all(ch.isascii() and ch.isprintable() for ch in text)


def make_model(config: dict[str, Any]) -> Any:
    """mlx-vlm's model for ``config``, built the way ``mlx_vlm.utils.load_model`` builds it (parameters lazy)."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    params = json.loads(json.dumps(config))  # from_dict adds text_config to what it is given
    params.setdefault("text_config", {})
    module, _ = get_model_and_args(params)
    model_config = module.ModelConfig.from_dict(params)
    model_config = update_module_configs(model_config, module, params, ["text", "vision"])
    return module.Model(model_config)


def randomize(model: Any, dtype: str, seed: int, allowed: list[int]) -> None:
    """Matrices normal(0, 0.02) in ``dtype``; vectors (norms at 1, biases) kept as the modules made them. Only the
    ``allowed`` output rows are non-zero. Nothing is evaluated here: saving evaluates a shard at a time."""
    import mlx.core as mx
    from mlx.utils import tree_map

    target = getattr(mx, dtype)
    mx.random.seed(seed)

    def init(p: Any) -> Any:
        return mx.random.normal(p.shape, dtype=target, scale=_STD) if p.ndim >= 2 else p.astype(target)

    model.update(tree_map(init, model.parameters()))
    head = model.language_model.lm_head
    keep = mx.zeros((head.weight.shape[0], 1), dtype=target)
    keep[mx.array(allowed, dtype=mx.int32)] = 1
    head.weight = head.weight * keep


def build(out: Path, preset: str, dtype: str, seed: int = 0) -> Path:
    """Write the model folder ``out`` (config, weights, tokenizer, processor files); returns ``out``."""
    from mlx_vlm.utils import save_weights

    build_tiny_vlm(out, "qwen2_5_vl", seed=seed)
    (out / "model.safetensors").unlink()
    config = reshape_config(out, preset)
    model = make_model(config)
    randomize(model, dtype, seed, ordinary_ids(out, config["eos_token_id"]))
    save_weights(out, model, donate_weights=True)
    write_json(out / "config.json", config)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        data = json.loads((out / name).read_text())
        data.update(min_pixels=_MIN_PIXELS, max_pixels=_MAX_PIXELS)
        data["size"] = {"shortest_edge": _MIN_PIXELS, "longest_edge": _MAX_PIXELS}
        write_json(out / name, data)
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-vl-7b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    build(args.out, args.preset, args.dtype, args.seed)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"{args.out}: {args.preset}, {args.dtype}, {size / 1e9:.2f} GB of weights in "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
