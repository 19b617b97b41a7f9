"""Third-party stages: by import path in a config, and by name through the `mlxd.stages` entry point group."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from mlxd.errors import ConfigError
from mlxd.pipeline.events import ContentDelta
from mlxd.pipeline.job import Job
from mlxd.pipeline.registry import known_stage_names, resolve_stage
from mlxd.pipeline.stage import NoOptions, Stage
from tests.helpers import app_client, write_config

MESSAGES = [{"role": "user", "content": "Say something."}]


class ShoutConfig(NoOptions, frozen=True):
    suffix: str = ""


class Shout(Stage):
    """Upper-cases generated text: a stage that changes output visibly."""

    Config = ShoutConfig

    async def stream(self, job: Job, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for event in events:
            yield ContentDelta(event.text.upper()) if isinstance(event, ContentDelta) else event


def inline_pipeline(extra_stage: str) -> str:
    names = ["normalize", "template", "route", "prefill", "decode", "detokenize"]
    tables = "".join(f'[[pipeline.stages]]\ntype = "{name}"\n' for name in names)
    return tables + extra_stage


def content(client) -> str:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_stage_by_import_path_changes_output(tiny_model_dir, tmp_path):
    plain_config = write_config(tmp_path, tiny_model_dir, pipeline=inline_pipeline(""))
    with app_client(plain_config) as (client, _):
        plain = content(client)
    shout_config = write_config(tmp_path, tiny_model_dir,
                                pipeline=inline_pipeline('[[pipeline.stages]]\ntype = "tests.test_plugins:Shout"\n'))
    with app_client(shout_config) as (client, daemon):
        assert [name for name, _ in daemon.pipeline.stages][-1] == "tests.test_plugins:Shout"
        shouted = content(client)
    assert plain.strip() and shouted == plain.upper() and shouted != plain


def test_stage_options_are_validated_by_the_stage(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, pipeline=inline_pipeline(
        '[[pipeline.stages]]\ntype = "tests.test_plugins:Shout"\nvolume = 11\n'))
    with pytest.raises(ConfigError, match=r"stage 6 \(tests.test_plugins:Shout\).*unknown field `volume`"):
        from mlxd.cli import load_everything

        load_everything(config)


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A distribution installed into a site directory: its metadata registers `shout` as an mlxd stage."""
    site = tmp_path / "site"
    dist = site / "mlxd_shout_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mlxd-shout-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[mlxd.stages]\nshout = tests.test_plugins:Shout\n")
    monkeypatch.syspath_prepend(str(site))
    return "shout"


def test_entry_point_stage_is_found_by_name(installed_plugin, tiny_model_dir, tmp_path):
    assert installed_plugin in known_stage_names()
    assert resolve_stage(installed_plugin) is Shout
    config = write_config(tmp_path, tiny_model_dir, pipeline=inline_pipeline('[[pipeline.stages]]\ntype = "shout"\n'))
    with app_client(config) as (client, _):
        text = content(client)
    assert text == text.upper()


class Explode(Stage):
    """Fails unexpectedly on requests that mention `boom`, before or during streaming."""

    def prepare(self, job: Job) -> None:
        if "boom" in job.messages[-1]["content"]:
            raise RuntimeError("stage bug")

    async def stream(self, job: Job, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for event in events:
            if "kaput" in job.messages[-1]["content"] and isinstance(event, ContentDelta):
                raise RuntimeError("stream bug")
            yield event


def test_a_failing_request_does_not_take_the_daemon_down(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, pipeline=inline_pipeline(
        '[[pipeline.stages]]\ntype = "tests.test_plugins:Explode"\n'))
    with app_client(config) as (client, daemon):
        body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
        response = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "boom"}]})
        # The client learns the request id, never the exception (that goes to the log).
        message = response.json()["error"]["message"]
        assert response.status_code == 500 and "stage bug" not in message and "chatcmpl-" in message
        response = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "kaput"}]})
        assert response.status_code == 500
        assert content(client)
        assert daemon.engine.status()["running"] == []
