"""The prefix cache's disk tier: a restarted daemon answers from disk what it answered before; a truncated, altered
or foreign file is a miss, a log line and a correct answer; the folder stays within its bound."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import structlog
from mlx_lm import load

from mlxd.config import load_config
from mlxd.config.schema import EngineConfig
from mlxd.engine.base import EngineRequest, Finished
from mlxd.engine.engine import BatchedEngine
from mlxd.errors import ConfigError
from tests.helpers import free_port, run_request, serve_subprocess, write_config
from tests.support.tiny import tiny_model_cached

SYSTEM = "You are a coding agent. " + "Read the files before editing them, and run the tests after each change. " * 14
LONG_TEXT = "The first turn of a long conversation about parsers, tokens and tests. " * 20


def chat(base: str) -> dict:
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the parser."}]}
    response = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_restarted_daemon_answers_from_disk(tiny_model_dir, tmp_path):
    extra = '[engine]\nprefill_chunk = 128\nprefix_cache_dir = "prefix-cache"\n'
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port, extra=extra)
    with serve_subprocess(config, port) as (base, proc):
        first = chat(base)
    assert proc.returncode == 0  # SIGTERM: drained, the entries in memory written, exit 0
    log_a = (tmp_path / f"server-{port}.log").read_text()
    persisted = [msgspec.json.decode(line) for line in log_a.splitlines() if "prefix_disk_persisted" in line]
    assert persisted and persisted[0]["complete"] and persisted[0]["num_files"] >= 1, log_a[-2000:]
    files = list((tmp_path / "prefix-cache").rglob("*.safetensors"))
    assert files and not list((tmp_path / "prefix-cache").rglob(".tmp-*"))

    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port, extra=extra)
    with serve_subprocess(config, port) as (base, _):
        second = chat(base)
        status = httpx.get(base + "/v1/status", timeout=10).json()
        metrics = httpx.get(base + "/metrics", timeout=10).text
    usage = second["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    print(f"restart: {cached} of {usage['prompt_tokens']} prompt tokens from disk")
    assert cached >= 0.9 * usage["prompt_tokens"] and usage == first["usage"] | {"prompt_tokens_details": {
        "cached_tokens": cached}}
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    disk = status["prefix_disk"]
    assert disk["num_hits"] == 1 and disk["num_errors"] == 0 and disk["num_bytes_read"] >= files[0].stat().st_size
    assert 'mlxd_prefix_disk_hits_total{model="tiny"} 1.0' in metrics
    assert 'mlxd_prefix_disk_errors_total{model="tiny"} 0.0' in metrics


# ---- an engine on the tiny model, for the files' failure modes ----

@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return load(str(tiny_model_dir))


def run(engine: BatchedEngine, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], Finished]:
    return run_request(engine, EngineRequest(request_id=f"r{id(prompt)}-{len(prompt)}", prompt=prompt,
                                             max_tokens=max_tokens))


def started(model, folder: Path, **settings) -> BatchedEngine:
    engine = BatchedEngine(model, EngineConfig(max_running=2, prefill_chunk=128, prefix_cache_dir=str(folder),
                                               **settings))
    engine.start()
    return engine


def serve_and_stop(model, folder: Path, prompt: list[int], **settings) -> tuple[list[int], Finished, Path]:
    """One engine's answer to ``prompt``, and the folder of its files once it stopped (they are written then)."""
    engine = started(model, folder, **settings)
    try:
        tokens, finished = run(engine, prompt)
        own = Path(engine.cache_stats()["disk"]["folder"])
    finally:
        engine.stop()
    return tokens, finished, own


