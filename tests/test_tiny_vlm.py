"""The tiny vision-language folders load offline with mlx-vlm, expand image placeholders, see their images, and
render chats; the text model of each checkpoint agrees with mlx-lm's where mlx-lm can load it."""

from __future__ import annotations

import filecmp
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.support.tiny_vlm import FAMILIES, build_tiny_vlm, tiny_vlm_cached

mx = pytest.importorskip("mlx.core")
mlx_vlm = pytest.importorskip("mlx_vlm")

TOKENS_PER_IMAGE = 16  # for a 64x64 image, in every family


@dataclass(frozen=True)
class Expect:
    placeholder: str  # what the chat template writes for an image
    before: str  # the token just before the run of image tokens the processor expands it into
    image: str
    after: str
    extras: frozenset[str]  # processor outputs beside input_ids, attention_mask and pixel_values
    pixel_shape: tuple[int, ...]
    eos: tuple[str, ...]
    end_of_turn: str
    system_is_a_turn: bool
    generation_prompt: str


_QWEN = {
    "placeholder": "<|vision_start|><|image_pad|><|vision_end|>",
    "before": "<|vision_start|>",
    "image": "<|image_pad|>",
    "after": "<|vision_end|>",
    "extras": frozenset({"image_grid_thw"}),
    "eos": ("<|im_end|>", "<|endoftext|>"),
    "end_of_turn": "<|im_end|>",
    "system_is_a_turn": True,
    "generation_prompt": "<|im_start|>assistant\n",
}
EXPECT = {
    # 64x64 is resized to 112x112 (patch 14) or 128x128 (patch 16): 8x8 patches, merged 2x2.
    "qwen2_5_vl": Expect(**_QWEN, pixel_shape=(64, 3 * 2 * 14 * 14)),
    "qwen3_vl": Expect(**_QWEN, pixel_shape=(64, 3 * 2 * 16 * 16)),
    "gemma3": Expect(
        placeholder="<start_of_image>",
        before="<start_of_image>",
        image="<image_soft_token>",
        after="<end_of_image>",
        extras=frozenset(),
        pixel_shape=(1, 3, 64, 64),
        eos=("<end_of_turn>", "<|endoftext|>"),
        end_of_turn="<end_of_turn>",
        system_is_a_turn=False,
        generation_prompt="<start_of_turn>model\n",
    ),
    "idefics3": Expect(
        placeholder="<image>",
        before="<global-img>",
        image="<image>",
        after="<fake_token_around_image>",
        extras=frozenset({"pixel_attention_mask"}),
        pixel_shape=(1, 1, 3, 64, 64),
        eos=("<end_of_utterance>", "<|endoftext|>"),
        end_of_turn="<end_of_utterance>",
        system_is_a_turn=True,
        generation_prompt="Assistant:",
    ),
}
ONE_IMAGE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
GOLDEN = {
    "qwen2_5_vl": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "qwen3_vl": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "gemma3": "<start_of_turn>user\n<start_of_image>What is it?<end_of_turn>\n<start_of_turn>model\n",
    "idefics3": "<|im_start|>User:<image>What is it?<end_of_utterance>\nAssistant:",
}
MLX_LM_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3")


