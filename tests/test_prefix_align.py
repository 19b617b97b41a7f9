"""A prefix-cache hit is cut back to a multiple of the engine's alignment (16 tokens on GPU backends, so that the
shapes of a pass of rests repeat); the tokens cut run with the rest, and what comes out is what the whole prompt
gives from scratch."""

from __future__ import annotations

import asyncio

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Finished, Token
from mlxd.engine.engine import BatchedEngine
from mlxd.engine.prefix import PromptReuse

SHARED = [1 + (j * 13) % 700 for j in range(40)]


def kept(model, reuse: PromptReuse, prompt: list[int]) -> None:
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([layer.state for layer in cache])
    reuse.keep(prompt, cache)


def test_a_hit_is_trimmed_to_the_alignment_and_continues_like_the_whole_prompt(tiny_qwen3_dir):
    model, _ = load(str(tiny_qwen3_dir))
    reuse = PromptReuse(64 * 2**20, min_tokens=8, align=16)
    kept(model, reuse, SHARED)
    prompt = [*SHARED[:35], 901, 902, 903, 904, 905]
    hit = reuse.lookup(prompt)
    assert hit.kind == "diverged" and hit.num_cached == 32
    assert all(layer.offset == 32 for layer in hit.cache)
    logits = model(mx.array(prompt[32:])[None], cache=hit.cache)[0, -1]
    whole = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[0, -1]
    assert mx.allclose(logits, whole, atol=1e-4).item()

    assert reuse.cache.lookup(prompt, 8, align=16).num_cached == 32
    assert reuse.stats()["num_tokens_reused"] == 64  # what the two hits reuse, not what the entry held
    reuse.min_tokens = 33  # 32 would no longer be worth reusing: the hit stays as found
    assert reuse.lookup(prompt).num_cached == 35
    reuse.min_tokens = 8
    assert reuse.lookup(prompt, align=False).num_cached == 35  # an image prompt's hit: never cut
    reuse.align = 1
    assert reuse.lookup(prompt).num_cached == 35


def test_a_hit_that_cannot_be_trimmed_stays_as_found(tiny_qwen3_next_dir):
    """A hybrid model's recurrent layers cannot be cut back: its hit (40 tokens, where it was kept) stays whole."""
    model, _ = load(str(tiny_qwen3_next_dir))
    reuse = PromptReuse(64 * 2**20, min_tokens=8, align=16)
    kept(model, reuse, SHARED)
    hit = reuse.lookup([*SHARED, 901, 902])
    assert hit.cache is not None and hit.num_cached == 40


def test_aligned_hits_in_a_burst_equal_their_solo_outputs(tiny_qwen3_dir):
    """With the engine's alignment at 16, 4 requests starting with a 40-token prompt served before reuse 32 of its
    tokens (Finished says so), run in one pass of rests beside whole prompts, and each equals its solo output."""
    model, _ = load(str(tiny_qwen3_dir))
    engine = BatchedEngine(model, EngineConfig(max_running=16, prefix_cache_bytes=64 * 2**20, warmup_tokens=1,
                                               prefix_cache_min_tokens=32))
    engine.start()
    engine.reuse.align = 16
    engine.scheduler.max_pass_tokens = 16384
    prompts = [[*SHARED, *(2 + (i * 17 + j * 3) % 800 for j in range(10 + i))] if i % 2
               else [1 + (i * 31 + j * 7) % 900 for j in range(30 + i)] for i in range(8)]

    async def finish(request: EngineRequest) -> tuple[list[int], Finished]:
        tokens = []
        async for event in engine.submit(request).events():
            if isinstance(event, Finished):
                return tokens, event
            if isinstance(event, Token):
                tokens.append(event.token)
        raise AssertionError("no Finished")

    async def run():
        await finish(EngineRequest(request_id="seed", prompt=[*SHARED, 950], max_tokens=1))
        return await asyncio.gather(*(finish(EngineRequest(request_id=f"r{i}", prompt=p, max_tokens=5))
                                      for i, p in enumerate(prompts)))

    try:
        results = asyncio.run(run())
    finally:
        engine.stop()
    for i, (prompt, (tokens, finished)) in enumerate(zip(prompts, results, strict=True)):
        assert finished.num_cached_tokens == (32 if i % 2 else 0), (i, finished)
        solo = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=5)]
        assert tokens == solo, i
