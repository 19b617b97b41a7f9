"""/health is 503 until the model is loaded and warmed, and reports a failed load."""

from __future__ import annotations

import threading

from litestar.testing import TestClient

from mlxd.api.app import create_app
from mlxd.cli import load_everything
from mlxd.daemon import Daemon
from tests.helpers import write_config


def test_health_is_503_until_loaded(tiny_model_dir, tmp_path):
    config, pipeline = load_everything(write_config(tmp_path, tiny_model_dir))
    daemon = Daemon(config, pipeline)
    gate = threading.Event()
    real_load = daemon.load

    def gated_load():
        gate.wait(30)
        real_load()

    daemon.load = gated_load  # our own object: hold loading until the test has looked
    with TestClient(create_app(daemon)) as client:
        response = client.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "loading"
        chat = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 503 and "loading" in chat.json()["error"]["message"]
        gate.set()
        daemon.wait_loaded(60)
        assert client.get("/health").status_code == 200


def test_failed_load_is_reported(tmp_path):
    config, pipeline = load_everything(write_config(tmp_path, tmp_path / "missing-model"))
    daemon = Daemon(config, pipeline)
    with TestClient(create_app(daemon)) as client:
        daemon.wait_loaded(30)
        response = client.get("/health")
        assert response.status_code == 503
        assert response.json()["status"] == "failed" and "not found" in response.json()["error"]
