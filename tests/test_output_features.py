"""Output features through the real ``openai`` SDK against a daemon on loopback: logprobs (chat and completions,
streaming and not) equal a direct log-softmax of the model's logits; ``n`` choices with usage that adds up;
seeded requests repeat; ``echo``; a stop sequence finishes as ``stop`` (named in the log) and is not counted as a
cancellation; features the server cannot honour are 400s that name the field."""

from __future__ import annotations

import json

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from tests.helpers import free_port, serve_subprocess, write_config

NO_EOS = {"0": -100, "2": -100}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("features")
    port = free_port()
    config = write_config(tmp, tiny_model_dir, port=port, extra="[engine]\nmax_n = 4\n")
    with serve_subprocess(config, port) as (base, _):
        yield base, tmp


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load(str(tiny_model_dir))


def raw_logprobs(model, prompt: list[int], tokens: list[int]) -> list[mx.array]:
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    rows = []
    for token in tokens:
        rows.append(logits - mx.logsumexp(logits))
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return rows


def test_completion_logprobs_equal_the_model_s_log_softmax(client, reference):
    model, tokenizer = reference
    prompt = "Once upon a time"
    result = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, logprobs=3, temperature=0,
                                       logit_bias=NO_EOS)
    choice = result.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    tokens = [tokenizer.encode(t, add_special_tokens=False) for t in lp.tokens]
    assert all(len(t) == 1 for t in tokens)
    rows = raw_logprobs(model, tokenizer.encode(prompt), [t[0] for t in tokens])
    for token, logprob, top, row in zip(tokens, lp.token_logprobs, lp.top_logprobs, rows, strict=True):
        assert logprob == pytest.approx(row[token[0]].item(), abs=2e-3)
        assert len(top) == 3 and max(top.values()) == pytest.approx(row.max().item(), abs=2e-3)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_logprobs_streamed_equal_non_streamed(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, logprobs=True,
                  top_logprobs=2, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    entries = whole.logprobs.content
    assert "".join(e.token for e in entries) == whole.message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]


def test_n_choices_with_usage_that_adds_up(client):
    result = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, n=3, temperature=1.0, seed=7,
                                       logit_bias=NO_EOS)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert result.usage.completion_tokens == 18
    assert len({c.text for c in result.choices}) > 1  # each choice samples with its own key
    again = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, n=3, temperature=1.0, seed=7,
                                      logit_bias=NO_EOS)
    assert [c.text for c in again.choices] == [c.text for c in result.choices]
    single = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=1.0, seed=7,
                                       logit_bias=NO_EOS)
    assert single.choices[0].text == result.choices[0].text  # choice 0 keeps the seed itself


def test_streamed_n_choices_arrive_under_their_index(client):
    texts = {0: "", 1: ""}
    finishes = {}
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                            max_tokens=5, temperature=1.0, seed=3, stream=True,
                                            stream_options={"include_usage": True}, logit_bias=NO_EOS)
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 10 and all(texts.values())


def test_n_beyond_max_n_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=4, n=5)
    assert e.value.body["param"] == "n" and "max_n = 4" in e.value.body["message"]


def test_echo_returns_the_prompt_before_the_completion(client):
    result = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, echo=True, temperature=0)
    plain = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0)
    assert result.choices[0].text == "Once upon" + plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, echo=True, logprobs=1)
    assert e.value.body["param"] == "echo"


def test_a_stop_sequence_finishes_as_stop_and_is_not_a_cancellation(server, client):
    base, tmp = server
    plain = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                                      logit_bias=NO_EOS).choices[0].text
    stop = plain[3:6]
    before = httpx.get(base + "/v1/status").json()["totals"]
    result = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                                       stop=[stop], logit_bias=NO_EOS)
    assert result.choices[0].finish_reason == "stop" and result.choices[0].text == plain[: plain.index(stop)]
    after = httpx.get(base + "/v1/status").json()["totals"]
    assert after["num_cancelled"] == before["num_cancelled"]


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {}}}],
      "tool_choice": {"type": "function", "function": {"name": "b"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_requests_the_server_cannot_honour_are_400s_naming_the_field(server, body, param):
    base, _ = server
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body}
    response = httpx.post(base + "/v1/chat/completions", json=payload, timeout=30)
    assert response.status_code == 400, response.text
    error = json.loads(response.text)["error"]
    assert error["param"] == param or param in error["message"]


def test_a_schema_feature_the_grammar_engine_cannot_enforce_is_a_400_naming_it(server):
    base, _ = server
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "not": {"required": ["a"]}}
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    response = httpx.post(base + "/v1/chat/completions", json=payload, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" and '"not"' in error["message"]
