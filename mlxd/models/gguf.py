"""Convert a llama-architecture GGUF file into an MLX model folder that ``mlx_lm.load`` reads.

``mx.load`` reads GGUF directly and hands Q4_0 / Q4_1 / Q8_0 tensors back as MLX affine-quantized triples
(``weight``, ``scales``, ``biases``; group size 32), so those stay quantized in the output. Every other type
(K-quants, I-quants, BF16, ...) is refused with a ``ModelLoadError`` naming the tensor, from the header alone:
``mx.load`` would hand such tensors back as float16 (BF16 losing range, K-quants at four times the size) or
misread them, instead of failing.

llama.cpp's converter permutes the rows of the Q and K projections so that its interleaved ("traditional")
RoPE sees each rotated pair side by side; mlx-lm's llama uses rotate-half RoPE like Hugging Face, so the
permutation is undone here (``unpermute_qk``). Setting ``rope_traditional`` instead would also work for
llama, but then the folder would differ from the Hugging Face checkpoint it came from.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import struct
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.errors import ModelLoadError
from mlxd.models.gguf_temp import remove_interrupted_conversions, temp_prefix
from mlxd.models.gguf_tokenizer import special_token_ids, write_tokenizer_files
from mlxd.runtime.progress import phase

# Part of the cache folder name: bump it whenever the output of a conversion changes, so that folders written
# by an older converter are not reused.
CONVERTER_VERSION = 1
GROUP_SIZE = 32

# ggml_type ids as written in GGUF tensor infos (ggml.h); gaps are ids llama.cpp has retired.
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
# What mx.load returns losslessly, as float arrays or as affine-quantized triples mlx-lm uses as they are.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF value types (gguf_type) -> struct format; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                   11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class _HeaderReader:
    """Sequential little-endian reads over the mapped GGUF header."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        self.pos += size
        return self.buf[self.pos - size : self.pos].decode("utf-8", errors="replace")

    def skip_value(self, value_type: int) -> None:
        if value_type in _SCALAR_FORMATS:
            self.pos += struct.calcsize(_SCALAR_FORMATS[value_type])
        elif value_type == _STRING:
            size = self.unpack("<Q")
            self.pos += size
        elif value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALAR_FORMATS:
                self.pos += count * struct.calcsize(_SCALAR_FORMATS[item_type])
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        else:
            raise ModelLoadError(f"GGUF metadata holds a value of unknown type {value_type}")


def read_tensor_types(gguf_path: Path) -> dict[str, str]:
    """Map each tensor name of a GGUF file to its ggml type name (``"Q4_1"``, ``"Q6_K"``, ``"type 99"``).

    Reads only the header. Raises ``ModelLoadError`` if the file is not GGUF version 2 or 3.
    """
    try:
        with open(gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ModelLoadError(f"{gguf_path} is not a GGUF file (bad magic {buf[:4]!r})")
            return _read_tensor_types(_HeaderReader(buf), gguf_path)
    except struct.error as e:
        raise ModelLoadError(f"{gguf_path}: truncated GGUF header") from e
    except ValueError as e:  # mmap refuses empty files
        raise ModelLoadError(f"{gguf_path} is not a GGUF file ({e})") from e


def _read_tensor_types(reader: _HeaderReader, gguf_path: Path) -> dict[str, str]:
    reader.pos = 4
    version = reader.unpack("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{gguf_path}: GGUF version {version} is not supported; supported: 2, 3")
    num_tensors, num_kv = reader.unpack("<Q"), reader.unpack("<Q")
    for _ in range(num_kv):
        reader.string()
        reader.skip_value(reader.unpack("<I"))
    types = {}
    for _ in range(num_tensors):
        name = reader.string()
        num_dims = reader.unpack("<I")
        reader.pos += 8 * num_dims
        type_id = reader.unpack("<I")
        reader.pos += 8  # the data offset
        types[name] = GGML_TYPE_NAMES.get(type_id, f"type {type_id}")
    return types


def check_tensor_types(types: dict[str, str]) -> None:
    """Raise ``ModelLoadError`` naming the first tensor whose type mlxd cannot load, and how many others."""
    bad = [(name, t) for name, t in types.items() if t not in SUPPORTED_TENSOR_TYPES]
    if not bad:
        return
    name, tensor_type = bad[0]
    others = f" (and {len(bad) - 1} more tensors of unsupported types)" if len(bad) > 1 else ""
    raise ModelLoadError(
        f"GGUF tensor {name!r} has type {tensor_type}, which mlxd cannot load{others}; "
        f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}. "
        "Use a Q4_0, Q4_1, Q8_0 or F16 build of the model."
    )


def _meta(meta: dict[str, Any], key: str, default: Any = ...) -> Any:
    if key not in meta:
        if default is ...:
            raise ModelLoadError(f"GGUF metadata lacks {key!r}")
        return default
    value = meta[key]
    if isinstance(value, mx.array):
        value = value.item()
    if isinstance(value, float):
        # Metadata floats are float32; the shortest float32 repr keeps config.json readable (1e-05).
        value = float(str(np.float32(value)))
    return value


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = _meta(meta, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "factor": _meta(meta, f"{arch}.rope.scaling.factor")}
    raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear")


