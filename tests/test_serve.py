"""The daemon as users run it: `python -m mlxd --config ...` in its own process, spoken to over real sockets."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from mlxd.runtime.blas import find_openblas
from tests.helpers import free_port, log_lines, serve_subprocess, write_config


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    config = write_config(tmp, tiny_model_dir, port=port)
    with serve_subprocess(config, port) as (base, proc):
        yield base, proc, tmp / f"server-{port}.log"


def test_openai_sdk_stream_equals_non_stream(server):
    base, _, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    chunks = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in chunks:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="unknown-model", messages=messages)


def test_one_canonical_json_log_line_per_request(server):
    base, _, log_path = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    reply = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    lines = [line for line in log_lines(log_path) if line.get("event") == "request"]
    mine = [line for line in lines if line["request_id"] == reply.id]
    assert len(mine) == 1
    line = mine[0]
    assert line["model"] == "tiny" and line["completion_tokens"] == reply.usage.completion_tokens
    assert line["prompt_tokens"] == reply.usage.prompt_tokens and line["finish_reason"] == "length"
    assert line["ttft_s"] > 0 and line["total_s"] >= line["ttft_s"] and line["level"] == "info"
    # Where the time to first token went: preparing, waiting for admission, processing the prompt (each measured
    # on its own clock, so their sum is within a few milliseconds of the TTFT, never far above it).
    parts = [line["prepare_s"], line["queued_s"], line["prefill_s"]]
    assert all(p is not None and p >= 0 for p in parts) and line["prefill_s"] > 0
    assert sum(parts) <= line["ttft_s"] + 0.005


def test_openblas_is_mapped_into_the_serving_process(server):
    if find_openblas() is None:
        pytest.skip("OpenBLAS is not installed (Debian: apt-get install libopenblas0-pthread)")
    _, proc, log_path = server
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert "libopenblas" in maps
    ready = next(line for line in log_lines(log_path) if line.get("event") == "model_ready")
    assert any("libopenblas" in lib for lib in ready["blas"]) and ready["dtype"] == "float32"


def test_the_serving_process_freezes_what_start_up_loaded_and_reports_collector_pauses(server):
    import httpx

    base, _, log_path = server
    openai.OpenAI(base_url=base + "/v1", api_key="unused").completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    ready = next(line for line in log_lines(log_path) if line.get("event") == "model_ready")
    gc_status = httpx.get(base + "/v1/status").json()["gc"]
    # Modules, the tokenizer, the model's modules, the web framework: tens of thousands of objects at least, counted
    # once, when they were frozen.
    assert ready["frozen_objects"] > 20_000 and gc_status["num_frozen_objects"] == ready["frozen_objects"]
    assert sum(gc_status["num_collections"]) > 0 and gc_status["pause_ms_max"] <= gc_status["pause_ms_total"]