@pytest.fixture(scope="session", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def vlm_dirs(tiny_models_root: Path) -> dict[str, Path]:
    return {f: tiny_vlm_cached(tiny_models_root, f) for f in FAMILIES}


@pytest.fixture
def vlm_dir(family: str, vlm_dirs: dict[str, Path]) -> Path:
    return vlm_dirs[family]


@pytest.fixture
def hub_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Calls that would reach the hub; mlx-vlm's processors fetch a missing JSON file through huggingface_hub."""
    import huggingface_hub

    calls: list[tuple] = []

    def offline(*args, **kwargs):
        calls.append(args)
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    return calls


def image(seed: int):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_token_id(model) -> int:
    config = model.config
    return getattr(config, "image_token_id", None) or config.image_token_index


def render(processor, messages: list[dict], add_generation_prompt: bool = True) -> str:
    from mlx_vlm.prompt_utils import get_chat_template

    return get_chat_template(processor, messages, add_generation_prompt)


def prepare(model, processor, prompt: str, images: list) -> dict:
    from mlx_vlm.utils import prepare_inputs

    return prepare_inputs(processor, images=images, prompts=[prompt], image_token_index=image_token_id(model))


def prefill(model, inputs: dict, cache) -> tuple:
    """Embed (with the images), then run the language model: last-position logits and Qwen's rope_deltas."""
    extras = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    features = model.get_input_embeddings(
        inputs["input_ids"], inputs.get("pixel_values"), mask=inputs["attention_mask"], **extras
    )
    fields = {k: v for k, v in features.to_dict().items() if k != "inputs_embeds" and v is not None}
    out = model.language_model(inputs["input_ids"], inputs_embeds=features.inputs_embeds, cache=cache, **fields)
    return out.logits[0, -1], fields.get("rope_deltas")


def last_logits(model, inputs: dict) -> np.ndarray:
    from mlx_vlm.models.cache import make_prompt_cache

    logits, _ = prefill(model, inputs, make_prompt_cache(model.language_model))
    return np.array(logits)


def greedy(model, inputs: dict, max_tokens: int) -> list[int]:
    """Greedy decoding; Qwen's rope_deltas are passed on every step rather than left on the model object."""
    from mlx_vlm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model.language_model)
    logits, rope_deltas = prefill(model, inputs, cache)
    step = {} if rope_deltas is None else {"rope_deltas": rope_deltas}
    tokens = [int(logits.argmax())]
    while len(tokens) < max_tokens:
        logits = model.language_model(mx.array([[tokens[-1]]]), cache=cache, **step).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


def test_builds_are_byte_identical_and_depend_on_the_seed(tmp_path: Path) -> None:
    for family in FAMILIES:
        first = build_tiny_vlm(tmp_path / f"{family}-a", family, seed=7)
        second = build_tiny_vlm(tmp_path / f"{family}-b", family, seed=7)
        other = build_tiny_vlm(tmp_path / f"{family}-c", family, seed=8)
        names = sorted(p.name for p in first.iterdir())
        assert names == sorted(p.name for p in second.iterdir())
        for name in names:
            assert filecmp.cmp(first / name, second / name, shallow=False), f"{family}/{name} differs"
        assert [n for n in names if not filecmp.cmp(first / n, other / n, shallow=False)] == ["model.safetensors"]


def test_cached_folder_is_reused_per_argument_set(tmp_path: Path) -> None:
    path = tiny_vlm_cached(tmp_path, "gemma3")
    assert path.name.startswith("gemma3-") and (path / "model.safetensors").exists()
    assert tiny_vlm_cached(tmp_path, "gemma3") == path
    assert tiny_vlm_cached(tmp_path, "gemma3", seed=1) != path
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind
    with pytest.raises(ValueError, match="unknown tiny VLM family 'llava'"):
        build_tiny_vlm(tmp_path / "x", "llava")


def test_folder_loads_offline_and_config_names_its_tokens(family: str, vlm_dir: Path, hub_calls: list) -> None:
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_config

    model, processor = mlx_vlm.load(str(vlm_dir))
    assert hub_calls == []
    config = load_config(vlm_dir)
    expect = EXPECT[family]
    tokenizer = processor.tokenizer

    assert config["model_type"] == family and config["vision_config"]
    assert ("text_config" in config) == (family != "qwen2_5_vl")  # mlx-vlm reads Qwen2.5-VL's from the top level
    assert image_token_id(model) == tokenizer.convert_tokens_to_ids(expect.image)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in expect.eos]
    assert config["eos_token_id"] == eos_ids == list(model.config.eos_token_id)
    assert json.loads((vlm_dir / "generation_config.json").read_text())["eos_token_id"] == eos_ids
    assert tokenizer.eos_token == expect.eos[0]
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}


def test_qwen_processor_reaches_for_the_hub_without_its_video_config(vlm_dirs, tmp_path, hub_calls) -> None:
    """The negative control of the offline check: a Qwen folder without video_preprocessor_config.json."""
    path = shutil.copytree(vlm_dirs["qwen3_vl"], tmp_path / "qwen3_vl")
    (path / "video_preprocessor_config.json").unlink()
    mlx_vlm.load(str(path))
    assert [call[1] for call in hub_calls] == ["video_preprocessor_config.json"]


