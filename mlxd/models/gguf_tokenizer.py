"""Build a Hugging Face tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) from GGUF metadata.

Only what llama.cpp calls the ``gpt2`` tokenizer model (byte-level BPE) is supported, with the pre-tokenizers
whose llama.cpp regexes have an exact ``tokenizers`` equivalent. Anything else is a ``ModelLoadError``: a
tokenizer that splits text differently from the one the model was trained with degrades every answer silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from mlxd.errors import ModelLoadError

# llama.cpp's llama_token_type values (gguf ``tokenizer.ggml.token_type``).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's SMOLLM regexes are "\p{N}" followed by the GPT-2 regex; Digits(individual_digits=True)
    # isolates every numeric char the same way before ByteLevel applies the GPT-2 regex.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# ``tokenizer.ggml.pre`` value -> the equivalent pre-tokenizer.
PRE_TOKENIZERS = {"smollm": _digits_then_byte_level, "gpt-2": _byte_level}


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    return value.item() if hasattr(value, "item") else value


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}; cannot build the tokenizer")
    return meta[key]


def _check_supported(meta: dict[str, Any]) -> str:
    model = _scalar(meta, "tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported; supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    pre = _scalar(meta, "tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
            f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return pre


def _token_types(meta: dict[str, Any], num_tokens: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [1] * num_tokens
    types = types.tolist() if hasattr(types, "tolist") else list(types)
    if len(types) != num_tokens:
        raise ModelLoadError(f"GGUF has {num_tokens} tokens but {len(types)} token types")
    return types


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    # Control tokens (<|im_start|>, ...) must never be split by BPE nor produced from plain text by the
    # pre-tokenizer; user-defined ones are matched whole but are ordinary text on decode.
    added = []
    for token, token_type in zip(tokens, types, strict=True):
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
            special = token_type == TOKEN_TYPE_CONTROL
            added.append(AddedToken(token, special=special, normalized=False))
    return added


def _post_processor(tokens: list[str], meta: dict[str, Any]) -> processors.PostProcessor:
    # GGUF says whether llama.cpp prepends BOS / appends EOS; a template processor does the same here so
    # that ``encode(text)`` yields the ids llama.cpp would feed the model.
    byte_level = processors.ByteLevel(trim_offsets=False)
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False))
    if not (add_bos or add_eos):
        return byte_level
    specials, single = [], "$A"
    if add_bos:
        bos_id = int(_scalar(meta, "tokenizer.ggml.bos_token_id"))
        specials.append((tokens[bos_id], bos_id))
        single = f"{tokens[bos_id]} {single}"
    if add_eos:
        eos_id = int(_scalar(meta, "tokenizer.ggml.eos_token_id"))
        specials.append((tokens[eos_id], eos_id))
        single = f"{single} {tokens[eos_id]}"
    pair = f"{single} {single.replace('$A', '$B')}"
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return processors.Sequence([byte_level, template])


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Return a ``tokenizers.Tokenizer`` equivalent to the GGUF's llama.cpp tokenizer.

    ``meta`` is the metadata dict of ``mx.load(path, return_metadata=True)``. Raises ``ModelLoadError`` for
    tokenizer models or pre-tokenizers that have no exact equivalent here, or for inconsistent metadata.
    """
    pre = _check_supported(meta)
    tokens = list(_require(meta, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _require(meta, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ModelLoadError("GGUF tokenizer.ggml.merges holds an entry that is not 'left right'")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError("GGUF tokenizer.ggml.tokens holds duplicate tokens")

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(tokens, meta)
    tokenizer.add_tokens(_added_tokens(tokens, _token_types(meta, len(tokens))))
    return tokenizer


def special_token_ids(meta: dict[str, Any]) -> dict[str, int]:
    """The bos/eos/pad/unk ids the GGUF declares (``{"bos_token_id": 1, ...}``); absent ones are left out."""
    ids = {}
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("pad", "padding_token_id"),
        ("unk", "unknown_token_id"),
    ):
        value = _scalar(meta, f"tokenizer.ggml.{key}")
        if value is not None:
            ids[f"{name}_token_id"] = int(value)
    return ids


def tokenizer_config(meta: dict[str, Any], *, model_max_length: int | None = None) -> dict[str, Any]:
    """The ``tokenizer_config.json`` content: special tokens by text, chat template, BOS/EOS behaviour."""
    tokens = list(_require(meta, "tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    for name, token_id in special_token_ids(meta).items():
        if not 0 <= token_id < len(tokens):
            raise ModelLoadError(f"GGUF {name} {token_id} is outside the vocabulary of {len(tokens)} tokens")
        config[name.removesuffix("_id")] = tokens[token_id]
    template = _scalar(meta, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return config


def write_tokenizer_files(
    meta: dict[str, Any], out_dir: Path, *, model_max_length: int | None = None
) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the GGUF's tokenizer into ``out_dir``.

    Output is deterministic: the same metadata always yields byte-identical files.
    """
    tokenizer = build_tokenizer(meta)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    config = tokenizer_config(meta, model_max_length=model_max_length)
    text = json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
