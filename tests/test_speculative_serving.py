"""Speculative decoding through the daemon: configured in TOML, chosen per request by ``route``, opted out of in
the body, reported in the request log line and ``/v1/status``; refused at start-up where it cannot work.

The oracle throughout is the same server's plain decoding (``"speculative": false``): greedy outputs are equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from mlxd.errors import ConfigError
from tests.helpers import app_client, write_config
from tests.support.tiny import tiny_model_cached

REPEAT = "Repeat after me exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat."


def chat(client, content: str, **body) -> dict:
    response = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 32, **body})
    assert response.status_code == 200, response.text
    return response.json()


def request_lines(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "request"]


def speculative_config(tmp_path: Path, model_dir: Path, table: str) -> Path:
    return write_config(tmp_path, model_dir, extra=f"[engine.speculative]\n{table}\n")


def test_prompt_lookup_serves_the_plain_output_and_says_so(tmp_path, tiny_model_dir):
    config = speculative_config(tmp_path, tiny_model_dir, 'drafter = "prompt_lookup"\nadaptive = false')
    with app_client(config) as (client, daemon), capture_logs() as logs:
        speculative = chat(client, REPEAT)
        plain = chat(client, REPEAT, speculative=False)
        status = client.get("/v1/status").json()
    assert speculative["choices"][0]["message"] == plain["choices"][0]["message"]
    first, second = request_lines(logs)
    assert first["decode"]["mode"] == "speculative" and first["decode"]["drafter"] == "prompt_lookup"
    assert first["decode"]["drafted"] > 0  # the prompt repeats itself: there is something to look up
    assert second["decode"] == {"mode": "plain", "reason": "the request asked for plain decoding"}
    assert status["speculative"]["drafter"] == "prompt_lookup"
    assert status["speculative"]["acceptance"] is not None
    assert set(status["step_ms"]) == {"schedule", "prefill", "decode_build", "decode_wait",
                                                "post_process"}
    assert status["num_steps"] > 0


def test_off_by_default_unless_the_request_asks(tmp_path, tiny_model_dir):
    config = speculative_config(tmp_path, tiny_model_dir, 'drafter = "prompt_lookup"\ndefault = false')
    with app_client(config) as (client, _), capture_logs() as logs:
        chat(client, REPEAT)
        chat(client, REPEAT, speculative=True)
    default, asked = request_lines(logs)
    assert default["decode"]["reason"] == "speculation is off by default ([engine.speculative] default = false)"
    assert asked["decode"]["mode"] == "speculative"


def test_asking_a_server_without_a_drafter_for_speculation_is_a_400(tmp_path, tiny_model_dir):
    with app_client(write_config(tmp_path, tiny_model_dir)) as (client, _), capture_logs() as logs:
        response = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "speculative": True})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "speculative"
        chat(client, "hi")
    assert request_lines(logs)[-1]["decode"] == {"mode": "plain", "reason": "no drafter configured"}


def test_a_draft_model_named_relative_to_the_config(tmp_path, tiny_models_root, tiny_model_dir):
    draft = tiny_model_cached(tiny_models_root, "llama", seed=7)
    (tmp_path / "draft").symlink_to(draft)
    config = speculative_config(tmp_path, tiny_model_dir, 'drafter = "draft_model"\ndraft_model = "draft"')
    with app_client(config) as (client, _), capture_logs() as logs:
        speculative = chat(client, "Tell me about cats.", temperature=0)
        plain = chat(client, "Tell me about cats.", temperature=0, speculative=False)
    assert speculative["choices"][0]["message"] == plain["choices"][0]["message"]
    assert request_lines(logs)[0]["decode"]["drafter"] == "draft_model"


def test_mtp_heads_of_a_hybrid_vision_checkpoint_serve_text_requests(tmp_path, tiny_models_root):
    from tests.support.tiny_hybrid import tiny_qwen3_5_mtp_cached

    folder = tiny_qwen3_5_mtp_cached(tiny_models_root)
    config = speculative_config(tmp_path, folder, 'drafter = "mtp"\nk = 3')
    with app_client(config) as (client, _), capture_logs() as logs:
        speculative = chat(client, "Tell me about cats.")
        plain = chat(client, "Tell me about cats.", speculative=False)
    assert speculative["choices"][0]["message"] == plain["choices"][0]["message"]
    line = request_lines(logs)[0]
    assert line["route"] == "text" and line["decode"]["drafter"] == "mtp" and line["decode"]["drafted"] > 0


@pytest.mark.parametrize(("table", "model_extra", "message"), [
    ('drafter = "draft_model"', "", "needs draft_model"),
    ('drafter = "draft_model"\ndraft_model = "nowhere"', "", "draft_model = 'nowhere'"),
    ('drafter = "prompt_lookup"\nngram_min = 4\nngram_max = 2', "", "ngram_min: 4 is more than ngram_max"),
    ('drafter = "mtp"', "", "needs a Qwen3.5-family model"),
])
def test_speculation_that_cannot_work_is_refused_at_start_up(tmp_path, tiny_model_dir, table, model_extra,
                                                              message):
    from mlxd.cli import load_everything
    from mlxd.daemon import Daemon

    config_path = write_config(tmp_path, tiny_model_dir, model_extra=model_extra,
                               extra=f"[engine.speculative]\n{table}\n")
    with pytest.raises(ConfigError, match=message):  # at the config's check (ngram bounds) or at the model's load
        config, pipeline = load_everything(config_path)
        Daemon(config, pipeline, base_dir=config_path.parent).load()


def test_a_rotating_cache_or_unrecordable_recurrent_layers_refuse_speculation(tmp_path, tiny_models_root,
                                                                              tiny_model_dir):
    from mlxd.cli import load_everything
    from mlxd.daemon import Daemon

    hybrid = tiny_model_cached(tiny_models_root, "qwen3_next")  # mlx-lm's hybrid: its ArraysCache cannot roll back
    for model_dir, engine_extra, message in [(tiny_model_dir, "max_kv_size = 64", "max_kv_size"),
                                             (hybrid, "", "cannot roll back")]:
        config_path = write_config(tmp_path, model_dir, extra=f"[engine]\n{engine_extra}\n"
                                   "[engine.speculative]\ndrafter = \"prompt_lookup\"\n")
        config, pipeline = load_everything(config_path)
        daemon = Daemon(config, pipeline, base_dir=config_path.parent)
        with pytest.raises(ConfigError, match=message):
            daemon.load()
        daemon.close()


@pytest.mark.parametrize("value", ["yes", 1, None, [True], {"on": True}])
def test_a_speculative_field_that_is_not_a_boolean_is_a_400(tmp_path, tiny_model_dir, value):
    config = speculative_config(tmp_path, tiny_model_dir, 'drafter = "prompt_lookup"')
    with app_client(config) as (client, _):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "speculative": value}
        response = client.post("/v1/chat/completions", json=body)
        if value is None:  # JSON null: the server's default
            assert response.status_code == 200
        else:
            assert response.status_code == 400 and response.json()["error"]["param"] == "speculative"
        assert client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                                     "speculative": False}).status_code == 200
