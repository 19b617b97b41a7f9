"""Another web origin cannot drive the daemon: POST bodies must be declared JSON (415), a loopback-bound daemon
answers only loopback or allowed Host names (403, DNS rebinding), and the status page carries its security headers.
In-process, the model not loaded: every check here happens before a request reaches it."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from litestar.testing import TestClient

from mlxd.api.app import create_app
from mlxd.api.origins import host_name, is_loopback
from mlxd.cli import load_everything
from mlxd.daemon import Daemon
from tests.helpers import free_port, serve_subprocess, write_config

CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
MESSAGES = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'
NOT_JSON = [None, "text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", "text/json", "application/xml"]


@contextmanager
def client(tmp_path, model_dir, server_extra: str = "", base_url: str = "http://127.0.0.1:8080") -> Iterator[TestClient]:
    config, pipeline = load_everything(write_config(tmp_path, model_dir, server_extra=server_extra))
    with TestClient(create_app(Daemon(config, pipeline, base_dir=tmp_path), load=False), base_url=base_url) as c:
        yield c


@pytest.fixture(scope="module")
def loopback(tiny_model_dir, tmp_path_factory) -> Iterator[TestClient]:
    with client(tmp_path_factory.mktemp("origins"), tiny_model_dir, 'allowed_hosts = ["mlxd.lan", "Proxy.Example."]') as c:
        yield c


def post(c: TestClient, path: str, body: bytes, content_type: str | None, **headers: str):
    return c.post(path, content=body, headers={**({"content-type": content_type} if content_type else {}), **headers})


@pytest.mark.parametrize("content_type", NOT_JSON)
def test_a_post_not_declared_json_is_415_in_each_surface_shape(loopback, content_type):
    response = post(loopback, "/v1/chat/completions", CHAT, content_type)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "application/json" in error["message"]
    response = post(loopback, "/v1/messages", MESSAGES, content_type)
    assert response.status_code == 415, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "application/json" in body["error"]["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON",
                                          "application/vnd.api+json"])
def test_json_bodies_pass_the_check(loopback, content_type):
    # The model is not loaded: a body that passes every check before it is refused with 503, not 415.
    assert post(loopback, "/v1/chat/completions", CHAT, content_type).status_code == 503
    assert post(loopback, "/v1/messages", MESSAGES, content_type).status_code == 503


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "LOCALHOST.", "127.0.0.1", "127.0.0.1:8080",
                                  "127.3.4.5:1", "[::1]", "[::1]:8080", "mlxd.lan", "mlxd.lan:443",
                                  "proxy.example:8080"])
def test_loopback_and_allowed_hosts_are_served(loopback, host):
    assert loopback.get("/v1/models", headers={"host": host}).status_code == 200
    assert loopback.get("/", headers={"host": host}).status_code == 200


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8080", "localhost.attacker.example",
                                  "127.0.0.1.nip.io", "10.0.0.1", "[::2]:8080", "mlxd.lan.evil", "192.168.1.2:8080"])
def test_other_hosts_are_refused_in_each_surface_shape(loopback, host):
    for path in ("/health", "/", "/v1/status", "/v1/models", "/metrics"):
        response = loopback.get(path, headers={"host": host})
        assert response.status_code == 403, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "permission_error" and "allowed_hosts" in error["message"]
    response = post(loopback, "/v1/messages", MESSAGES, "application/json", host=host)
    assert response.status_code == 403
    assert response.json() == {"type": "error", "error": {"type": "permission_error",
                                                          "message": response.json()["error"]["message"]}}
    assert "allowed_hosts" in response.json()["error"]["message"]


def test_hosts_are_not_checked_when_bound_beyond_loopback_or_when_any_is_allowed(tiny_model_dir, tmp_path):
    for i, server in enumerate(['host = "0.0.0.0"', 'allowed_hosts = ["*"]']):
        (tmp_path / str(i)).mkdir()
        with client(tmp_path / str(i), tiny_model_dir, server) as c:
            assert c.get("/v1/models", headers={"host": "mlxd.example.com"}).status_code == 200


def test_status_page_sends_its_security_headers(loopback):
    response = loopback.get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["referrer-policy"] == "no-referrer"
    policy = dict(part.strip().split(" ", 1) for part in response.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
    assert policy["connect-src"] == "'self'"
    # The page's own inline script and style, by the hash a browser computes of their text; nothing else.
    for kind in ("script", "style"):
        bodies = re.findall(rf"<{kind}>(.*?)</{kind}>", response.text, re.DOTALL)
        assert len(bodies) == 1
        digest = base64.b64encode(hashlib.sha256(bodies[0].encode()).digest()).decode()
        assert policy[f"{kind}-src"] == f"'sha256-{digest}'"
    assert "unsafe" not in response.headers["content-security-policy"]


def test_host_names():
    assert [host_name(h) for h in ("LocalHost:80", "[::1]:8080", "[::1]", "a.b.", "::1")] == [
        "localhost", "::1", "::1", "a.b", "::1"]
    assert all(map(is_loopback, ["localhost", "127.0.0.1", "127.255.0.9", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "localhost.example", "example.com"]))


def test_a_real_server_on_loopback_checks_host_and_content_type(tiny_model_dir, tmp_path):
    """uvicorn tells the app which address a connection reached: the checks hold on a real socket too."""
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port)
    with serve_subprocess(config, port) as (base, _):
        assert httpx.get(base + "/health", headers={"host": f"localhost:{port}"}, timeout=10).status_code == 200
        refused = httpx.get(base + "/v1/models", headers={"host": f"rebind.attacker.example:{port}"}, timeout=10)
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
        for content_type in ("text/plain", "application/x-www-form-urlencoded"):
            simple = httpx.post(base + "/v1/chat/completions", content=CHAT, headers={"content-type": content_type},
                                timeout=10)
            assert simple.status_code == 415, simple.text
        served = httpx.post(base + "/v1/chat/completions", content=CHAT, headers={"content-type": "application/json"},
                            timeout=60)
        assert served.status_code == 200 and served.json()["choices"][0]["message"]["content"]