def test_chat_templates_of_processor_and_tokenizer_agree(family: str, vlm_dir: Path) -> None:
    _, processor = mlx_vlm.load(str(vlm_dir))
    rendered = processor.tokenizer.apply_chat_template(ONE_IMAGE, tokenize=False, add_generation_prompt=True)
    assert rendered == GOLDEN[family]
    assert render(processor, ONE_IMAGE) == rendered  # mlx-vlm's own path, which falls back to the tokenizer
    if family.startswith("qwen"):
        assert processor.apply_chat_template(ONE_IMAGE, add_generation_prompt=True) == rendered
    else:
        # mlx-vlm 0.7's Gemma3Processor and Idefics3Processor drop the chat template whatever the folder holds.
        assert processor.chat_template is None


def test_prepare_inputs_expands_the_placeholder(family: str, vlm_dir: Path) -> None:
    model, processor = mlx_vlm.load(str(vlm_dir))
    expect = EXPECT[family]
    inputs = prepare(model, processor, render(processor, ONE_IMAGE), [image(1)])

    assert set(inputs) == {"input_ids", "attention_mask", "pixel_values", *expect.extras}
    assert inputs["pixel_values"].shape == expect.pixel_shape
    ids = inputs["input_ids"][0].tolist()
    token = processor.tokenizer.convert_tokens_to_ids
    first = ids.index(token(expect.image))
    assert ids[first - 1 : first + TOKENS_PER_IMAGE + 1] == (
        [token(expect.before)] + [token(expect.image)] * TOKENS_PER_IMAGE + [token(expect.after)]
    )
    assert ids.count(token(expect.image)) == TOKENS_PER_IMAGE
    if family.startswith("qwen"):
        assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    if family == "idefics3":
        assert inputs["pixel_attention_mask"].shape == (1, 1, 64, 64)


def test_processor_ignores_numpy_but_its_image_processor_gives_it(family: str, vlm_dir: Path) -> None:
    model, processor = mlx_vlm.load(str(vlm_dir))
    prompt = render(processor, ONE_IMAGE)
    out = processor(text=[prompt], images=[image(1)], return_tensors="np", padding=True)
    assert all(isinstance(v, mx.array) for v in out.values()), {k: type(v) for k, v in out.items()}

    # The numpy route (image processor, then the placeholder count it implies) reproduces the processor's output.
    pixels = processor.image_processor(images=[image(1)], return_tensors="np")
    assert isinstance(pixels["pixel_values"], np.ndarray)
    np.testing.assert_array_equal(pixels["pixel_values"], np.array(out["pixel_values"]))
    if family.startswith("qwen"):
        count = int(np.prod(pixels["image_grid_thw"][0])) // processor.image_processor.merge_size**2
    elif family == "gemma3":
        count = processor.image_seq_length
    else:
        count = processor.image_seq_len
    assert count == int((np.array(out["input_ids"]) == image_token_id(model)).sum()) == TOKENS_PER_IMAGE
    assert isinstance(processor.tokenizer([prompt], return_tensors="np")["input_ids"], np.ndarray)


def test_images_change_the_logits_and_calls_keep_no_state(family: str, vlm_dir: Path) -> None:
    model, processor = mlx_vlm.load(str(vlm_dir))
    prompt = render(processor, ONE_IMAGE)
    first = last_logits(model, prepare(model, processor, prompt, [image(1)]))
    second = last_logits(model, prepare(model, processor, prompt, [image(2)]))
    again = last_logits(model, prepare(model, processor, prompt, [image(1)]))

    assert first.shape == (model.config.text_config.vocab_size,) and np.isfinite(first).all()
    assert np.abs(first - second).max() > 0.5
    np.testing.assert_array_equal(first, again)
    assert greedy(model, prepare(model, processor, prompt, [image(1)]), 8) != greedy(
        model, prepare(model, processor, prompt, [image(2)]), 8
    )


def test_greedy_matches_mlx_vlm_generation(family: str, vlm_dir: Path) -> None:
    from mlx_vlm import stream_generate

    model, processor = mlx_vlm.load(str(vlm_dir))
    prompt = render(processor, ONE_IMAGE)
    ours = greedy(model, prepare(model, processor, prompt, [image(3)]), 10)
    model, processor = mlx_vlm.load(str(vlm_dir))
    theirs = [r.token for r in stream_generate(
        model, processor, prompt, image=[image(3)], max_tokens=10, temperature=0.0
    )]
    assert theirs[:10] == ours  # stream_generate ends with an extra response repeating the last token


