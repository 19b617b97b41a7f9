"""One call when one call is asked for: a named ``tool_choice`` (whatever ``parallel_tool_calls`` says) and
``tool_choice: "required"`` with ``parallel_tool_calls: false``, streamed and not; and the fallback that recovers a
Hermes call from Qwen3-Coder output, end to end.

The app runs in-process on the tiny model with a scripted model double (``tests.scripted_server``) that tries to
write two calls of ``get_weather``, each exactly as the forced-call grammar writes one. Before the fix a named
choice let the grammar go on to the second call and the response held two calls (``{"city": "Paris"}`` twice);
the oracle is one call with the arguments of the first. Unforced requests with parallel calls allowed keep both
(the control); with ``parallel_tool_calls: false`` the second is dropped by ``parse``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from mlx_lm.tokenizer_utils import load as load_tokenizer
from structlog.testing import capture_logs

from mlxd.api.app import create_app
from mlxd.cli import load_everything
from mlxd.daemon import Daemon
from mlxd.engine.factory import make_engine
from tests.helpers import sse_events, write_config
from tests.scripted_server import ScriptedModel
from tests.support.tool_templates import QWEN3_CODER_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL + "\n" + CALL
USER = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def scripted_client(model_dir: Path, tmp: Path, script_text: str, model_extra: str = "") -> Any:
    script = tmp / "script.txt"
    script.write_text(script_text)
    config_path = write_config(tmp, model_dir, model_extra=model_extra,
                               extra="[engine]\nprefix_cache_bytes = 0\nmax_running = 1\n")
    config, pipeline = load_everything(config_path)
    tokenizer = load_tokenizer(model_dir)

    def engine(engine_config: Any, model: Any, drafter: Any) -> Any:
        return make_engine(engine_config, ScriptedModel(model, tokenizer, script), drafter)

    daemon = Daemon(config, pipeline, base_dir=tmp, make_engine=engine)
    return TestClient(create_app(daemon), timeout=120), daemon


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    client, daemon = scripted_client(tiny_model_dir, tmp_path_factory.mktemp("single"), TWO_CALLS)
    with client:
        daemon.wait_loaded(120)
        assert daemon.ready, daemon.error
        yield client


def calls(client: TestClient, stream: bool, **body: Any) -> tuple[list[tuple[str, Any]], str, str]:
    """The response's calls (name, arguments), content and finish reason, rebuilt from the stream if streamed."""
    payload = {"model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": 80, "stream": stream, **body}
    response = client.post("/v1/chat/completions", json=payload)
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
               for c in choice["message"].get("tool_calls") or []]
        return got, choice["message"].get("content") or "", choice["finish_reason"]
    parts: dict[int, list[str]] = {}
    content, finish = [], ""
    for frame in sse_events(response.text):
        if frame == "[DONE]" or not frame["choices"]:
            continue
        delta = frame["choices"][0]["delta"]
        content.append(delta.get("content") or "")
        for call in delta.get("tool_calls") or []:
            part = parts.setdefault(call["index"], ["", ""])
            part[0] += call["function"].get("name") or ""
            part[1] += call["function"].get("arguments") or ""
        finish = frame["choices"][0].get("finish_reason") or finish
    return [(name, json.loads(args)) for _, (name, args) in sorted(parts.items())], "".join(content), finish


ONE = [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [None, True, False])
def test_a_named_tool_choice_yields_one_call(client: TestClient, stream: bool, parallel: bool | None) -> None:
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    assert calls(client, stream, tool_choice=NAMED, **extra) == (ONE, "", "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_required_without_parallel_calls_yields_one_call(client: TestClient, stream: bool) -> None:
    assert calls(client, stream, tool_choice="required", parallel_tool_calls=False) == (ONE, "", "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_unforced_calls_keep_both_unless_parallel_calls_are_off(client: TestClient, stream: bool) -> None:
    assert calls(client, stream) == (ONE * 2, "", "tool_calls")
    assert calls(client, stream, parallel_tool_calls=False) == (ONE, "", "tool_calls")
    assert calls(client, stream, tool_choice="required") == (ONE * 2, "", "tool_calls")


def test_a_hermes_call_in_qwen3_coder_output_is_recovered_and_logged(tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    (tmp_path / "template.jinja").write_text(QWEN3_CODER_TEMPLATE)
    client, daemon = scripted_client(tiny_model_dir, tmp_path, "Checking.\n" + CALL,
                                     model_extra='chat_template = "template.jinja"')
    with client, capture_logs() as logs:
        daemon.wait_loaded(120)
        for stream in (False, True):
            assert calls(client, stream) == (ONE, "Checking.\n", "tool_calls")
    fallbacks = [log for log in logs if log["event"] == "tool_call_fallback"]
    assert [(log["parser"], log["fallback"], log["tool"]) for log in fallbacks] == [
        ("qwen3_coder", "generic", "get_weather")] * 2
