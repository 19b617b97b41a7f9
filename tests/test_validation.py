"""The API boundary: ranges, strict decoding, malformed bodies, safe error messages, Retry-After.

In-process on a tiny model. Every refusal must be a 4xx in the OpenAI error shape naming the field, with nothing
internal in it; valid boundary values must be served; and the daemon must answer a greedy request afterwards
exactly as it did before.
"""

from __future__ import annotations

import pytest

from mlxd.errors import NotReady, Overloaded, RequestError
from tests.helpers import ROOT, app_client, write_config

MESSAGES = [{"role": "user", "content": "Tell me about cats."}]
GREEDY = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 12}
FORBIDDEN_IN_ERRORS = ("Traceback", "Error(", str(ROOT))


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("validation"), tiny_model_dir, model_extra="context_length = 256")
    with app_client(config) as (client, daemon):
        greedy = client.post("/v1/chat/completions", json=GREEDY)
        assert greedy.status_code == 200, greedy.text
        yield client, daemon, greedy.json()["choices"]


@pytest.fixture(scope="module")
def vocab(served):
    vocab_size = served[1].model_info.vocab_size
    assert vocab_size > 0
    return vocab_size


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={**GREEDY, **fields})


def post_raw(client, body: bytes, content_type: str | None = "application/json", path="/v1/chat/completions"):
    headers = {"content-type": content_type} if content_type else {}
    return client.post(path, content=body, headers=headers)


def assert_error(response, status: int, param: str | None = None) -> dict:
    """The response is ``status`` in the OpenAI error shape, naming ``param``, with nothing internal in it."""
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] == param, error
    for word in FORBIDDEN_IN_ERRORS:
        assert word not in response.text, response.text[:500]
    return error


# ---- ranges ----

OUT_OF_RANGE = [
    ("temperature", -0.01), ("temperature", 2.01), ("temperature", -1e300),
    ("top_p", 0), ("top_p", -0.5), ("top_p", 1.0001),
    ("presence_penalty", -2.01), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("frequency_penalty", 2.0001),
    ("min_p", -0.001), ("min_p", 1.5),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0),
    ("top_k", -1),
    ("seed", -1), ("seed", 2**63), ("seed", 10**30),
    ("max_tokens", 0), ("max_tokens", -3),
    ("max_completion_tokens", 0),
    ("logit_bias", {"5": 100.01}), ("logit_bias", {"5": -101}),
]


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE, ids=[f"{f}={v}" for f, v in OUT_OF_RANGE])
def test_out_of_range_is_400_naming_the_field(served, field, value):
    assert_error(chat(served[0], **{field: value}), 400, field)


def test_top_k_must_be_below_the_vocabulary(served, vocab):
    error = assert_error(chat(served[0], top_k=vocab), 400, "top_k")
    assert str(vocab) in error["message"]
    assert_error(chat(served[0], top_k=vocab * 1000), 400, "top_k")


@pytest.mark.parametrize("key", ["1e400", "-1", "99999999999999999999999", " 5", "5 ", "05", "1.0", "0x5", "", "five",
                                 "+5", "5\n"])
def test_logit_bias_keys_must_be_decimal_token_ids(served, key):
    assert_error(chat(served[0], logit_bias={key: 1.0}), 400, "logit_bias")


def test_logit_bias_keys_must_be_below_the_vocabulary(served, vocab):
    assert_error(chat(served[0], logit_bias={str(vocab): 1.0}), 400, "logit_bias")
    assert_error(chat(served[0], logit_bias={"3": 1.0, "9999999999": 1.0}), 400, "logit_bias")


@pytest.mark.parametrize("prompt", [[-1], [1, 2, -5], "vocab", "vocab+", [10**30]])
def test_prompt_token_ids_must_be_in_the_vocabulary(served, vocab, prompt):
    if prompt == "vocab":
        prompt = [1, vocab]
    elif prompt == "vocab+":
        prompt = [vocab * 7]
    response = served[0].post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert_error(response, 400, "prompt")