@pytest.mark.parametrize(("arch", "settings"), [
    ("llama", {"kv_bits": 8, "kv_group_size": 32}),  # mlxd's own quantized layer, written as mlx-lm's
    ("llama", {"kv_bits": 4, "kv_group_size": 32}),
    ("qwen3_next", {}),  # recurrent layers (ArraysCache) between attention layers: snapshots at chunk ends
])
def test_every_cache_kind_comes_back_from_disk_with_the_tokens_of_a_cold_run(tiny_models_root, tmp_path, arch,
                                                                             settings):
    heads = {"head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
    model, tokenizer = load(str(tiny_model_cached(tiny_models_root, arch, **heads)))
    prompt = tokenizer.encode(LONG_TEXT)
    engine = started(model, tmp_path, **settings)
    try:
        cold, first = run(engine, prompt)
        warm, in_memory = run(engine, prompt)  # what the memory tier gives the same prompt again
    finally:
        engine.stop()
    assert first.num_cached_tokens == 0 and in_memory.num_cached_tokens > 0 and warm == cold
    tokens, finished, _ = serve_and_stop(model, tmp_path, prompt, **settings)
    print(f"{arch} {settings}: {finished.num_cached_tokens} of {len(prompt)} from disk, "
          f"{in_memory.num_cached_tokens} from memory before the restart")
    assert (finished.num_cached_tokens, finished.cache_hit) == (in_memory.num_cached_tokens, in_memory.cache_hit)
    assert tokens == cold
    if arch == "llama":  # a hybrid model resumes at the last chunk boundary kept (no checkpoints without a template)
        assert finished.num_cached_tokens == len(prompt) - 1


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "when", "reason"), [
    ("truncated", "before", "bytes where the header describes"),  # found by the index's rebuild
    ("truncated", "after", "do not match its checksum"),  # found when read
    ("flipped", "before", "do not match its checksum"),
    ("foreign", "before", "another model's file"),
])
def test_a_bad_file_is_a_miss_a_log_line_and_a_correct_answer(llama, tiny_models_root, tmp_path, damage, when,
                                                              reason):
    model, tokenizer = llama
    prompt = tokenizer.encode(LONG_TEXT)
    expected, cold, folder = serve_and_stop(model, tmp_path / "cold", prompt)  # this model's folder name, cold
    assert cold.num_cached_tokens == 0
    root = tmp_path / "cache"
    if damage == "foreign":  # another model's file for the same prompt, put where this model's files are
        other, _ = load(str(tiny_model_cached(tiny_models_root, "llama", seed=1)))
        *_, other_folder = serve_and_stop(other, root, prompt)
        (root / folder.name).mkdir(parents=True)
        for path in other_folder.glob("*.safetensors"):
            path.rename(root / folder.name / path.name)
    else:
        serve_and_stop(model, root, prompt)
    (path,) = (root / folder.name).glob("*.safetensors")
    damaged = {"truncated": truncate, "flipped": flip, "foreign": lambda _: None}[damage]
    if when == "before":
        damaged(path)
    with structlog.testing.capture_logs() as logs:
        engine = started(model, root)
        try:
            if when == "after":
                damaged(path)
            tokens, finished = run(engine, prompt)
            disk = engine.cache_stats()["disk"]
            assert not path.exists()  # deleted (the engine writes its own entry for the prompt when it stops)
        finally:
            engine.stop()
    rejected = [e for e in logs if e["event"] == "prefix_disk_rejected"]
    assert len(rejected) == 1 and reason in rejected[0]["reason"] and rejected[0]["file"] == str(path), rejected
    assert finished.num_cached_tokens == 0 and tokens == expected
    assert disk["num_hits"] == 0 and disk["num_errors"] == 1 and disk["num_entries"] == 0


