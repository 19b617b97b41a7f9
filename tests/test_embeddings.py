"""``kind = "embedding"`` and ``POST /v1/embeddings``: vectors against a direct computation with the model's own
layers, batch independence, base64 against floats, dimensions, and the 400s that name the field or the model."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests.helpers import app_client, write_config

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a", "What is the capital of France?",
         "Rain fell softly on the roof while the kettle sang in the kitchen and the cat slept."]
ATOL = 1e-5


def _load(model_dir: Path):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    model.set_dtype(mx.float32)  # as mlxd serves on the Linux CPU (dtype "auto")
    return model, tokenizer


def _direct(model, ids: list[int], pooling: str) -> np.ndarray:
    """The oracle: the body's layers one by one on a single unpadded input (causal mask), the final norm, pooled,
    L2-normalized."""
    body = model.model
    hidden = body.embed_tokens(mx.array([ids]))
    for layer in body.layers:
        hidden = layer(hidden, "causal" if len(ids) > 1 else None, None)
    hidden = body.norm(hidden)[0].astype(mx.float32)
    vector = np.array(hidden[-1] if pooling == "last" else hidden.mean(axis=0))
    return vector / np.linalg.norm(vector)


def _vectors(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [item["index"] for item in data] == list(range(len(data)))
    return np.array([item["embedding"] for item in data], dtype=np.float32)


@pytest.fixture(scope="module", params=["last", "mean"])
def served(request, tiny_qwen3_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"embed-{request.param}")
    extra = f'kind = "embedding"\npooling = "{request.param}"\ncontext_length = 24\ndimensions_allowed = true'
    with app_client(write_config(tmp, tiny_qwen3_dir, model_extra=extra)) as (client, daemon):
        yield client, daemon, request.param


def test_vectors_match_a_direct_computation_with_the_models_layers(served, tiny_qwen3_dir):
    client, _, pooling = served
    model, tokenizer = _load(tiny_qwen3_dir)
    got = _vectors(client.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS}))
    expected = np.stack([_direct(model, tokenizer.encode(text), pooling) for text in TEXTS])
    assert got.shape == (len(TEXTS), model.args.hidden_size)
    np.testing.assert_allclose(got, expected, atol=ATOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=ATOL)
    # The same inputs as token ids give the same vectors; usage counts their tokens.
    ids = [tokenizer.encode(text) for text in TEXTS]
    response = client.post("/v1/embeddings", json={"model": "gpt-4o", "input": ids})
    np.testing.assert_array_equal(_vectors(response), got)
    body = response.json()
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    assert body["model"] == "tiny" and body["object"] == "list"


def test_equal_inputs_give_equal_vectors_in_any_batch(served):
    client, _, _ = served
    batch = _vectors(client.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS}))
    for index, text in enumerate(TEXTS):
        solo = _vectors(client.post("/v1/embeddings", json={"model": "tiny", "input": text}))
        np.testing.assert_allclose(solo[0], batch[index], atol=ATOL)
    repeated = _vectors(client.post("/v1/embeddings", json={"model": "tiny", "input": [TEXTS[1]] * 3 + [TEXTS[4]]}))
    np.testing.assert_allclose(repeated[:3], np.stack([batch[1]] * 3), atol=ATOL)


def test_base64_is_the_little_endian_float32_of_the_float_list(served):
    client, _, _ = served
    floats = _vectors(client.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS[:2]}))
    response = client.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS[:2], "encoding_format": "base64"})
    decoded = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
                        for item in response.json()["data"]])
    np.testing.assert_array_equal(decoded, floats)


def test_dimensions_are_the_first_features_renormalized(served):
    client, _, _ = served
    full = _vectors(client.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS[1]}))[0]
    short = _vectors(client.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS[1], "dimensions": 16}))[0]
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), atol=ATOL)
    too_many = client.post("/v1/embeddings", json={"model": "tiny", "input": "x", "dimensions": 65})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "dimensions"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": ["a", 3]}, "input[1]"),
    ({"input": [[1, 2], "a"]}, "input[1]"),
    ({"input": [[1, 2], [3, -1]]}, "input[1]"),
    ({"input": [[1, 2], [3, 1000]]}, "input[1]"),  # the tiny vocabulary is 1,000 ids
    ({"input": [[1], [2] * 25]}, "input[1]"),  # context_length = 24
    ({"input": ["a", "b", "word " * 40]}, "input[2]"),
    ({"input": [1, 2], "encoding_format": "hex"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "extra": 1}, "extra"),
])
def test_bad_input_is_a_400_naming_the_field(served, body, param):
    client, _, _ = served
    response = client.post("/v1/embeddings", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_chat_requests_to_an_embedding_model_are_400s_naming_it(served):
    client, daemon, _ = served
    chat = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "'tiny' is an embedding model" in chat.json()["error"]["message"]
    completion = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "model"
    assert client.get("/health").status_code == 200 and daemon.engine.failure is None


def test_truncate_cuts_over_long_inputs_to_the_context(tiny_qwen3_dir, tmp_path):
    extra = 'kind = "embedding"\ncontext_length = 8\ntruncate = true'
    ids = list(range(1, 21))
    with app_client(write_config(tmp_path, tiny_qwen3_dir, model_extra=extra)) as (client, _):
        long = client.post("/v1/embeddings", json={"model": "tiny", "input": [ids]})
        cut = _vectors(client.post("/v1/embeddings", json={"model": "tiny", "input": [ids[:8]]}))
        np.testing.assert_array_equal(_vectors(long), cut)
        assert long.json()["usage"]["prompt_tokens"] == 8
        dims = client.post("/v1/embeddings", json={"model": "tiny", "input": "a", "dimensions": 8})
        assert dims.status_code == 400 and dims.json()["error"]["param"] == "dimensions"


def test_embeddings_requests_to_a_chat_model_are_400s_naming_it(tiny_model_dir, tmp_path):
    with app_client(write_config(tmp_path, tiny_model_dir)) as (client, _):
        response = client.post("/v1/embeddings", json={"model": "tiny", "input": "hello"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "model" and "'tiny' is a chat model" in error["message"]


def test_concurrent_requests_share_one_pass_and_equal_their_solo_vectors(tiny_qwen3_dir):
    from mlxd.engine.embedding import EmbeddingEngine, EmbeddingRequest
    from mlxd.engine.pooling import DecoderPool

    model, tokenizer = _load(tiny_qwen3_dir)
    engine = EmbeddingEngine(DecoderPool(model), tokenizer, name="tiny", pooling="auto", normalize=True, truncate=False,
                             context_length=64, max_waiting=16, gather_s=0.05)
    engine.start()
    try:
        async def embed_all(groups: list[list[str]]) -> list[np.ndarray]:
            requests = [EmbeddingRequest(request_id=str(i), texts=texts) for i, texts in enumerate(groups)]
            return [answer.vectors for answer in await asyncio.gather(*map(engine.embed, requests))]

        groups = [[TEXTS[i]] for i in range(5)] + [TEXTS[:3]]
        together = asyncio.run(embed_all(groups))
        assert engine.totals["num_passes"] == 1, engine.totals  # the six requests in one pass
        for group, vectors in zip(groups, together, strict=True):
            for text, vector in zip(group, vectors, strict=True):
                solo = asyncio.run(embed_all([[text]]))[0][0]
                np.testing.assert_allclose(vector, solo, atol=ATOL)
                np.testing.assert_allclose(vector, _direct(model, tokenizer.encode(text), "last"), atol=ATOL)
    finally:
        engine.stop()


# ---- BERT-family encoders through mlx-embeddings ----


@pytest.fixture(scope="module")
def tiny_bert_dir(tiny_models_root):
    from tests.support.tiny_bert import tiny_bert_cached  # mlx-embeddings: in the test extra

    return tiny_bert_cached(tiny_models_root)


def test_an_encoder_loads_through_mlx_embeddings_and_equals_its_own_pooling(tiny_bert_dir):
    from mlx_embeddings.utils import load_model

    from mlxd.config.schema import EngineConfig, ModelConfig
    from mlxd.engine.embedding import EmbeddingRequest, make_embedding_engine
    from mlxd.models.encoder import encoder_type, load_encoder

    config = ModelConfig(source=str(tiny_bert_dir), kind="embedding", name="bert")
    assert encoder_type(config) == "bert"
    assert encoder_type(ModelConfig(source=str(tiny_bert_dir))) is None  # only for kind = "embedding"
    loaded = load_encoder(config)
    assert loaded.kind == "encoder" and loaded.context_length == 64
    engine = make_embedding_engine(config, EngineConfig(gather_ms=50), loaded, "bert")
    engine.start()
    try:
        async def embed_all(groups: list[list[str]]) -> list[np.ndarray]:
            requests = [EmbeddingRequest(request_id=str(i), texts=texts) for i, texts in enumerate(groups)]
            return [answer.vectors for answer in await asyncio.gather(*map(engine.embed, requests))]

        assert engine.pooling == "mean"  # "auto" for an encoder
        together = asyncio.run(embed_all([TEXTS, TEXTS[2:4]]))
        # The oracle: mlx-embeddings' own model on each text alone (no padding), its mean-pooled, normalized output.
        reference = load_model(tiny_bert_dir)
        reference.set_dtype(mx.float32)
        for index, text in enumerate(TEXTS):
            ids = loaded.tokenizer.encode(text)
            assert ids[0] == loaded.tokenizer.convert_tokens_to_ids("[CLS]")
            expected = np.array(reference(mx.array([ids]), attention_mask=mx.ones((1, len(ids)))).text_embeds[0])
            np.testing.assert_allclose(together[0][index], expected, atol=ATOL)
        np.testing.assert_allclose(together[1], together[0][2:4], atol=ATOL)
        over = EmbeddingRequest(request_id="long", texts=["word " * 80])
        with pytest.raises(Exception, match="more than this model's 64") as refused:
            asyncio.run(engine.embed(over))
        assert refused.value.param == "input[0]"
    finally:
        engine.stop()


def test_passes_take_the_device_turn_shared_with_other_models(tiny_qwen3_dir):
    from mlxd.config.schema import EngineConfig, ModelConfig
    from mlxd.engine.embedding import EmbeddingRequest, make_embedding_engine
    from mlxd.models.load import load
    from mlxd.runtime.device_turn import DeviceTurn

    config = ModelConfig(source=str(tiny_qwen3_dir), kind="embedding")
    turn, holders = DeviceTurn(), []
    turn.on_turn = holders.append
    engine = make_embedding_engine(config, EngineConfig(gather_ms=0), load(config), "emb", turn=turn)
    engine.start()
    try:
        assert holders == ["emb"]  # the warm-up
        request = EmbeddingRequest(request_id="1", texts=["hello"])
        turn.take("chat")  # another model's step holds the device: no pass runs meanwhile
        with pytest.raises(TimeoutError):
            asyncio.run(asyncio.wait_for(engine.embed(request), 0.5))
        turn.give()
        answer = asyncio.run(asyncio.wait_for(engine.embed(request), 30))
        assert answer.vectors.shape == (1, engine.hidden_size)
        assert holders[:2] == ["emb", "chat"] and set(holders[2:]) == {"emb"}, holders
    finally:
        engine.stop()


def test_a_chat_model_and_an_embedding_model_in_one_daemon(tmp_path, tiny_model_dir, tiny_qwen3_dir):
    # The embedding model loads on its first request and answers as a one-model daemon does; each refuses the
    # other's endpoint naming itself.
    solo_dir = tmp_path / "solo"
    solo_dir.mkdir()
    with app_client(write_config(solo_dir, tiny_qwen3_dir, model_extra='kind = "embedding"')) as (client, _):
        solo = _vectors(client.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS}))
    config = tmp_path / "two.toml"
    config.write_text(f"""[models.chat]