def test_text_only_input(family: str, vlm_dir: Path) -> None:
    from mlx_vlm.utils import prepare_inputs

    model, processor = mlx_vlm.load(str(vlm_dir))
    prompt = render(processor, [{"role": "user", "content": "Write a haiku about autumn."}])
    inputs = prepare_inputs(processor, prompts=[prompt])
    assert set(inputs) == {"input_ids", "attention_mask"}
    ids = inputs["input_ids"]
    plain = np.array(model.language_model(ids).logits[0, -1])

    last_logits(model, prepare(model, processor, render(processor, ONE_IMAGE), [image(1)]))
    embedded = last_logits(model, inputs)  # get_input_embeddings with pixel_values=None
    np.testing.assert_allclose(embedded, plain, rtol=1e-5, atol=1e-5)
    # Gemma 3's Model.__call__ takes pixel_values positionally, with no default.
    np.testing.assert_allclose(np.array(model(ids, None).logits[0, -1]), plain, rtol=1e-5, atol=1e-5)

    tokens = greedy(model, inputs, 24)
    assert len(set(tokens)) >= 12, f"greedy output collapsed: {tokens}"
    tokenizer = processor.tokenizer
    markup = set(tokenizer.added_tokens_decoder) - set(model.config.eos_token_id)
    assert not markup & set(tokens), tokenizer.convert_ids_to_tokens(tokens)
    assert tokenizer.decode(tokens).isascii()


@pytest.mark.parametrize("family", MLX_LM_FAMILIES)
def test_mlx_lm_loads_the_text_model(family: str, vlm_dirs: dict[str, Path]) -> None:
    import mlx_lm
    from mlx_vlm.utils import prepare_inputs

    path = vlm_dirs[family]
    lm_model, lm_tokenizer = mlx_lm.load(str(path))
    model, processor = mlx_vlm.load(str(path))
    prompt = render(processor, [{"role": "user", "content": "What is the capital of France?"}])
    ids = processor.tokenizer.encode(prompt, add_special_tokens=False)
    assert lm_tokenizer.encode(prompt, add_special_tokens=False) == ids
    assert lm_tokenizer.eos_token_ids == set(model.config.eos_token_id)

    expected = np.array(model.language_model(mx.array([ids])).logits)
    np.testing.assert_allclose(np.array(lm_model(mx.array([ids]))), expected, rtol=1e-4, atol=1e-4)

    tokens = [r.token for r in mlx_lm.stream_generate(lm_model, lm_tokenizer, ids, max_tokens=12)]
    assert tokens == greedy(model, prepare_inputs(processor, prompts=[prompt]), 12)


def test_mlx_lm_cannot_load_idefics3(vlm_dirs: dict[str, Path]) -> None:
    import mlx_lm

    with pytest.raises(ValueError, match="Model type idefics3 not supported"):
        mlx_lm.load(str(vlm_dirs["idefics3"]))


def test_conversation_renders_every_turn_and_image_in_order(family: str, vlm_dir: Path) -> None:
    model, processor = mlx_vlm.load(str(vlm_dir))
    expect = EXPECT[family]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    conversation = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "First question."}, {"type": "image"}]},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}, {"type": "text", "text": "Q2"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Second answer."}], "tool_calls": [call]},
        {"role": "tool", "content": '{"temperature": 21}'},
        {"role": "user", "content": "Third question."},
    ]
    tokenizer = processor.tokenizer
    prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    pieces = [
        "You are a careful assistant.",
        "First question.",
        expect.placeholder,
        "First answer.",
        expect.placeholder,
        "Q2",
        "Second answer.",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '{"temperature": 21}',
        "Third question.",
    ]
    at = 0
    for piece in pieces:
        found = prompt.find(piece, at)
        assert found >= 0, f"{piece!r} missing or out of order in {prompt!r}"
        at = found + len(piece)
    assert prompt.count(expect.placeholder) == 2 and prompt.endswith(expect.generation_prompt)
    assert prompt.count(expect.end_of_turn) == len(conversation) - (not expect.system_is_a_turn)
    without = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
    assert without + expect.generation_prompt == prompt

    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Third question."}]}]
    as_string = [{"role": "user", "content": "Third question."}]
    assert render(processor, as_parts) == render(processor, as_string)

    inputs = prepare(model, processor, prompt, [image(1), image(2)])
    assert int((inputs["input_ids"] == image_token_id(model)).sum()) == 2 * TOKENS_PER_IMAGE
    assert np.isfinite(last_logits(model, inputs)).all()
