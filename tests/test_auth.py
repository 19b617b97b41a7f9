"""API keys: which endpoints need a key or an admin key, the 401/403 bodies, where keys come from."""

from __future__ import annotations

import pytest
import structlog

from mlxd.api.app import create_app
from mlxd.api.auth import digest, load_keys, matches, read_keys_file
from mlxd.cli import load_everything
from mlxd.config.schema import ServerConfig
from mlxd.daemon import Daemon
from mlxd.errors import ConfigError
from tests.helpers import app_client, write_config

USER_KEYS = ["user-key-1", "user-key-2"]
ENV_KEY = "env-key"
ADMIN_KEY = "admin-key"
ALL_KEYS = [*USER_KEYS, ENV_KEY, ADMIN_KEY]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    (tmp / "api.keys").write_text(f"# one key per line\n\n  {USER_KEYS[0]}  \n# {USER_KEYS[1]}-not\n{USER_KEYS[1]}\n")
    (tmp / "admin.keys").write_text(f"{ADMIN_KEY}\n")
    # The API keys file relative to the config's folder, the admin one absolute.
    server = f'api_keys_file = "api.keys"\nadmin_keys_file = "{tmp / "admin.keys"}"'
    config = write_config(tmp, tiny_model_dir, server_extra=server)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXD_API_KEYS", f" {ENV_KEY} ,")
        patch.delenv("MLXD_ADMIN_KEYS", raising=False)
        with structlog.testing.capture_logs() as logs, app_client(config) as (client, daemon):
            yield client, logs


def test_generation_needs_a_valid_key(served):
    client, _ = served
    missing = client.post("/v1/chat/completions", json=CHAT)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    error = missing.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "authentication_error"
    assert "Authorization: Bearer" in error["message"]

    wrong = client.post("/v1/chat/completions", json=CHAT, headers=bearer(USER_KEYS[0] + "x"))
    assert wrong.status_code == 401
    assert USER_KEYS[0] not in wrong.text  # never echoed
    assert wrong.json()["error"]["type"] == "authentication_error"
    commented_out = client.post("/v1/chat/completions", json=CHAT, headers=bearer(f"# {USER_KEYS[1]}-not"))
    assert commented_out.status_code == 401
    assert client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": USER_KEYS[0]}).status_code == 401


@pytest.mark.parametrize("key", ALL_KEYS)
def test_every_configured_key_works_in_either_header(served, key):
    client, _ = served
    for headers in (bearer(key), {"x-api-key": key}, {"authorization": f"bearer  {key} "}):
        response = client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 200, (headers, response.text)
    assert client.get("/v1/models", headers={"x-api-key": key}).status_code == 200


def test_open_endpoints(served):
    client, _ = served
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for path in ("/v1/models", "/v1/status", "/v1/cache/stats", "/docs/openapi.json"):
        assert client.get(path).status_code == 401, path
    assert client.delete("/v1/cache").status_code == 401


def test_request_details_and_cache_flush_need_an_admin_key(served):
    client, _ = served
    user = bearer(USER_KEYS[1])
    status = client.get("/v1/status", headers=user).json()
    assert "running" not in status and "waiting" not in status
    assert status["num_running"] == 0 and status["num_waiting"] == 0
    assert status["totals"]["num_requests"] >= 0 and "memory" in status
    assert client.get("/v1/cache/stats", headers=user).status_code == 200
    denied = client.delete("/v1/cache", headers=user)
    assert denied.status_code == 403
    assert denied.json()["error"]["type"] == "permission_error"
    assert "admin key" in denied.json()["error"]["message"]

    admin = {"x-api-key": ADMIN_KEY}
    status = client.get("/v1/status", headers=admin).json()
    assert status["running"] == [] and status["waiting"] == []
    assert client.delete("/v1/cache", headers=admin).status_code == 200


def test_keys_are_never_logged(served):
    client, logs = served
    client.post("/v1/chat/completions", json=CHAT, headers=bearer(USER_KEYS[0]))
    client.post("/v1/chat/completions", json=CHAT, headers=bearer("not-a-key"))
    text = repr(logs)
    assert "request" in {entry["event"] for entry in logs}
    assert [entry for entry in logs if entry["event"] == "api_keys"] == [
        {"event": "api_keys", "log_level": "info", "num_keys": 4, "num_admin_keys": 1, "metrics_need_key": False}]
    for key in [*ALL_KEYS, "not-a-key"]:
        assert key not in text


def test_metrics_can_need_a_key(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXD_API_KEYS", "k1,k2")
    config = write_config(tmp_path, tiny_model_dir, server_extra="metrics_need_key = true")
    with app_client(config) as (client, _):
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=bearer("k2")).status_code == 200
        assert client.get("/health").status_code == 200
        # No admin keys: every API key is an admin key.
        assert client.get("/v1/status", headers=bearer("k1")).json()["running"] == []
        assert client.delete("/v1/cache", headers={"x-api-key": "k2"}).status_code == 200


def test_without_keys_everything_is_open(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("MLXD_API_KEYS", raising=False)
    monkeypatch.delenv("MLXD_ADMIN_KEYS", raising=False)
    with app_client(write_config(tmp_path, tiny_model_dir)) as (client, _):
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert client.get("/v1/status").json()["running"] == []
        assert client.delete("/v1/cache").status_code == 200
        assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize(("field", "content", "fragment"), [
    ("api_keys_file", None, "no such file ([server] api_keys_file)"),
    ("admin_keys_file", None, "no such file ([server] admin_keys_file)"),
    ("api_keys_file", "# only a comment\n\n", "holds no key ([server] api_keys_file)"),
])
def test_a_bad_keys_file_fails_at_start_up_naming_it(tiny_model_dir, tmp_path, field, content, fragment):
    keys = tmp_path / "team.keys"
    if content is not None:
        keys.write_text(content)
    config_path = write_config(tmp_path, tiny_model_dir, server_extra=f'{field} = "team.keys"')
    config, pipeline = load_everything(config_path)
    with pytest.raises(ConfigError) as caught:
        create_app(Daemon(config, pipeline, base_dir=config_path.parent), load=False)
    assert str(keys) in caught.value.message and fragment in caught.value.message


def test_key_sources_add_up(tmp_path):
    (tmp_path / "admin.keys").write_text("a1\n#a2\n a3 \n")
    server = ServerConfig(admin_keys_file="admin.keys")
    keys = load_keys(server, tmp_path, {"MLXD_API_KEYS": "u1, u2,,", "MLXD_ADMIN_KEYS": "a4"})
    assert keys.admin == tuple(map(digest, ["a1", "a3", "a4"]))
    assert keys.api == tuple(map(digest, ["u1", "u2", "a1", "a3", "a4"]))  # an admin key is an API key too
    only_admin = load_keys(server, tmp_path, {})
    assert only_admin.enabled and only_admin.api == only_admin.admin
    assert not load_keys(ServerConfig(), tmp_path, {"MLXD_API_KEYS": " , "}).enabled
    assert read_keys_file(tmp_path / "admin.keys", "admin_keys_file") == ["a1", "a3"]


def test_matching_compares_whole_keys():
    keys = (digest("secret-one"), digest("secret-two"))
    assert matches(["secret-two"], keys)
    assert matches(["nope", "secret-one"], keys)
    assert not matches(["secret"], keys) and not matches(["secret-one-more"], keys) and not matches([], keys)