source = "{tiny_model_dir}"
[models.chat.sampling]
temperature = 0.0
max_tokens = 8
[models.embed]
source = "{tiny_qwen3_dir}"
kind = "embedding"
[logging]
format = "json"
""")
    with app_client(config) as (client, _):
        states = {card["id"]: card["state"] for card in client.get("/v1/models").json()["data"]}
        assert states == {"chat": "ready", "embed": "unloaded"}, states
        np.testing.assert_array_equal(_vectors(client.post("/v1/embeddings", json={"model": "embed",
                                                                                   "input": TEXTS})), solo)
        chat = client.post("/v1/chat/completions", json={"model": "chat", "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        wrong = client.post("/v1/embeddings", json={"model": "chat", "input": "hi"})
        assert wrong.status_code == 400 and "'chat' is a chat model" in wrong.json()["error"]["message"]
        wrong = client.post("/v1/chat/completions", json={"model": "embed", "messages": [{"role": "user",
                                                                                          "content": "hi"}]})
        assert wrong.status_code == 400 and "'embed' is an embedding model" in wrong.json()["error"]["message"]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_long_inputs_in_chunks_equal_the_direct_computation(tiny_models_root, arch, pooling):
    # mlxd's load (on the CPU, llama's attention goes through mlxd's blocked prompt attention), inputs of 1 to 70
    # tokens left-padded into one batch and run 16 positions at a time, against the oracle on each input alone.
    from mlxd.config.schema import ModelConfig
    from mlxd.engine.pooling import DecoderPool
    from mlxd.models.load import load
    from tests.support.tiny import tiny_model_cached

    folder = tiny_model_cached(tiny_models_root, arch)
    loaded = load(ModelConfig(source=str(folder), kind="embedding"))
    rows = [list(range(3, 3 + n)) for n in (1, 5, 40, 70, 17)]
    chunked = DecoderPool(loaded.model, chunk=16)(rows, pooling, True)
    oracle, _ = _load(folder)
    np.testing.assert_allclose(chunked, np.stack([_direct(oracle, row, pooling) for row in rows]), atol=ATOL)


def test_the_openai_sdk_gets_the_float_vectors_through_its_default_base64(served):
    # The SDK asks for base64 unless told otherwise and decodes it itself: its floats equal the float answer.
    from openai import OpenAI

    client, _, _ = served
    sdk = OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    answer = sdk.embeddings.create(model="tiny", input=TEXTS[:3])
    floats = _vectors(client.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS[:3]}))
    np.testing.assert_array_equal(np.array([item.embedding for item in answer.data], dtype=np.float32), floats)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0 and answer.model == "tiny"


def test_a_bert_model_is_served_at_v1_embeddings(tiny_bert_dir, tmp_path):
    from mlx_embeddings.utils import load_model

    reference = load_model(tiny_bert_dir)
    reference.set_dtype(mx.float32)
    with app_client(write_config(tmp_path, tiny_bert_dir, model_extra='kind = "embedding"')) as (client, daemon):
        response = client.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS})
        got = _vectors(response)
        tokenizer = daemon.models.first.engine.tokenizer
        for index, text in enumerate(TEXTS):
            ids = tokenizer.encode(text)
            expected = reference(mx.array([ids]), attention_mask=mx.ones((1, len(ids)))).text_embeds[0]
            np.testing.assert_allclose(got[index], np.array(expected), atol=ATOL)
        assert response.json()["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(text)) for text in TEXTS)
        too_long = client.post("/v1/embeddings", json={"model": "tiny", "input": ["a", "word " * 70]})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input[1]"
        chat = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"


def test_embeddings_requests_are_counted_in_the_metrics(tiny_qwen3_dir, tmp_path):
    with app_client(write_config(tmp_path, tiny_qwen3_dir, model_extra='kind = "embedding"')) as (client, _):
        ids = [[5, 6, 7], [8, 9]]
        assert client.post("/v1/embeddings", json={"model": "tiny", "input": ids}).status_code == 200
        assert client.post("/v1/embeddings", json={"model": "tiny", "input": []}).status_code == 400
        text = client.get("/metrics").text
    assert 'mlxd_requests_total{endpoint="embeddings",outcome="ok"} 1.0' in text, text
    assert 'mlxd_requests_total{endpoint="embeddings",outcome="error_400"} 1.0' in text, text
    assert "mlxd_prompt_tokens_total 5.0" in text, text


def test_an_idle_embedding_model_is_unloaded_and_its_memory_given_back(tmp_path, tiny_model_dir, tiny_qwen3_dir):
    import time
    import weakref

    config = tmp_path / "two.toml"
    config.write_text(f"""[models.chat]
