"""Property-based fuzzing of every endpoint in the served OpenAPI document (schemathesis, fixed seed).

Cases valid and invalid against the schema go to the in-process app through Litestar's test client. Oracles: no
5xx at all, every 4xx in the OpenAI error shape with nothing internal in it, the daemon healthy afterwards, and a
fixed greedy request answered exactly as before the fuzzing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.helpers import ROOT, app_client, write_config

# Per operation and generation mode (operations without parameters have one case and no invalid ones).
EXAMPLES = 250
GREEDY = {"model": "tiny", "messages": [{"role": "user", "content": "Count to five."}], "temperature": 0,
          "max_tokens": 16}
FORBIDDEN_IN_ERRORS = ("Traceback", "Error(", str(ROOT))


@dataclass
class Tally:
    """What the fuzzing sent and saw, reported in assertion messages and with ``-s``."""

    num_requests: int = 0
    num_unsendable: int = 0
    # (operation, mode) pairs the schema leaves nothing to generate for, e.g. invalid data for GET /health.
    nothing_to_generate: list[str] = field(default_factory=list)
    by_status: dict[int, int] = field(default_factory=dict)
    by_operation: dict[str, int] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)
    bad_error_bodies: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.num_requests} requests fuzzed, {len(self.server_errors)} 5xx, "
                f"{len(self.bad_error_bodies)} malformed error bodies, {self.num_unsendable} unsendable; "
                f"statuses {dict(sorted(self.by_status.items()))}")


def _httpx_kwargs(case: schemathesis.Case, served_model: bool) -> dict[str, Any]:
    """The case as arguments of ``client.request``; with ``served_model``, a body's ``model`` names the served
    model, so that the case gets past the model lookup to the checks and the engine behind it."""
    kwargs = case.as_transport_kwargs(base_url="http://testserver.local")
    if isinstance(kwargs.get("data"), bytes | str):
        kwargs["content"] = kwargs.pop("data")
    if served_model and isinstance(kwargs.get("json"), dict) and "model" in kwargs["json"]:
        kwargs["json"] = {**kwargs["json"], "model": "tiny"}
    return {key: kwargs[key] for key in ("method", "url", "headers", "params", "json", "content")
            if kwargs.get(key) is not None}


def error_shape_problem(response: httpx.Response) -> str | None:
    """Why a 4xx body is not the route's error shape with nothing internal, or None: OpenAI's
    ``{"error": {"message", "type", "param", "code"}}``, or on the Anthropic routes (``/v1/messages…``)
    ``{"type": "error", "error": {"type", "message"}}``."""
    try:
        body = response.json()
    except ValueError:
        return f"not JSON: {response.text[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    anthropic = response.request.url.path.startswith("/v1/messages")
    keys, fields = ({"type", "error"}, {"type", "message"}) if anthropic else ({"error"}, {"message", "type", "param",
                                                                                           "code"})
    if not isinstance(error, dict) or set(body) != keys or set(error) != fields:
        return f"not the error shape: {response.text[:200]}"
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return f"message and type must be strings: {response.text[:200]}"
    leaked = [word for word in FORBIDDEN_IN_ERRORS if word in response.text]
    return f"leaks {leaked}: {response.text[:200]}" if leaked else None


def _fuzz(client: Any, operation: Any, mode: GenerationMode, tally: Tally) -> None:
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), served_model=st.sampled_from([True, True, True, False]))
    def run(case: schemathesis.Case, served_model: bool) -> None:
        kwargs = _httpx_kwargs(case, served_model)
        try:
            request = client.build_request(**kwargs)
        except (httpx.InvalidURL, UnicodeEncodeError, ValueError, TypeError):
            tally.num_unsendable += 1  # the client refuses to build it (e.g. a control character in a header)
            return
        tally.num_requests += 1
        label = f"{operation.label} ({mode})"
        tally.by_operation[label] = tally.by_operation.get(label, 0) + 1
        where = f"{case.method} {case.formatted_path} ({mode})"
        try:
            response = client.send(request)
        except Exception as e:  # noqa: BLE001 - the app raised past its error handlers: counted as a 5xx
            tally.server_errors.append(f"{where}: raised {e!r:.300}\n    client.request(**{kwargs!r:.2000})")
            return
        tally.by_status[response.status_code] = tally.by_status.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            tally.server_errors.append(f"{where}: {response.status_code} {response.text[:300]}\n"
                                       f"    client.request(**{kwargs!r:.2000})")
        elif response.status_code >= 400 and (problem := error_shape_problem(response)):
            tally.bad_error_bodies.append(f"{where}: {problem}")

    try:
        run()
    except Unsatisfiable:
        tally.nothing_to_generate.append(f"{operation.label} ({mode})")


def test_fuzz_every_endpoint_from_the_served_schema(tiny_model_dir, tmp_path):
    # A small context bounds any max_tokens the fuzzer asks for; the default completion stays short.
    config = write_config(tmp_path, tiny_model_dir, model_extra="context_length = 256")
    with app_client(config) as (client, _):
        before = client.post("/v1/chat/completions", json=GREEDY)
        assert before.status_code == 200, before.text
        schema = schemathesis.openapi.from_dict(client.get("/docs/openapi.json").json())
        operations = [result.ok() for result in schema.get_all_operations()]
        labels = {op.label for op in operations}
        assert {"POST /v1/chat/completions", "POST /v1/completions", "DELETE /v1/cache"} <= labels, labels
        tally = Tally()
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _fuzz(client, operation, mode, tally)
        print(f"\nfuzz: {len(operations)} operations: {tally.summary()}; "
              f"nothing to generate for {tally.nothing_to_generate}; per operation {tally.by_operation}")
        assert not {"POST /v1/chat/completions", "POST /v1/completions"} & {
            entry.split(" (")[0] for entry in tally.nothing_to_generate}, tally.nothing_to_generate
        assert not tally.server_errors, tally.summary() + "\n" + "\n".join(tally.server_errors[:10])
        assert not tally.bad_error_bodies, tally.summary() + "\n" + "\n".join(tally.bad_error_bodies[:10])
        for label in ("POST /v1/chat/completions", "POST /v1/completions"):
            for mode in GenerationMode:
                assert tally.by_operation.get(f"{label} ({mode})", 0) == EXAMPLES, tally.by_operation
        assert client.get("/health").status_code == 200, tally.summary()
        after = client.post("/v1/chat/completions", json=GREEDY)
        assert after.status_code == 200, after.text
        assert after.json()["choices"] == before.json()["choices"], tally.summary()


def test_fuzz_embeddings_on_an_embedding_model(tiny_qwen3_dir, tmp_path):
    # POST /v1/embeddings served by a kind = "embedding" model (the test above reaches it only with a chat model).
    config = write_config(tmp_path, tiny_qwen3_dir, model_extra='kind = "embedding"\ncontext_length = 64')
    with app_client(config) as (client, _):
        before = client.post("/v1/embeddings", json={"model": "tiny", "input": ["hello", "world"]})
        assert before.status_code == 200, before.text
        schema = schemathesis.openapi.from_dict(client.get("/docs/openapi.json").json())
        operation = next(result.ok() for result in schema.get_all_operations()
                         if result.ok().label == "POST /v1/embeddings")
        tally = Tally()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(client, operation, mode, tally)
        print(f"\nfuzz embeddings: {tally.summary()}; per operation {tally.by_operation}")
        assert not tally.server_errors, tally.summary() + "\n" + "\n".join(tally.server_errors[:10])
        assert not tally.bad_error_bodies, tally.summary() + "\n" + "\n".join(tally.bad_error_bodies[:10])
        assert tally.by_status.get(200, 0) > 0, tally.summary()  # the fuzzer got past the checks, not only 400s
        for mode in GenerationMode:
            assert tally.by_operation.get(f"POST /v1/embeddings ({mode})", 0) == EXAMPLES, tally.by_operation
        after = client.post("/v1/embeddings", json={"model": "tiny", "input": ["hello", "world"]})
        assert after.json()["data"] == before.json()["data"], tally.summary()


# ---- oversized fields other than the user's text, on every surface ----

def _oversized_bodies(text: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """One body per (surface, field) with ``text`` in a field that is not a user message's text."""
    hi = {"role": "user", "content": "hi"}
    tool_turn = [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"q": text}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]
    anthropic = {
        "system": {"system": text, "messages": [hi]},
        "system blocks": {"system": [{"type": "text", "text": "a"}, {"type": "text", "text": text}], "messages": [hi]},
        "assistant text": {"messages": [hi, {"role": "assistant", "content": text}, hi]},
        "thinking": {"messages": [hi, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": text, "signature": ""}, {"type": "text", "text": "ok"}]}, hi]},
        "tool_use input": {"messages": [hi, *tool_turn]},
        "tool_result": {"messages": [hi, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": text}]}]}]},
        "tool description": {"messages": [hi], "tools": [{"name": "f", "description": text,
                                                          "input_schema": {"type": "object"}}]},
        "tool schema": {"messages": [hi], "tools": [{"name": "f", "input_schema": {
            "type": "object", "properties": {"p": {"type": "string", "description": text}}}}]},
    }
    responses = {
        "instructions": {"instructions": text, "input": "hi"},
        "developer item": {"input": [{"role": "developer", "content": text}, {"role": "user", "content": "hi"}]},
        "assistant item": {"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
            {"type": "output_text", "text": text}]}, {"role": "user", "content": "go"}]},
        "function_call arguments": {"input": [{"role": "user", "content": "hi"}, {
            "type": "function_call", "call_id": "c1", "name": "f", "arguments": json.dumps({"q": text})},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
        "function_call_output": {"input": [{"role": "user", "content": "hi"}, {
            "type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": text}]},
        "tool parameters": {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {
            "type": "object", "properties": {"p": {"type": "string", "description": text}}}}]},
    }
    bodies = {}
    for name, fields in anthropic.items():
        bodies[f"messages: {name}"] = ("/v1/messages", {"model": "tiny", "max_tokens": 4, **fields})
        bodies[f"count_tokens: {name}"] = ("/v1/messages/count_tokens", {"model": "tiny", **fields})
    for name, fields in responses.items():
        bodies[f"responses: {name}"] = ("/v1/responses", {"model": "tiny", "max_output_tokens": 16, **fields})
    chat_tool = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"q": text})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    bodies["chat: assistant"] = ("/v1/chat/completions", {"model": "tiny", "messages": [
        hi, {"role": "assistant", "content": text}, hi]})
    bodies["chat: tool_calls arguments"] = ("/v1/chat/completions", {"model": "tiny", "messages": [hi, *chat_tool]})
    bodies["chat: tool description"] = ("/v1/chat/completions", {"model": "tiny", "messages": [hi], "tools": [
        {"type": "function", "function": {"name": "f", "description": text, "parameters": {"type": "object"}}}]})
    return bodies


