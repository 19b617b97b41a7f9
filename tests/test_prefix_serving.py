"""The prefix cache in the served daemon: agent conversations hit, outputs equal cold runs, work is counted."""

from __future__ import annotations

import asyncio
import gc

import mlx.core as mx
import pytest
from mlx_lm import load

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Progress
from mlxd.engine.engine import BatchedEngine
from tests.helpers import app_client, write_config
from tests.helpers import run_request as run
from tests.test_batched_engine import CountingModel, solo_tokens

SYSTEM = "You are a coding agent. " + "Follow the repository's rules, read files before editing them. " * 12
USER_TURNS = ["List the files.", "Open the parser and explain it.", "Now fix the failing test.", "Thanks!"]


def chat(client, messages, **body):
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 8,
                                                         "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def cold(client, messages):
    client.delete("/v1/cache").raise_for_status()
    return chat(client, messages)


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_qwen3_next_dir"])
def test_agent_conversation_hits_and_equals_cold_runs(model_fixture, request, tmp_path):
    model_dir = request.getfixturevalue(model_fixture)
    extra = "[engine]\nprefill_chunk = 64\n"
    config = write_config(tmp_path, model_dir, extra=extra)
    with app_client(config) as (client, _):
        messages = [{"role": "system", "content": SYSTEM}]
        previous_prompt = 0
        for turn, user in enumerate(USER_TURNS):
            messages.append({"role": "user", "content": user})
            warm = chat(client, messages)
            usage = warm["usage"]
            if turn:
                # Everything up to the end of the previous turn's last message comes from the cache.
                assert usage["prompt_tokens_details"]["cached_tokens"] >= previous_prompt - 8, (turn, usage)
            reply = warm["choices"][0]["message"]["content"]
            assert reply == cold(client, messages)["choices"][0]["message"]["content"]
            # Rebuild the cache as the conversation had it (the cold run cleared it).
            chat(client, messages)
            previous_prompt = usage["prompt_tokens"]
            messages.append({"role": "assistant", "content": reply})
        stats = client.get("/v1/cache/stats").json()
        assert stats["num_hits"] >= len(USER_TURNS) - 1 and stats["num_bytes"] <= stats["budget_bytes"]
        status = client.get("/v1/status").json()
        assert status["running"] == []


def test_a_resent_prompt_and_an_edited_history_equal_cold_runs(tiny_model_dir, tmp_path):
    with app_client(write_config(tmp_path, tiny_model_dir)) as (client, _):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[0]}]
        first = chat(client, messages)
        again = chat(client, messages)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] - 1
        assert again["choices"] == first["choices"]
        edited = [messages[0], {"role": "user", "content": "Something else entirely, please."}]
        warm = chat(client, edited)
        assert 0 < warm["usage"]["prompt_tokens_details"]["cached_tokens"] < warm["usage"]["prompt_tokens"]
        assert warm["choices"] == cold(client, edited)["choices"]


def test_a_k_token_hit_processes_exactly_n_minus_k_prompt_tokens(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    counting = CountingModel(model)
    engine = BatchedEngine(counting, EngineConfig(max_running=2, prefill_chunk=16))
    engine.start()
    try:
        first_prompt = tokenizer.encode("The first turn of a long conversation about parsers and tests. " * 3)
        tokens, _ = run(engine, EngineRequest(request_id="a", prompt=first_prompt, max_tokens=6))
        second_prompt = first_prompt + tokens + tokenizer.encode(" And now the second turn asks for more.")
        counting.calls.clear()
        second, finished = run(engine, EngineRequest(request_id="b", prompt=second_prompt, max_tokens=6))
        k, n = finished.num_cached_tokens, len(second_prompt)
        assert finished.cache_hit == "prefix" and k == len(first_prompt) + len(tokens)
        processed = sum(call.length * call.batch for call in counting.calls)
        assert processed - 6 == n - k  # six decode steps of one token each; the rest is the uncached prompt
        assert second == solo_tokens(model, second_prompt, 6)
        mx.clear_cache()
    finally:
        engine.stop()


def test_cancelled_prefills_keep_their_chunks_within_the_budget(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    budget = 256 * 1024
    engine = BatchedEngine(model, EngineConfig(max_running=2, prefill_chunk=8, step_token_budget=8,
                                               prefix_cache_bytes=budget))
    engine.start()
    # One request first, so that what the first request of an engine allocates once (and keeps) is in the baseline;
    # then the prefix cache is emptied again.
    run(engine, EngineRequest(request_id="warm", prompt=tokenizer.encode("A warm-up prompt."), max_tokens=4))
    asyncio.run(engine.clear_prefix_cache())
    mx.synchronize()
    gc.collect()  # arrays held only by reference cycles (asyncio tasks, frames) are not the engine's
    baseline = mx.get_active_memory()

    async def cancel_after_two_chunks(request: EngineRequest) -> None:
        handle = engine.submit(request)
        async for event in handle.events():
            if isinstance(event, Progress) and event.num_processed >= 16:
                handle.cancel()
                return

    try:
        prompts = [tokenizer.encode(f"Soak prompt number {i}: " + "tokens of a long prompt " * 12) for i in range(20)]
        for i, prompt in enumerate(prompts):
            asyncio.run(cancel_after_two_chunks(EngineRequest(request_id=f"s{i}", prompt=prompt, max_tokens=4)))
            assert engine.cache_stats()["num_bytes"] <= budget
        # The last cancelled prompt's processed chunks are reused: its work was kept.
        tokens, finished = run(engine, EngineRequest(request_id="again", prompt=prompts[-1], max_tokens=4))
        assert finished.num_cached_tokens >= 16 and tokens == solo_tokens(model, prompts[-1], 4)
        assert engine.status()["running"] == [] and engine.status()["waiting"] == []
        mx.synchronize()
        gc.collect()
        kept = engine.cache_stats()["num_bytes"]
        assert kept <= budget
        # Snapshots are the only memory the soak leaves behind (the allocator rounds each buffer up a little).
        assert mx.get_active_memory() <= baseline + 1.05 * kept
    finally:
        engine.stop()