# ---- strict decoding ----

STRING_NUMBERS = [("temperature", "NaN"), ("temperature", "Infinity"), ("temperature", "-Infinity"),
                  ("temperature", "0.5"), ("top_p", "1"), ("top_k", "5"), ("seed", "5"), ("max_tokens", "10"),
                  ("min_p", "nan"), ("presence_penalty", "inf"), ("logit_bias", {"5": "NaN"}),
                  ("max_tokens", 10.0), ("seed", 1.5), ("top_k", True)]


@pytest.mark.parametrize(("field", "value"), STRING_NUMBERS, ids=[f"{f}={v!r}" for f, v in STRING_NUMBERS])
def test_numbers_are_decoded_strictly(served, field, value):
    assert_error(chat(served[0], **{field: value}), 400, field)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e999"])
def test_non_finite_numbers_are_refused(served, literal):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": ' + literal + b"}"
    error = assert_error(post_raw(served[0], body), 400, "temperature" if literal[-1:].isdigit() else None)
    assert "malformed" in error["message"] or "range" in error["message"]


# ---- malformed bodies ----

MALFORMED = {
    "deep array": b"[" * 5000,
    "deep array closed": b"[" * 5000 + b"]" * 5000,
    "deep object in an open field": b'{"model": "tiny", "messages": [], "metadata": {"a": '
                                    + b'{"a": ' * 5000 + b"1" + b"}" * 5001 + b"}",
    "deep list in tool parameters": b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": '
                                    b'[{"type": "function", "function": {"name": "f", "parameters": {"p": '
                                    + b"[" * 5000 + b"]" * 5000 + b"}}}]}",
    "invalid utf-8 in a value": b'{"model": "tiny\xff\xfe", "messages": []}',
    "invalid utf-8 in a key": b'{"model": "tiny", "messages": [], "metadata": {"\xc3\x28": 1}}',
    "surrogate bytes": b'{"model": "tiny", "messages": [], "x\xed\xa0\x80": 1}',
    "truncated": b'{"model": "tiny", "messages": [{"role": "us',
    "trailing garbage": b'{"model": "tiny", "messages": []} {}',
    "byte order mark": b'\xef\xbb\xbf{"model": "tiny", "messages": []}',
    "array": b"[]",
    "string": b'"hello"',
    "number": b"42",
    "null": b"null",
    "empty": b"",
    "whitespace": b"  \n ",
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_bodies_are_400(served, body, path):
    response = post_raw(served[0], body, path=path)
    assert response.status_code == 400, response.text[:500]
    assert_error(response, 400, response.json()["error"]["param"])


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data",
                                          "application/xml", "text/json"])
def test_wrong_content_type_is_415(served, content_type):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    error = assert_error(post_raw(served[0], body, content_type), 415)
    assert "application/json" in error["message"]


def test_a_body_without_content_type_is_415(served):
    # A web page may send it to any origin without a CORS preflight (mlxd.api.origins).
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    error = assert_error(post_raw(served[0], body, None), 415)
    assert "Content-Type: application/json" in error["message"]


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "APPLICATION/JSON"])
def test_json_with_a_parametrised_content_type_is_served(served, content_type):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    response = post_raw(served[0], body, content_type)
    assert response.status_code == 200, response.text


# ---- what error messages may say ----

def test_a_huge_model_name_is_not_echoed(served):
    response = chat(served[0], model="m" * 10_000_000)
    error = assert_error(response, 404, "model")
    assert len(response.content) < 1000
    assert "m" * 64 + "…" in error["message"] and "m" * 65 not in error["message"]
    response = served[0].get("/v1/models/" + "q" * 20_000)
    assert_error(response, 404, "model")
    assert len(response.content) < 1000


@pytest.mark.parametrize("fields", [{"z" * 1_000_000: 1},
                                    {"messages": [{"role": "r" * 1_000_000, "content": "x"}]},
                                    {"tool_choice": "t" * 1_000_000},
                                    {"stream_options": {"k" * 1_000_000: True}}])