def _too_long(response: httpx.Response) -> bool:
    error = response.json()["error"]
    if response.request.url.path.startswith("/v1/messages"):
        return error["type"] == "invalid_request_error" and error["message"].startswith("prompt is too long")
    return error["type"] == "context_length_exceeded"


def test_oversized_non_user_fields_are_refused_before_rendering(tiny_model_dir, tmp_path):
    """Every surface, every field a prompt is rendered from: more text than the context can hold is a 400 in the
    surface's shape, before the template or the tokenizer sees it, whatever the field and the characters; the same
    bodies with a short text are served."""
    config = write_config(tmp_path, tiny_model_dir, model_extra="context_length = 256")
    with app_client(config) as (client, daemon):
        spy = _spy_on_template(daemon)
        limit = daemon.max_prompt_bytes
        assert 0 < limit < 200_000
        names = sorted(_oversized_bodies(""))
        for name in names:
            path, body = _oversized_bodies("short text")[name]
            served = client.post(path, json=body)
            assert served.status_code == 200, (name, served.text[:300])
        spy.clear()
        slowest = 0.0

        @settings(max_examples=3 * len(names), derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(name=st.sampled_from(names), char=st.sampled_from(["a", " ", "é", "語", "🙂", "\n"]),
               factor=st.floats(1.01, 3.0))
        def refused(name: str, char: str, factor: float) -> None:
            nonlocal slowest
            text = char * int(limit * factor / len(char.encode()) + 1)
            path, body = _oversized_bodies(text)[name]
            started = time.monotonic()
            response = client.post(path, json=body)
            slowest = max(slowest, time.monotonic() - started)
            assert response.status_code == 400, (name, response.text[:300])
            assert error_shape_problem(response) is None and _too_long(response), (name, response.text[:300])

        refused()
        assert all(size < limit for size in spy), f"rendered or tokenized a text of {max(spy)} characters"
        print(f"\noversized fields: {3 * len(names)} bodies refused, the slowest in {slowest * 1000:.0f} ms")
        many = client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": [
            {"role": "user", "content": ""}] * (daemon.config.server.max_messages + 1)})
        assert many.status_code == 400 and "max_messages" in many.json()["error"]["message"], many.text[:300]
        assert client.post("/v1/chat/completions", json=GREEDY).status_code == 200


def _spy_on_template(daemon: Any) -> list[int]:
    """Record the length of every text the template stage's tokenizer renders or encodes."""
    stage = next(stage for name, stage in daemon.pipeline.stages if name == "template")
    sizes: list[int] = []
    tokenizer = stage.tokenizer

    class Spy:
        def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
            sizes.append(len(text))
            return tokenizer.encode(text, *args, **kwargs)

        def apply_chat_template(self, messages: list[dict], *args: Any, **kwargs: Any) -> Any:
            sizes.append(len(json.dumps([messages, kwargs.get("tools")], default=str)))
            return tokenizer.apply_chat_template(messages, *args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer, name)

    stage.tokenizer = Spy()
    return sizes