source = "{tiny_model_dir}"
[models.embed]
source = "{tiny_qwen3_dir}"
kind = "embedding"
idle_unload_s = 1
[logging]
format = "json"
""")
    with app_client(config) as (client, daemon):
        first = _vectors(client.post("/v1/embeddings", json={"model": "embed", "input": TEXTS}))
        slot = daemon.models.resolve("embed")
        weights, engine = slot.weight_bytes, weakref.ref(slot.engine)
        loaded = mx.get_active_memory()
        deadline = time.monotonic() + 15
        while slot.state != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert slot.state == "unloaded"
        time.sleep(0.2)  # the engine thread is joined and the memory freed after the state turns
        assert engine() is None  # nothing keeps the engine (and its model) alive
        assert loaded - mx.get_active_memory() >= weights > 100_000
        again = _vectors(client.post("/v1/embeddings", json={"model": "embed", "input": TEXTS}))
        np.testing.assert_array_equal(again, first)


class _BrittleTokenizer:
    """The real tokenizer, except that it raises on one text (as a tokenizer can on input it cannot take)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        if text == "boom":
            raise ValueError("cannot tokenize")
        return self.tokenizer.encode(text)


def test_a_request_that_fails_fails_alone_and_the_engine_goes_on(tiny_qwen3_dir):
    from mlxd.engine.embedding import EmbeddingEngine, EmbeddingRequest
    from mlxd.engine.pooling import DecoderPool
    from mlxd.errors import EngineError

    model, tokenizer = _load(tiny_qwen3_dir)
    engine = EmbeddingEngine(DecoderPool(model), _BrittleTokenizer(tokenizer), name="tiny", pooling="auto",
                             normalize=True, truncate=False, context_length=64, max_waiting=16, gather_s=0.05)
    engine.start()
    try:
        async def both() -> list:
            requests = [EmbeddingRequest(request_id="bad", texts=["a", "boom"]),
                        EmbeddingRequest(request_id="good", texts=[TEXTS[0]])]
            return await asyncio.gather(*map(engine.embed, requests), return_exceptions=True)

        bad, good = asyncio.run(both())
        assert isinstance(bad, EngineError) and bad.status == 500, bad
        np.testing.assert_allclose(good.vectors[0], _direct(model, tokenizer.encode(TEXTS[0]), "last"), atol=ATOL)
        assert engine.failure is None and engine.totals["num_failed"] == 1 and engine.num_active == 0
        again = asyncio.run(engine.embed(EmbeddingRequest(request_id="again", texts=[TEXTS[0]])))
        np.testing.assert_array_equal(again.vectors, good.vectors)
    finally:
        engine.stop()
