"""The engine's commands are its whole story: what a leader records, replayed on a fresh engine of the same model,
gives the same rows, the same outputs and the same prefix cache (mlxd/engine/commands.py, distributed/leader.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from mlx_lm import load

from mlxd.config.schema import DistributedConfig, EngineConfig
from mlxd.engine.base import EngineRequest, Finished, Progress, Token
from mlxd.engine.commands import Accept, Cancel, Drop, Stop
from mlxd.engine.core import EngineCore
from mlxd.engine.distributed.leader import make_leader_engine
from mlxd.engine.schedule.memory import measure_memory
from mlxd.engine.step.sampling import make_request_sampler


class RecordingChannel:
    """A group of one that keeps every message rank 0 sends, and what rank 0's engine held when it sent it."""

    rank, size = 0, 1

    def __init__(self) -> None:
        self.engine: Any = None
        self.messages: list[Any] = []
        self.views: list[dict[str, Any]] = []

    lost = None

    def connect(self, timeout_s: float, port: int = 0) -> None:
        pass

    def send(self, message: Any) -> None:
        self.messages.append(message)
        self.views.append(view(self.engine.core))

    def wait_reported(self, timeout_s: float) -> None:
        pass

    def peer_stats(self) -> list[dict[str, int] | None]:
        return []

    def close(self, wait_s: float = 0.0) -> None:
        pass

    def share_tokens(self, tokens: Any) -> Any:
        return tokens


def view(core: EngineCore) -> dict[str, Any]:
    """What a replay must reproduce between steps: the decode batch's rows in order, the prompts going in, each
    request's progress and prefix-cache hit, and the prefix cache's entries, bytes and counters."""
    requests = {request_id: (core.table[request_id].state.num_prefilled, list(core.table[request_id].generated),
                             core.table[request_id].state.cache_hit, core.table[request_id].state.num_cached_tokens)
                for request_id in core.table}
    return {"rows": core.runner.batch.request_ids, "prefilling": sorted(core.runner.prefilling),
            "requests": requests, "prefix_cache": core.reuse.stats()}


async def serve(engine: Any, prompts: dict[str, list[int]], max_tokens: dict[str, int],
                cancel_after: dict[str, int]) -> dict[str, tuple[list[int], str]]:
    """Submit every request at once; each one's emitted tokens and how it ended."""
    async def one(request_id: str) -> tuple[list[int], str]:
        handle = engine.submit(EngineRequest(request_id=request_id, prompt=prompts[request_id],
                                             max_tokens=max_tokens[request_id]))
        tokens: list[int] = []
        async for event in handle.events():
            if isinstance(event, Token):
                tokens.append(event.token)
                if len(tokens) == cancel_after.get(request_id):
                    handle.cancel()
            elif isinstance(event, Finished):
                return tokens, event.reason
            elif event is not None and not isinstance(event, Progress):
                raise AssertionError(event)
        raise AssertionError("the stream ended without a final event")

    results = await asyncio.gather(*(one(request_id) for request_id in prompts))
    return dict(zip(prompts, results, strict=True))


def replay(model: Any, config: EngineConfig, channel: RecordingChannel) -> tuple[dict[str, list[int]], EngineCore]:
    """Apply the recorded messages to a fresh core, as a follower does, checking each view on the way; returns what
    each request had generated when it was let go."""
    core = EngineCore(model, config, make_sampler=make_request_sampler, channel=RecordingChannel(), follower=True)
    core.warm_up()
    outputs: dict[str, list[int]] = {}
    for i, (message, expected) in enumerate(zip(channel.messages, channel.views, strict=True)):
        for command in message.commands:
            if isinstance(command, Drop | Cancel) and command.request_id in core.table:
                outputs[command.request_id] = list(core.table[command.request_id].generated)
            core.apply(command)
        if any(isinstance(command, Stop) for command in message.commands):
            break
        assert view(core) == expected, f"message {i}"
        if message.step is not None:
            core.apply(message.step)
    return outputs, core


@contextlib.contextmanager
def recorded(model: Any, config: EngineConfig) -> Iterator[tuple[Any, RecordingChannel]]:
    """A leader's engine (a group of one) whose messages are recorded; stopped on the way out."""
    channel = RecordingChannel()
    settings = DistributedConfig(backend="ring", tensor_parallel=1, heartbeat_s=3600.0)
    engine = make_leader_engine(model, config, channel=channel, settings=settings)
    channel.engine = engine
    engine.start()
    try:
        yield engine, channel
    finally:
        engine.stop()
    assert engine.failure is None


