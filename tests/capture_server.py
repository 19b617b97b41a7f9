r"""A stand-alone loopback HTTP server that records what agent CLIs send and answers just well enough.

Run it as ``python tests/capture_server.py --port 8765 --out /tmp/captured`` and point Claude Code
(``ANTHROPIC_BASE_URL=http://127.0.0.1:8765``) or Codex (a provider with ``base_url = "http://127.0.0.1:8765/v1"``)
at it. Every request is written to ``OUT/NNNN-METHOD-PATH.json`` as ``{"method", "path", "headers", "body"}``
(``path`` keeps its query; ``body`` is the decoded JSON, or the text when it is not JSON).

Answers:
- ``POST /v1/messages`` (query allowed): an Anthropic message saying "OK", as SSE when ``stream`` is true.
- ``POST /v1/messages/count_tokens``: ``{"input_tokens": 10}``.
- ``POST /v1/responses``: an OpenAI Responses answer saying "OK", as SSE when ``stream`` is true.
- anything else: a small valid JSON answer (a model list for ``GET .../models``, else ``{}``).

Stdlib only, so it runs without the mlxd virtualenv and without importing mlxd.

How ``tests/fixtures`` were made (Claude Code 2.1.197, Codex 0.169.0; a fresh HOME and working folder each)::

    ANTHROPIC_BASE_URL=http://127.0.0.1:8765 ANTHROPIC_API_KEY=x ANTHROPIC_MODEL=claude-opus-4-8 \
    DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
        claude -p "Say hello in one word."          # then: claude -p --continue "And in French?"

    # $CODEX_HOME/config.toml: model = "gpt-5.5", model_provider = "mlxd", approval_policy = "never",
    # sandbox_mode = "read-only", and [model_providers.mlxd] name, base_url = "http://127.0.0.1:8765/v1",
    # env_key = "MLXD_API_KEY", wire_api = "responses"
    MLXD_API_KEY=x codex exec --skip-git-repo-check "Say hello in one word." </dev/null
    MLXD_API_KEY=x codex exec --skip-git-repo-check resume --last "And in French?" </dev/null

Without ``ANTHROPIC_MODEL`` the first turn of a session describes the model as ``claude-opus-4-8[1m]`` (1M context)
in its system prompt and Bash tool, and a ``--continue`` turn as ``claude-opus-4-8``: the two prompts then part
4,400 characters into the system prompt, before the tool list, so a second turn reuses almost nothing. The
fixtures keep only the headers that are not transport (host, length, encoding).
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ANSWER = "OK"
USAGE_IN, USAGE_OUT = 10, 1


def sse(events: list[dict[str, Any]]) -> bytes:
    """SSE frames ``event: TYPE`` + ``data: JSON`` for events that carry their own ``type``."""
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def anthropic_message(model: str) -> dict[str, Any]:
    return {
        "id": "msg_capture_0001", "type": "message", "role": "assistant", "model": model,
        "content": [{"type": "text", "text": ANSWER}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": USAGE_IN, "output_tokens": USAGE_OUT,
                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }


def anthropic_events(model: str) -> list[dict[str, Any]]:
    """The Anthropic Messages streaming sequence for a one-block text answer."""
    start = {**anthropic_message(model), "content": [], "stop_reason": None,
             "usage": {"input_tokens": USAGE_IN, "output_tokens": 0,
                       "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
    return [
        {"type": "message_start", "message": start},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": ANSWER}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
         "usage": {"output_tokens": USAGE_OUT}},
        {"type": "message_stop"},
    ]


def responses_object(model: str, status: str) -> dict[str, Any]:
    done = status == "completed"
    return {
        "id": "resp_capture_0001", "object": "response", "created_at": int(time.time()), "status": status,
        "model": model, "output": [_responses_item("completed")] if done else [],
        "usage": {"input_tokens": USAGE_IN, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": USAGE_OUT, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": USAGE_IN + USAGE_OUT} if done else None,
    }


def _responses_item(status: str) -> dict[str, Any]:
    done = status == "completed"
    content = [{"type": "output_text", "text": ANSWER, "annotations": []}] if done else []
    return {"id": "msg_capture_0001", "type": "message", "status": status, "role": "assistant", "content": content}


def responses_events(model: str) -> list[dict[str, Any]]:
    """The OpenAI Responses streaming sequence for a one-message text answer, numbered from 0."""
    part = {"type": "output_text", "text": "", "annotations": []}
    ids = {"item_id": "msg_capture_0001", "output_index": 0, "content_index": 0}
    events = [
        {"type": "response.created", "response": responses_object(model, "in_progress")},
        {"type": "response.in_progress", "response": responses_object(model, "in_progress")},
        {"type": "response.output_item.added", "output_index": 0, "item": _responses_item("in_progress")},
        {"type": "response.content_part.added", **ids, "part": part},
        {"type": "response.output_text.delta", **ids, "delta": ANSWER},
        {"type": "response.output_text.done", **ids, "text": ANSWER},
        {"type": "response.content_part.done", **ids, "part": {**part, "text": ANSWER}},
        {"type": "response.output_item.done", "output_index": 0, "item": _responses_item("completed")},
        {"type": "response.completed", "response": responses_object(model, "completed")},
    ]
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]


def models_list() -> dict[str, Any]:
    """A model list both the OpenAI and the Anthropic clients accept."""
    model = {"id": "capture-model", "object": "model", "type": "model", "created": 0, "owned_by": "capture",
             "display_name": "capture-model", "created_at": "2025-01-01T00:00:00Z"}
    return {"object": "list", "data": [model], "has_more": False, "first_id": model["id"], "last_id": model["id"]}


class Recorder:
    """Writes each request to ``folder`` under a sequence number (thread-safe)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()

    def record(self, method: str, path: str, headers: dict[str, str], body: Any) -> Path:
        with self._lock:
            number = next(self._numbers)
        slug = urlsplit(path).path.strip("/").replace("/", "_") or "root"
        target = self.folder / f"{number:04d}-{method}-{slug}.json"
        target.write_text(json.dumps({"method": method, "path": path, "headers": headers, "body": body}, indent=2))
        return target


