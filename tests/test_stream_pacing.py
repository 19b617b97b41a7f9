"""Paced token hand-overs (mlxd/engine/pacing.py, ``[engine] stream_updates_per_s``): with many streams each gets
its tokens together at most once an interval, first tokens and ends at once; the text, the logprobs and the stop
sequences a client gets are those of a token-by-token stream."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import msgspec
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.config.load import convert
from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Failed, Finished, Token, Tokens
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.pacing import StreamPacer
from mlxd.pipeline.events import ContentDelta, Done, TokenLogprobs
from mlxd.pipeline.job import Job
from mlxd.pipeline.stage import ModelInfo, PipelineContext
from mlxd.pipeline.stages.detokenize import Detokenize, DetokenizeConfig
from tests.helpers import app_client, collect, sse_events, write_config


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_streams_tokens_are_held_for_its_interval_and_go_together_in_order():
    clock = Clock()
    pacer = StreamPacer(8, clock)  # 4 streams: a stream's tokens at most every 0.5 s
    a, b = object(), object()
    assert pacer.release([(a, Token(1)), (b, Token(9))], 4) == [(a, Token(1)), (b, Token(9))]  # first tokens
    clock.now += 0.125
    assert pacer.release([(a, Token(2)), (b, Token(10))], 4) == [] and pacer.num_held == 2
    clock.now += 0.125
    assert pacer.release([(a, Token(3))], 4) == []
    clock.now += 0.25  # 0.5 s since both last went
    assert pacer.release([(a, Token(4))], 4) == [(a, Token(2)), (a, Token(3)), (a, Token(4)), (b, Token(10))]
    assert pacer.num_held == 0
    clock.now += 0.125
    assert pacer.release([(b, Token(11))], 4) == []  # b went with that release, 0.125 s ago
    clock.now += 0.375
    assert pacer.release([], 4) == [(b, Token(11))]
    clock.now += 1.0
    assert pacer.release([(b, Token(12))], 64) == []  # more streams, a longer interval (8 s)


def test_held_tokens_go_with_the_streams_end_and_a_flush():
    clock = Clock()
    pacer = StreamPacer(10, clock)
    a, b = object(), object()
    end = Finished(reason="length", num_prompt_tokens=3)
    pacer.release([(a, Token(1)), (b, Token(5))], 2)
    clock.now += 0.01
    assert pacer.release([(a, Token(2)), (b, Token(6))], 2) == []
    assert pacer.release([(a, Token(3)), (a, end)], 2) == [(a, Token(2)), (a, Token(3)), (a, end)]
    failed = Failed("gone", status=503)
    assert pacer.release([(b, failed)], 2) == [(b, Token(6)), (b, failed)]
    assert pacer._last == {}  # ended streams are forgotten
    c = object()
    pacer.release([(c, Token(1))], 2)
    assert pacer.release([(c, Token(2))], 2) == []
    assert pacer.release([], 2, flush=True) == [(c, Token(2))]


def test_a_stream_whose_tokens_come_further_apart_than_its_interval_is_never_held():
    clock = Clock()
    pacer = StreamPacer(1000, clock)  # one stream: an interval of 1 ms
    a = object()
    for token in range(20):
        clock.now += 0.007  # 143 tokens a second
        assert pacer.release([(a, Token(token))], 1) == [(a, Token(token))]
    assert StreamPacer(0, clock).release([(a, Token(1)), (a, Token(2))], 64) == [(a, Token(1)), (a, Token(2))]


def _stage(tiny_model_dir) -> tuple[Any, Detokenize]:
    tokenizer = load_tokenizer(tiny_model_dir)
    info = ModelInfo("tiny", 4096, frozenset(tokenizer.eos_token_ids), frozenset(tokenizer.eos_token_ids),
                     vocab_size=1000)
    stage = Detokenize(convert({}, DetokenizeConfig, "t"))
    stage.warm_up(PipelineContext(None, info, tokenizer, None))
    return tokenizer, stage


def _run(stage: Detokenize, job: Job, batches: list[list[Token]]) -> list[Any]:
    async def engine():
        for batch in batches:
            yield batch[0] if len(batch) == 1 else Tokens(tuple(batch))
        yield Finished(reason="length", num_prompt_tokens=0)

    async def go():
        return [event async for event in stage.stream(job, engine())]
    return asyncio.run(go())


def _seen(events: list[Any]) -> tuple[str, list[Any], Done]:
    text = "".join(e.text for e in events if isinstance(e, ContentDelta))
    entries = [entry for e in events if isinstance(e, TokenLogprobs) for entry in e.entries]
    return text, entries, events[-1]


def test_tokens_that_came_together_detokenize_as_one_by_one(tiny_model_dir):
    """Oracle: the same tokens fed one at a time. Random groupings, with logprobs, special tokens and stop strings
    that end the stream inside a group."""
    tokenizer, stage = _stage(tiny_model_dir)
    rng = random.Random(7)
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé 字 and more words follow here, STOP then after."
    ids = tokenizer.encode(text, add_special_tokens=False) + [next(iter(tokenizer.eos_token_ids))] + [5, 6]
    tokens = [Token(t, -0.5 - i / 100, ((t, -0.5),)) for i, t in enumerate(ids)]
    for stop in ([], ["STOP"], ["fox"], ["Ü"]):
        job = Job(request_id="p", model="tiny", prompt="x", stop=stop)
        one_by_one = _seen(_run(stage, job, [[t] for t in tokens]))
        for _ in range(10):
            batches, rest = [], list(tokens)
            while rest:
                n = rng.randint(1, 6)
                batches.append(rest[:n])
                rest = rest[n:]
            job = Job(request_id="p", model="tiny", prompt="x", stop=stop)
            assert _seen(_run(stage, job, batches)) == one_by_one, (stop, [len(b) for b in batches])


def test_paced_streams_equal_their_solo_output_with_fewer_hand_overs(tiny_qwen3_dir):
    """8 greedy streams at 20 hand-overs a second in all (a stream's tokens every 0.4 s): every stream's tokens equal
    its solo ``generate_step`` run, its first token is handed over alone, and its tokens go in fewer hand-overs than
    tokens (what the pacer released, per send, is recorded)."""
    model, _ = load(str(tiny_qwen3_dir))
    engine = BatchedEngine(model, EngineConfig(max_running=8, prefix_cache_bytes=0, warmup_tokens=1,
                                               stream_updates_per_s=20))
    engine.start()
    pacer, groups = engine.core.table.pacer, {}
    release = pacer.release

    def recorded(outbox, num_streams, *, flush=False):
        out, sizes = release(outbox, num_streams, flush=flush), {}
        for handle, event in out:
            if isinstance(event, Token):
                sizes[handle.request_id] = sizes.get(handle.request_id, 0) + 1
        for request_id, size in sizes.items():
            groups.setdefault(request_id, []).append(size)
        return out
    pacer.release = recorded
    requests = [EngineRequest(request_id=f"r{i}", prompt=[3 + i, 17, 29 + i], max_tokens=24) for i in range(8)]

    async def go():
        return await asyncio.gather(*(collect(engine.submit(r)) for r in requests))
    try:
        got = asyncio.run(go())
    finally:
        engine.stop()
    for request, (tokens, _) in zip(requests, got, strict=True):
        solo = [t for t, _ in generate_step(mx.array(request.prompt), model, max_tokens=request.max_tokens)]
        assert tokens == solo, request.request_id
        sizes = groups[request.request_id]
        assert sum(sizes) == 24 and sizes[0] == 1 and len(sizes) < 24, sizes


def test_paced_chat_streams_over_http_equal_their_unstreamed_answers(tmp_path, tiny_model_dir):
    """Four streaming chats at once, paced to a hand-over a second each: each stream's text and usage equal the same
    chat unstreamed, sent in fewer content frames than completion tokens."""
    config = write_config(tmp_path, tiny_model_dir, extra="[engine]\nstream_updates_per_s = 4\n")
    with app_client(config) as (client, _):
        def chat(i: int, stream: bool) -> Any:
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"Tell me about number {i}."}],
                    "max_tokens": 24, "stream": stream, "stream_options": {"include_usage": True}}
            if not stream:
                body.pop("stream_options")
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return sse_events(response.text) if stream else msgspec.json.decode(response.content)

        with ThreadPoolExecutor(4) as pool:
            streams = list(pool.map(lambda i: chat(i, True), range(4)))
        for i, frames in enumerate(streams):
            answer = chat(i, False)
            contents = [f["choices"][0]["delta"].get("content") for f in frames[:-1]
                        if isinstance(f, dict) and f["choices"] and f["choices"][0]["delta"].get("content")]
            assert "".join(contents) == answer["choices"][0]["message"]["content"]
            assert frames[-2]["usage"] == answer["usage"]
            assert len(contents) < answer["usage"]["completion_tokens"], (len(contents), answer["usage"])