def check_replay(model: Any, config: EngineConfig, engine: Any, channel: RecordingChannel,
                 served: dict[str, tuple[list[int], str]], prompts: dict[str, list[int]]) -> dict[str, Any]:
    """Replay and compare: each request's output, the prefix cache's counters, and what it holds for each request.
    Returns the leader's prefix-cache stats."""
    outputs, core = replay(model, config, channel)
    assert outputs == {request_id: tokens for request_id, (tokens, _) in served.items()}
    stats = engine.reuse.stats()
    assert core.reuse.stats() == stats
    for request_id, prompt in prompts.items():
        key = prompt + served[request_id][0]
        leader_hit, replay_hit = engine.reuse.lookup(key), core.reuse.lookup(key)
        assert (leader_hit.kind, leader_hit.num_cached) == (replay_hit.kind, replay_hit.num_cached), request_id
    return stats


def kinds(channel: RecordingChannel) -> set[str]:
    return {type(c).__name__ for m in channel.messages for c in [*m.commands, *([m.step] if m.step else [])]}


def test_a_leaders_recorded_commands_replayed_reproduce_rows_outputs_and_prefix_cache(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    # Requests sent together start together (gather_ms), so that whole short prompts share a pass.
    config = EngineConfig(max_running=4, prefill_chunk=8, step_token_budget=32, warmup_tokens=1, gather_ms=50)
    text = "The engine applies commands; a follower applies the same commands and holds the same state. "
    long = tokenizer.encode(text * 2)  # several prompt chunks
    first = {"a": long, "b": tokenizer.encode("Short prompt."), "c": tokenizer.encode("Another one, a bit longer."),
             "d": tokenizer.encode(text)}
    with recorded(model, config) as (engine, channel):
        served = asyncio.run(serve(engine, first, {"a": 6, "b": 9, "c": 5, "d": 40}, cancel_after={"d": 4}))
        # The next turn of "a" starts from what the prefix cache kept of it.
        second = {"e": long + served["a"][0] + tokenizer.encode(" And the next turn."),
                  "f": tokenizer.encode("Short prompt.")}
        served.update(asyncio.run(serve(engine, second, {"e": 7, "f": 3}, cancel_after={})))
        hits = engine.reuse.stats()["num_hits"]
        asyncio.run(engine.clear_prefix_cache())
        third = {"g": tokenizer.encode("After the cache was cleared.")}
        served.update(asyncio.run(serve(engine, third, {"g": 4}, cancel_after={})))
    # Cancelled after its fourth token: the cancel lands between steps, so a step or two may have emitted more.
    assert served["d"][1] == "cancelled" and 4 <= len(served["d"][0]) < 40
    assert {served[r][1] for r in "abcefg"} == {"length"}
    assert {"Accept", "Cancel", "Keep", "Drop", "Clear", "RunStep", "Stop"} <= kinds(channel)
    assert any(m.step is not None and m.step.together for m in channel.messages)  # prompts that shared a pass
    assert sum(isinstance(c, Accept) for m in channel.messages for c in m.commands) == 7
    assert hits >= 1  # "e" started from a kept state
    check_replay(model, config, engine, channel, served, {**first, **second, **third})


def test_replayed_evictions_leave_the_same_prefix_cache(tiny_model_dir):
    """With room for one long request and one short snapshot beside it, the prefix cache gives way (``Evict``)."""
    model, tokenizer = load(str(tiny_model_dir))
    measured = measure_memory(model)
    fills = {f"fill-{i}": tokenizer.encode(text)
             for i, text in enumerate(["Hello", "What is 2 + 2?", "The quick brown fox", "SELECT name FROM users"])}
    big = {"big": tokenizer.encode("Machine learning models learn patterns from data. " * 30)}
    room = max(measured.kv.num_bytes(len(prompt) + 8, 512) for prompt in fills.values())
    kv_budget = measured.kv.num_bytes(len(big["big"]) + 200, 512) + room
    config = EngineConfig(max_running=4, prefill_chunk=512, warmup_tokens=1,
                          memory_limit_bytes=measured.weights_bytes + kv_budget, prefix_cache_bytes=10 * kv_budget)
    served: dict[str, tuple[list[int], str]] = {}
    with recorded(model, config) as (engine, channel):
        for request_id, prompt in fills.items():  # one at a time: each leaves a snapshot of its prompt and output
            served.update(asyncio.run(serve(engine, {request_id: prompt}, {request_id: 8}, cancel_after={})))
        served.update(asyncio.run(serve(engine, big, {"big": 200}, cancel_after={})))
    assert "Evict" in kinds(channel)
    stats = check_replay(model, config, engine, channel, served, {**fills, **big})
    assert stats["num_evictions"] > 0