def test_the_folder_stays_within_its_bound_under_200_prompts(llama, tmp_path):
    model, tokenizer = llama
    entry = 256 * 512  # a snapshot holds its cache's buffers: 256-token steps of 512 bytes a token (this model)
    bound = 9 * entry
    engine = started(model, tmp_path / "cache", prefix_cache_bytes=3 * entry, prefix_cache_disk_bytes=bound,
                     prefix_cache_min_tokens=8)
    folder = Path(engine.cache_stats()["disk"]["folder"])
    largest, samples, done = [0], [0], threading.Event()

    def size_of(path: Path) -> int:
        try:
            return path.stat().st_size
        except FileNotFoundError:  # renamed or deleted by the writer between the listing and the read
            return 0

    def watch():  # the folder's size, every file (temporary ones too), as often as it can be read
        while not done.is_set():
            largest[0] = max(largest[0], sum(size_of(p) for p in folder.iterdir()))
            samples[0] += 1
            done.wait(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        prompts = [tokenizer.encode(f"{i} is the number of this prompt, about " + ("tests " * (i % 7 + 20)))
                   for i in range(200)]
        for prompt in prompts:
            run(engine, prompt, max_tokens=2)
        deadline = time.monotonic() + 60
        while (stats := engine.cache_stats()["disk"])["num_pending_writes"] and time.monotonic() < deadline:
            time.sleep(0.01)
        again, finished = run(engine, prompts[-1], max_tokens=2)  # the newest entry is on disk or in memory
    finally:
        done.set()
        watcher.join()
        engine.stop()
    print(f"200 prompts: largest folder {largest[0]} bytes (bound {bound}); {stats}")
    assert watcher.is_alive() is False and samples[0] >= 100  # the watcher sampled throughout, never died
    assert largest[0] <= bound and stats["num_bytes"] <= bound
    assert stats["num_writes"] >= 100 and stats["num_evictions"] >= 50 and stats["num_entries"] >= 3
    assert finished.num_cached_tokens == len(prompts[-1]) - 1
    assert sum(p.stat().st_size for p in folder.iterdir()) <= bound


def test_prefix_cache_dir_is_checked_and_taken_from_the_config_folder(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, extra='[engine]\nprefix_cache_dir = "cache/prefix"\n')
    assert load_config(config).engine.prefix_cache_dir == str(tmp_path.resolve() / "cache" / "prefix")
    config = write_config(tmp_path, tiny_model_dir,
                          extra='[engine]\nprefix_cache_dir = "cache"\nprefix_cache_bytes = 0\n')
    with pytest.raises(ConfigError, match=r"mlxd\.toml: engine\.prefix_cache_dir: .*prefix_cache_bytes is 0"):
        load_config(config)
    config = write_config(tmp_path, tiny_model_dir, extra='[engine]\nprefix_cache_dir = "c"\n[distributed]\n')
    with pytest.raises(ConfigError, match=r"mlxd\.toml: engine\.prefix_cache_dir: \[distributed\] has no disk tier"):
        load_config(config)
    config = write_config(tmp_path, tiny_model_dir, extra='[engine]\nprefix_cache_disk_bytes = -1\n')
    with pytest.raises(ConfigError, match=r"mlxd\.toml: engine\.prefix_cache_disk_bytes: Expected `int` >= 1"):
        load_config(config)


def test_a_hit_from_disk_names_its_entry_and_discarding_it_deletes_the_file(llama, tmp_path):
    model, tokenizer = llama
    prompt = tokenizer.encode(LONG_TEXT)
    generated, _, folder = serve_and_stop(model, tmp_path, prompt)
    (path,) = folder.glob("*.safetensors")
    engine = started(model, tmp_path)
    try:
        cache = engine.reuse.cache
        hit = cache.lookup(prompt)
        # The entry holds the prompt and (some of) the answer; the prompt gets all its tokens but the last.
        assert hit.kind == "longer" and hit.num_cached == len(prompt) - 1
        assert hit.entry[: len(prompt) + 1] == (*prompt, generated[0])
        assert cache.discard(hit.entry) and not path.exists()
        assert cache.lookup(prompt).kind == "miss" and cache.stats()["disk"]["num_entries"] == 0
    finally:
        engine.stop()


def test_a_hit_from_disk_is_cut_back_to_the_alignment(llama, tmp_path):
    """A hit read back from disk is aligned as a memory hit is: its state trimmed to a multiple of 16 tokens, and
    the tokens reused counted as such."""
    model, tokenizer = llama
    prompt = tokenizer.encode(LONG_TEXT)
    serve_and_stop(model, tmp_path, prompt)
    engine = started(model, tmp_path)
    try:
        hit = engine.reuse.cache.lookup(prompt, 1, align=16)
        assert (len(prompt) - 1) % 16 and hit.num_cached == (len(prompt) - 1) // 16 * 16
        assert all(layer.offset == hit.num_cached for layer in hit.cache)
        assert engine.reuse.stats()["num_tokens_reused"] == hit.num_cached
    finally:
        engine.stop()


def test_a_folder_that_cannot_be_used_stops_the_start_naming_the_field(llama, tmp_path):
    model, _ = llama
    (tmp_path / "a-file").write_text("not a folder")
    engine = BatchedEngine(model, EngineConfig(max_running=1, prefix_cache_dir=str(tmp_path / "a-file")))
    with pytest.raises(ConfigError, match=r"engine\.prefix_cache_dir: cannot use .*a-file"):
        engine.start()


def _snapshot(num_tokens: int, seed: int):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxd.cache.store import take_snapshot

    layer = KVCache()
    key = mx.random.key(seed)
    layer.update_and_fetch(mx.random.normal((1, 2, num_tokens, 16), key=key),
                           mx.random.normal((1, 2, num_tokens, 16), key=key + 1))
    return take_snapshot([layer])


def test_a_reopened_tier_keeps_its_entries_in_their_order_and_drops_cut_writes(tmp_path):
    import mlx.core as mx

    from mlxd.cache.disk import DiskTier

    identity = {"weights": "w", "kv_bits": 16}
    tier = DiskTier(tmp_path, 10 * 1024**2, identity)
    tier.open()
    prompts = {name: tuple(range(start, start + 40)) for name, start in (("a", 0), ("b", 1000), ("c", 2000))}
    written = {tokens: _snapshot(len(tokens), seed) for seed, tokens in enumerate(prompts.values())}
    for tokens, snapshot in written.items():
        assert tier.submit(tokens, snapshot)
        assert tier.flush(30)
    hit = tier.lookup(prompts["a"] + (7,), 1, 0)  # "a" is now the most recently used
    assert hit is not None and hit[1] == prompts["a"]
    tier.close()
    (tier.folder / ".tmp-cut-short.safetensors").write_bytes(b"half a file")
    size = max(p.stat().st_size for p in tier.folder.glob("*.safetensors"))

    again = DiskTier(tmp_path, 2 * size, identity)  # room for two: the least recently used ("b") goes
    again.open()
    try:
        assert sorted(p.name for p in again.folder.iterdir() if p.name.startswith(".")) == []
        assert again.stats()["num_entries"] == 2 and again.stats()["num_evictions"] == 1
        assert again.lookup(prompts["b"] + (7,), 1, 0) is None
        for name in ("a", "c"):
            match, tokens, snapshot = again.lookup(prompts[name] + (7,), 1, 0)
            assert (match.num_tokens, tokens, snapshot.trimmable) == (40, prompts[name], True)
            (_, state, _), (_, original, _) = snapshot.layers[0], written[tokens].layers[0]
            assert state[2] == original[2]
            assert mx.array_equal(state[0], original[0]) and mx.array_equal(state[1], original[1])
        assert DiskTier(tmp_path, 2 * size, {**identity, "kv_bits": 8}).folder != again.folder
    finally:
        again.close()