def model_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """Build an mlx-lm llama ``config.json`` dict (without quantization) from GGUF metadata.

    Raises ``ModelLoadError`` for architectures other than llama and for llama variants mlx-lm's llama
    model cannot express (partial rotary embedding, unsupported rope scaling).
    """
    arch = _meta(meta, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = _meta(meta, f"{arch}.embedding_length")
    heads = _meta(meta, f"{arch}.attention.head_count")
    head_dim = _meta(meta, f"{arch}.attention.key_length", hidden // heads)
    rope_dim = _meta(meta, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"GGUF rope.dimension_count {rope_dim} differs from head size {head_dim}")
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": _meta(meta, f"{arch}.block_count"),
        "intermediate_size": _meta(meta, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta(meta, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _meta(meta, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _meta(meta, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": _meta(meta, f"{arch}.context_length"),
        "vocab_size": _meta(meta, f"{arch}.vocab_size", len(meta.get("tokenizer.ggml.tokens", []))),
        # llama.cpp reuses token_embd for the output layer exactly when output.weight is absent.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_traditional": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if (scaling := _rope_scaling(meta, arch)) is not None:
        config["rope_scaling"] = scaling
    ids = special_token_ids(meta)
    config.update({k: v for k, v in ids.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    return config


def _mlx_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "scales", "biases"):
        if base in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[base]}.{suffix}"
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if match and match[2] in _BLOCK_TENSORS:
            return f"model.layers.{match[1]}.{_BLOCK_TENSORS[match[2]]}.{suffix}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no counterpart in mlx-lm's llama model")


def _unpermute_rows(x: mx.array, num_heads: int) -> mx.array:
    # llama.cpp stored row (head, j, i) where Hugging Face has (head, i, j), i in {0, 1} picking the rotary
    # half; swapping back is a reshape. Packed weights, scales and biases all have one row per output.
    rows = x.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(
            f"a Q/K projection has {rows} rows, which {num_heads} heads cannot split in halves"
        )
    return x.reshape(num_heads, rows // num_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _unpermute_qk(weights: dict[str, mx.array], config: dict[str, Any]) -> None:
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name in weights:
        proj = name.rsplit(".", 2)[-2]
        if proj in heads:
            weights[name] = _unpermute_rows(weights[name], heads[proj])


def quantization_config(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """The mlx-lm ``quantization`` entry for MLX-named weights, or ``None`` if nothing is quantized.

    The most common bit width is the default; modules with another width get a per-module entry, and
    unquantized matrices an explicit ``false``, so mlx-lm never has to guess.
    """
    bits = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            bits[module] = weights[f"{module}.weight"].shape[-1] // scales.shape[-1]
    if not bits:
        return None
    default = max(Counter(bits.values()).items(), key=lambda item: (item[1], item[0]))[0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for module, module_bits in bits.items():
        if module_bits != default:
            config[module] = {"group_size": GROUP_SIZE, "bits": module_bits, "mode": "affine"}
    for name, weight in weights.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and weight.ndim == 2 and module not in bits:
            config[module] = False
    return config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _load(gguf_path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist")
    check_tensor_types(read_tensor_types(gguf_path))
    try:
        return mx.load(str(gguf_path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise ModelLoadError(f"mlx could not read GGUF file {gguf_path}: {e}") from e


def convert_gguf(gguf_path: Path, out_dir: Path, *, unpermute_qk: bool = True) -> None:
    """Write an ``mlx_lm.load``-able folder for a llama GGUF file into ``out_dir`` (created if missing).

    The folder holds ``config.json``, ``model.safetensors`` (Q4_0/Q4_1/Q8_0 tensors kept quantized, group
    size 32), ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``. Output is
    byte-for-byte deterministic. ``unpermute_qk=False`` skips undoing llama.cpp's Q/K row order and exists
    only to show that the model is then wrong. Raises ``ModelLoadError`` for unsupported architectures,
    tensor types, tensors or tokenizers.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    raw, meta = _load(gguf_path)
    config = model_config(meta, set(raw))
    weights = {_mlx_name(name): array for name, array in raw.items()}
    if unpermute_qk:
        _unpermute_qk(weights, config)
    if (quantization := quantization_config(weights)) is not None:
        # mlx-lm reads "quantization"; "quantization_config" is what its own save_config writes beside it.
        config["quantization"] = config["quantization_config"] = quantization

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out_dir / "model.safetensors"), dict(sorted(weights.items())), metadata={"format": "mlx"}
    )
    _write_json(out_dir / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(out_dir / "generation_config.json", generation)
    write_tokenizer_files(meta, out_dir, model_max_length=config["max_position_embeddings"])


def _content_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def ensure_converted(gguf_path: Path, cache_dir: Path) -> Path:
    """Return the folder converted from ``gguf_path`` under ``cache_dir``, converting on first use.

    The folder is named after the file's stem, a hash of its content and the converter version, so an edited
    file or a newer converter gets a fresh folder. Conversion goes to a temporary folder (named after this machine
    and process) that is renamed into place, so a crashed or concurrent conversion never leaves a half-written
    folder behind; the temporary folders of interrupted conversions are removed here first
    (:func:`remove_interrupted_conversions`).
    """
    gguf_path, cache_dir = Path(gguf_path), Path(cache_dir)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist")
    target = cache_dir / f"{gguf_path.stem}-{_content_digest(gguf_path)[:16]}-c{CONVERTER_VERSION}"
    if cache_dir.is_dir():
        remove_interrupted_conversions(cache_dir)
    if target.is_dir():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(target.name), dir=cache_dir))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0o700 would hide a shared cache from other users
        with phase("converting", gguf=str(gguf_path), size_bytes=gguf_path.stat().st_size):
            convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its copy first; theirs is as good as ours.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