def test_huge_client_values_are_clipped_in_errors(served, fields):
    response = chat(served[0], **fields)
    error = assert_error(response, 400, response.json()["error"]["param"])
    assert len(response.content) < 1000, response.text[:300]
    assert error["param"] and len(error["param"]) <= 65
    assert "…" in error["message"], error["message"]


def test_a_clipped_value_keeps_the_rest_of_the_message(served):
    error = assert_error(chat(served[0], tool_choice="t" * 100_000), 400, "tool_choice")
    assert error["message"] == ("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                                f"'function': {{'name': ...}}}}, got '{'t' * 64}…'")


def test_unexpected_errors_are_generic_and_name_the_request(served, monkeypatch):
    client, daemon, _ = served
    secret = f"{ROOT}/mlxd/secret.py: line 3"

    def explode(job):
        raise ZeroDivisionError(secret)

    monkeypatch.setattr(type(daemon.pipeline), "prepare", lambda self, job: explode(job))
    response = chat(client)
    error = assert_error(response, 500)
    assert "ZeroDivisionError" not in response.text and "secret" not in response.text
    assert "chatcmpl-" in error["message"]  # the request id, to find the details in the log


def test_paths_in_error_messages_are_redacted(served, monkeypatch):
    client, daemon, _ = served

    def refuse(self, job):
        raise RequestError(f"cannot read {ROOT}/models/x.gguf or ~/private/y.json or C:\\Users\\me\\z", param="x")

    monkeypatch.setattr(type(daemon.pipeline), "prepare", refuse)
    error = assert_error(chat(client), 400, "x")
    assert error["message"] == "cannot read <path> or <path> or <path>"


@pytest.mark.parametrize(("exc", "status", "retry_after"), [
    (Overloaded("queue full"), 429, "1"),
    (Overloaded("queue full", retry_after=12.2), 429, "13"),
    (Overloaded("queue full", retry_after=0.01), 429, "1"),
    (NotReady("draining"), 503, "5"),
    (NotReady("draining", retry_after=30), 503, "30"),
    (RequestError("no"), 400, None),
])
def test_retry_after_follows_the_error(served, monkeypatch, exc, status, retry_after):
    client, daemon, _ = served

    def refuse(self, job):
        raise exc

    monkeypatch.setattr(type(daemon.pipeline), "prepare", refuse)
    response = chat(client)
    assert_error(response, status)
    assert response.headers.get("retry-after") == retry_after


def test_no_request_id_before_one_is_given(served, monkeypatch):
    # An error before the request has an id names none (and not the id of an earlier request).
    client, daemon, _ = served
    async def broken(self, model):
        return 1 / 0

    monkeypatch.setattr(type(daemon.models), "admit", broken)  # finding the model: before the request has an id
    error = assert_error(chat(client), 500)
    assert "chatcmpl-" not in error["message"]


# ---- valid boundary values are served ----

BOUNDARIES = [  # (fields, as a function of the vocabulary size)
    lambda v: {"temperature": 2, "seed": 2**63 - 1}, lambda v: {"temperature": 0}, lambda v: {"top_p": 1},
    lambda v: {"top_p": 1e-9}, lambda v: {"top_k": v - 1}, lambda v: {"top_k": 0}, lambda v: {"min_p": 0},
    lambda v: {"min_p": 1}, lambda v: {"seed": 0}, lambda v: {"presence_penalty": -2, "frequency_penalty": 2},
    lambda v: {"presence_penalty": 2, "frequency_penalty": -2}, lambda v: {"repetition_penalty": 1e-6},
    lambda v: {"logit_bias": {str(v - 1): 100}}, lambda v: {"logit_bias": {str(v - 1): -100, "0": 100}},
    lambda v: {"max_tokens": 1}, lambda v: {"max_completion_tokens": 1},
    lambda v: {"temperature": 1.5, "top_k": 1, "top_p": 0.5, "min_p": 0.2},
]


