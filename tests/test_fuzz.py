"""Property-based fuzzing of every endpoint in the served OpenAPI document (schemathesis, fixed seed).

Cases valid and invalid against the schema go to the in-process app through Litestar's test client. Oracles: no
5xx at all, every 4xx in the OpenAI error shape with nothing internal in it, the daemon healthy afterwards, and a
fixed greedy request answered exactly as before the fuzzing.
"""

from __future__ import annotations

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
