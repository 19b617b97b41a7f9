"""A random-weight mlx-lm model of a real shape, for throughput work where no weights can be downloaded.

The weights are random (bf16 by default) and the tokenizer is a word-level one with one token per id
(``t0`` … ``t{vocab-1}``), so every id the model emits decodes. Throughput depends on the shapes only.

    python benchmarks/random_model.py OUT --preset qwen3-8b --vocab 4096
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PRESETS = {
    # Qwen3-8B's published shape.
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    # Small enough for CPU runs that measure per-token overheads (with a 49k vocabulary, say).
    "small": dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1024, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
    # The tests' tiny shape (tests/support/tiny.py), for measuring what costs besides the model.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
}


def write_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"t{i}": i for i in range(vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t0", "unk_token": "t1", "pad_token": "t0",
              "model_max_length": 32768}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build(out: Path, preset: str, vocab: int, dtype: str) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import qwen3
    from mlx_lm.utils import save_config, save_model

    out.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3", "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 32768, "tie_word_embeddings": False, "eos_token_id": 0,
              **PRESETS[preset]}
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    target = getattr(mx, dtype)
    mx.random.seed(0)
    model.update(tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(target), model.parameters()))
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, config_path=out / "config.json")
    write_tokenizer(out, vocab)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    print(build(args.out, args.preset, args.vocab, args.dtype))


if __name__ == "__main__":
    main()