@pytest.mark.parametrize("fields", BOUNDARIES)
def test_boundary_values_are_served(served, vocab, fields):
    response = chat(served[0], **fields(vocab))
    assert response.status_code == 200, (fields(vocab), response.text)
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("escaped", [rb"\ud800", rb"a\udfffb", rb"\u0000", rb"\udbff\udfff", rb"\ufeff"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_odd_but_valid_strings_are_not_server_errors(served, escaped, path):
    # JSON may spell lone surrogates; Python holds them, tokenizers may not.
    text = b'"' + escaped + b'"'
    field = b'"messages": [{"role": "user", "content": ' + text + b"}]" if "chat" in path else b'"prompt": ' + text
    body = b'{"model": "tiny", "max_tokens": 2, "stop": [' + text + b"], " + field + b"}"
    response = post_raw(served[0], body, path=path)
    assert response.status_code < 500, response.text[:300]
    if response.status_code != 200:
        assert_error(response, response.status_code, response.json()["error"]["param"])


def test_prompt_ids_at_the_vocabulary_edges_are_served(served, vocab):
    response = served[0].post("/v1/completions", json={"model": "tiny", "prompt": [0, vocab - 1], "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_the_openapi_document_carries_the_ranges(served):
    schema = served[0].get("/docs/openapi.json").json()
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        request = schema["components"]["schemas"][name]
        fields = request["properties"]
        assert request["additionalProperties"] is False
        assert (fields["temperature"]["minimum"], fields["temperature"]["maximum"]) == (0, 2)
        assert (fields["top_p"]["exclusiveMinimum"], fields["top_p"]["maximum"]) == (0, 1)
        assert (fields["min_p"]["minimum"], fields["min_p"]["maximum"]) == (0, 1)
        assert fields["top_k"]["minimum"] == 0 and fields["repetition_penalty"]["exclusiveMinimum"] == 0
        assert (fields["presence_penalty"]["minimum"], fields["presence_penalty"]["maximum"]) == (-2, 2)
        assert (fields["seed"]["minimum"], fields["seed"]["maximum"]) == (0, 2**63 - 1)
        assert fields["max_tokens"]["minimum"] == 1
    assert schema["components"]["schemas"]["StreamOptions"]["additionalProperties"] is False


def test_oversized_body_is_still_413(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir)
    config.write_text(config.read_text().replace("keepalive_s = 0.5", "keepalive_s = 0.5\nmax_body_bytes = 2000"))
    with app_client(config) as (client, _):
        assert_error(chat(client, messages=[{"role": "user", "content": "x" * 5000}]), 413)


def test_building_the_app_builds_every_endpoint_body_decoder(tiny_model_dir, tmp_path):
    """Not the first request of each endpoint: it would pay several ms on the event loop, and every request beside
    it would wait."""
    from mlxd.api import anthropic_schemas, body, embeddings, responses_schemas, schemas
    from mlxd.api.app import create_app
    from mlxd.cli import load_everything
    from mlxd.daemon import Daemon

    body._decoder.cache_clear()
    config, pipeline = load_everything(write_config(tmp_path, tiny_model_dir))
    create_app(Daemon(config, pipeline, base_dir=tmp_path), load=False)
    built = body._decoder.cache_info().currsize
    for type_ in (schemas.ChatCompletionRequest, schemas.CompletionRequest, anthropic_schemas.MessagesRequest,
                  anthropic_schemas.CountTokensRequest, responses_schemas.ResponsesRequest,
                  embeddings.EmbeddingsRequest):
        body._decoder(type_)
    assert body._decoder.cache_info().currsize == built == 6


def test_the_daemon_is_alive_and_unpoisoned_afterwards(served):
    client, _, before = served
    assert client.get("/health").status_code == 200
    response = client.post("/v1/chat/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    assert response.json()["choices"] == before
