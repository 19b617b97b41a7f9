"""The engine's commands are its whole story: what a leader records, replayed on a fresh engine of the same model,
gives the same rows, the same outputs and the same prefix cache (mlxd/engine/commands.py, distributed/leader.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from mlx_lm import load

from mlxd.config.schema import DistributedConfig, EngineConfig
from mlxd.engine.base import EngineRequest, Finished, Progress, Token
from mlxd.engine.commands import Accept, Cancel, Drop, Stop
from mlxd.engine.core import EngineCore
from mlxd.engine.distributed.channel import STATS
from mlxd.engine.distributed.leader import make_leader_engine
from mlxd.engine.step.sampling import make_request_sampler

CONFIG = EngineConfig(max_running=4, prefill_chunk=8, step_token_budget=32, warmup_tokens=1)


class RecordingChannel:
    """A group of one that keeps every message rank 0 sends, and what rank 0's engine held when it sent it."""

    rank, size = 0, 1

    def __init__(self) -> None:
        self.engine: Any = None
        self.messages: list[Any] = []
        self.views: list[dict[str, Any]] = []

    def exchange(self, message: Any, stats: list[int]) -> tuple[Any, list[dict[str, int]]]:
        self.messages.append(message)
        self.views.append(view(self.engine.core))
        return message, [dict(zip(STATS, stats, strict=True))]

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


def replay(model: Any, channel: RecordingChannel) -> tuple[dict[str, list[int]], EngineCore]:
    """Apply the recorded messages to a fresh core, as a follower does, checking each view on the way; returns what
    each request had generated when it was let go."""
    core = EngineCore(model, CONFIG, make_sampler=make_request_sampler, channel=RecordingChannel(), follower=True)
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


def test_a_leaders_recorded_commands_replayed_reproduce_rows_outputs_and_prefix_cache(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    channel = RecordingChannel()
    settings = DistributedConfig(backend="ring", tensor_parallel=1, heartbeat_s=3600.0)
    engine = make_leader_engine(model, CONFIG, channel=channel, settings=settings)
    channel.engine = engine
    engine.start()
    try:
        text = "The engine applies commands; a follower applies the same commands and holds the same state. "
        long = tokenizer.encode(text * 2)  # several prompt chunks
        first = {"a": long, "b": tokenizer.encode("Short prompt."), "c": tokenizer.encode("Another one, a bit longer."),
                 "d": tokenizer.encode(text)}
        served = asyncio.run(serve(engine, first, {"a": 6, "b": 9, "c": 5, "d": 40}, cancel_after={"d": 4}))
        # The next turn of "a" starts from what the prefix cache kept of it.
        second = {"e": long + served["a"][0] + tokenizer.encode(" And the next turn."),
                  "f": tokenizer.encode("Short prompt.")}
        served.update(asyncio.run(serve(engine, second, {"e": 7, "f": 3}, cancel_after={})))
    finally:
        engine.stop()
    assert engine.failure is None
    assert served["d"][1] == "cancelled" and len(served["d"][0]) == 4
    assert {served[r][1] for r in "abcef"} == {"length"}
    kinds = [type(c).__name__ for m in channel.messages for c in [*m.commands, *([m.step] if m.step else [])]]
    assert {"Accept", "Cancel", "Keep", "Drop", "RunStep", "Stop"} <= set(kinds)
    assert any(m.step is not None and m.step.together for m in channel.messages)  # prompts that shared a pass
    assert sum(isinstance(c, Accept) for m in channel.messages for c in m.commands) == 6

    outputs, core = replay(model, channel)

    assert outputs == {request_id: tokens for request_id, (tokens, _) in served.items()}
    assert core.reuse.stats() == engine.reuse.stats()
    assert engine.reuse.stats()["num_hits"] >= 1  # "e" started from a kept state
    for request_id, prompt in {**first, **second}.items():
        key = prompt + served[request_id][0]
        leader_hit, replay_hit = engine.reuse.lookup(key), core.reuse.lookup(key)
        assert (leader_hit.kind, leader_hit.num_cached) == (replay_hit.kind, replay_hit.num_cached), request_id


def test_a_replayed_step_admits_what_the_plan_names():
    """Plain Python: a step planned elsewhere starts the waiting requests it names, in the scheduler too."""
    from mlxd.engine.schedule.scheduler import Scheduler, SequenceState

    scheduler = Scheduler(max_running=2, max_waiting=4, step_token_budget=64)
    states = [SequenceState(request_id=r, num_prompt_tokens=8, prefill_chunk=8, max_tokens=4) for r in "xyz"]
    for state in states:
        scheduler.add(state)
    scheduler.start(states[1])
    scheduler.start(states[1])  # admitted already: stays
    assert [s.request_id for s in scheduler.running] == ["y"] and states[1].phase == "prefill"
    assert [s.request_id for s in scheduler.waiting] == ["x", "z"]
