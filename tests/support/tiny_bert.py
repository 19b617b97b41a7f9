"""A tiny random-weight BERT folder (mlx-embeddings' ``bert`` model) with a locally trained WordPiece tokenizer.

Deterministic and offline, like :mod:`tests.support.tiny`: the weights come from mlx-embeddings' own class under a
fixed seed; the tokenizer adds ``[CLS]`` and ``[SEP]`` as BERT's does. The folder loads with
``mlx_embeddings.utils.load``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tiny import _corpus, build_once

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CONFIG = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": 600, "hidden_size": 32,
          "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64,
          "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0}


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=SPECIALS)
    tokenizer.train_from_iterator(_corpus(), trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "BertTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]",
              "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]", "model_max_length": 64}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_tiny_bert(out: Path) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert

    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    model = bert.Model(bert.ModelArgs.from_dict(CONFIG))
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    _write_tokenizer(out)
    return out


def tiny_bert_cached(root: Path) -> Path:
    return build_once(root / "bert-tiny", build_tiny_bert)