class CaptureHandler(BaseHTTPRequestHandler):
    recorder: Recorder  # set on the subclass that make_handler builds
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        self.recorder.record(method, self.path, dict(self.headers.items()), body)
        content_type, payload = answer(method, urlsplit(self.path).path, body if isinstance(body, dict) else {})
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)
        self.close_connection = True


def answer(method: str, path: str, body: dict[str, Any]) -> tuple[str, bytes]:
    """(content type, bytes) for a request: see the module docstring."""
    model = str(body.get("model") or "capture-model")
    stream = bool(body.get("stream"))
    if method == "POST" and path.endswith("/messages/count_tokens"):
        return "application/json", json.dumps({"input_tokens": USAGE_IN}).encode()
    if method == "POST" and path.endswith("/messages"):
        if stream:
            return "text/event-stream", sse(anthropic_events(model))
        return "application/json", json.dumps(anthropic_message(model)).encode()
    if method == "POST" and path.endswith("/responses"):
        if stream:
            return "text/event-stream", sse(responses_events(model))
        return "application/json", json.dumps(responses_object(model, "completed")).encode()
    if method == "GET" and path.rstrip("/").endswith("/models"):
        return "application/json", json.dumps(models_list()).encode()
    return "application/json", b"{}"


def make_server(port: int, folder: Path, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A server on ``host:port`` (0: any free port) that records into ``folder``; call ``serve_forever``."""
    handler = type("Handler", (CaptureHandler,), {"recorder": Recorder(folder)})
    return ThreadingHTTPServer((host, port), handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", type=Path, required=True, help="folder the requests are written to")
    args = parser.parse_args()
    server = make_server(args.port, args.out)
    print(f"capturing on http://127.0.0.1:{server.server_address[1]} into {args.out}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
