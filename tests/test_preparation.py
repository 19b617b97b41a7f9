"""Preparation (rendering, tokenizing, images) on workers of its own: bounded (429 beyond), counted by the drain,
stopped when the client leaves, never joined at exit; the key guard is a coroutine; image bounds and messages."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import structlog
import uvicorn
from PIL import Image

from mlxd.api.app import create_app
from mlxd.api.auth import Keys, make_guard
from mlxd.cli import load_everything
from mlxd.config.schema import VisionConfig
from mlxd.daemon import Daemon
from mlxd.errors import Overloaded, RequestError
from mlxd.media.images import PixelBudget, bound_pillow, decode_image
from mlxd.media.parts import find_image_parts, load_images
from mlxd.pipeline.job import Job
from mlxd.pipeline.pipeline import Pipeline
from mlxd.pipeline.preparation import Preparation
from mlxd.pipeline.stage import Stage
from mlxd.runtime.cancel import CancelFlag, Cancelled, check_cancelled
from tests.helpers import CHAT_PIPELINE, free_port, write_config

# The gate stage holds requests whose text says SLOW until GATE is set (at most 30 s), checking for cancellation
# every 10 ms as long loops in real stages do; each exit is recorded with its reason and time.
GATE = threading.Event()
EXITS: list[tuple[str, float]] = []


class Gate(Stage):
    name = "gate"

    def prepare(self, job: Job) -> None:
        if "SLOW" not in json.dumps(job.messages if job.messages is not None else job.prompt):
            return
        deadline = time.monotonic() + 30
        try:
            while not GATE.wait(0.01) and time.monotonic() < deadline:
                check_cancelled()
        except Cancelled:
            EXITS.append(("cancelled", time.monotonic()))
            raise
        EXITS.append(("released", time.monotonic()))


def _job(name: str = "r", text: str = "SLOW") -> Job:
    return Job(request_id=name, model="tiny", messages=[{"role": "user", "content": text}])


def test_workers_run_off_the_loop_in_the_callers_context():
    async def main() -> None:
        pool = Preparation(2)
        structlog.contextvars.bind_contextvars(request_id="abc")
        seen = await pool.submit(lambda: (threading.current_thread().name,
                                          structlog.contextvars.get_contextvars().get("request_id")),
                                 flag=CancelFlag())
        assert seen == ("mlxd-prepare-0", "abc")
        flag = CancelFlag()
        flag.set("gone")
        with pytest.raises(Cancelled, match="gone"):  # cancelled before a worker took it: never run
            await pool.submit(pytest.fail, "ran", flag=flag)
        assert pool.num_preparing == 0
        pool.close()

    asyncio.run(main())


def test_closing_never_waits_for_a_stuck_worker():
    stuck = threading.Event()

    async def main() -> None:
        pool = Preparation(1)
        pool.submit(stuck.wait, 60, flag=CancelFlag())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        pool.close()
        assert time.monotonic() - started < 0.1
        assert all(thread.daemon for thread in pool._threads)  # the interpreter's exit does not join them

    try:
        asyncio.run(main())
    finally:
        stuck.set()


def _gated_daemon(tmp_path: Path, tiny_model_dir: Path, server_extra: str = "") -> Daemon:
    config_path = write_config(tmp_path, tiny_model_dir, server_extra=server_extra)
    config, _ = load_everything(config_path)
    return Daemon(config, Pipeline([("gate", Gate(Gate.Config()))], "test"))


def test_beyond_max_preparing_is_429_and_the_drain_counts_preparing(tiny_model_dir, tmp_path):
    GATE.clear()
    daemon = _gated_daemon(tmp_path, tiny_model_dir, "prepare_workers = 1\nmax_preparing = 2")

    async def main() -> None:
        first = asyncio.ensure_future(daemon.models.first.prepare(_job("a"), CancelFlag()))
        second = asyncio.ensure_future(daemon.models.first.prepare(_job("b"), CancelFlag()))  # waits for the one worker
        await asyncio.sleep(0.1)
        assert daemon.preparation.num_preparing == 2
        with pytest.raises(Overloaded) as info:
            await daemon.models.first.prepare(_job("c", "fast"), CancelFlag())
        assert info.value.status == 429 and info.value.retry_after >= 1
        started = time.monotonic()
        await daemon.drain(0.3)  # both still held: the drain waits its timeout, then stops them
        assert 0.3 <= time.monotonic() - started < 1.5
        for task in (first, second):
            with pytest.raises(Cancelled) as stopped:
                await task
            assert stopped.value.status == 503 and "drain timeout" in stopped.value.message
        assert daemon.preparation.num_preparing == 0
        daemon.close()

    asyncio.run(main())


def test_the_key_guard_is_a_coroutine():
    guard = make_guard(Keys())
    assert asyncio.iscoroutinefunction(guard)


@contextlib.contextmanager
def _serve(config_path: Path) -> Iterator[tuple[str, Daemon]]:
    config, pipeline = load_everything(config_path)
    daemon = Daemon(config, pipeline, base_dir=config_path.parent)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(daemon), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not daemon.ready:
            assert time.monotonic() < deadline and daemon.state != "failed", daemon.error
            time.sleep(0.1)
        yield base, daemon
    finally:
        GATE.set()
        server.should_exit = True
        thread.join(30)


def _gated_pipeline(tmp_path: Path) -> str:
    stages = f'[[stages]]\ntype = "{__name__}:Gate"\n\n' + CHAT_PIPELINE.read_text()
    (tmp_path / "gated.toml").write_text(stages)
    return f'pipeline = "{tmp_path / "gated.toml"}"'


def test_a_client_that_leaves_frees_its_worker_and_a_full_queue_is_429(tiny_model_dir, tmp_path):
    GATE.clear()
    EXITS.clear()
    config = write_config(tmp_path, tiny_model_dir, pipeline=_gated_pipeline(tmp_path),
                          server_extra="prepare_workers = 1\nmax_preparing = 2")
    slow = {"model": "tiny", "messages": [{"role": "user", "content": "SLOW"}], "max_tokens": 4}
    with _serve(config) as (base, daemon):
        for stream in (False, True):
            left = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(base + "/v1/chat/completions", json={**slow, "stream": stream}, timeout=0.7)
            left = time.monotonic()
            deadline = left + 5
            while daemon.preparation.num_preparing and time.monotonic() < deadline:
                time.sleep(0.01)
            freed = time.monotonic() - left
            print(f"stream={stream}: the worker was free {freed * 1000:.0f} ms after the client left")
            assert EXITS and EXITS[-1][0] == "cancelled" and freed < 1.0
        results: dict[int, httpx.Response] = {}

        def post(i: int) -> None:
            results[i] = httpx.post(base + "/v1/chat/completions", json=slow, timeout=60)

        held = [threading.Thread(target=post, args=(i,)) for i in range(2)]
        for thread in held:
            thread.start()
        while daemon.preparation.num_preparing < 2:
            time.sleep(0.01)
        refused = httpx.post(base + "/v1/chat/completions", json={**slow, "messages": [
            {"role": "user", "content": "hi"}]}, timeout=10)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1, refused.text
        assert refused.json()["error"]["type"] == "rate_limit_error"
        anthropic = httpx.post(base + "/v1/messages", json=slow, timeout=10)
        assert anthropic.status_code == 529 and anthropic.json()["error"]["type"] == "overloaded_error"
        started = time.monotonic()
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        assert time.monotonic() - started < 0.5
        GATE.set()
        for thread in held:
            thread.join(60)
        assert [results[i].status_code for i in range(2)] == [200, 200]


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("L", (width, height), 7).save(out, "PNG")
    return out.getvalue()


def test_images_are_bounded_per_image_and_per_request_from_their_headers():
    big = _png(5000, 5000)
    with pytest.raises(RequestError, match=r"5000x5000 = 25000000 pixels.*max_decode_pixels") as info:
        decode_image(big, max_pixels=1 << 20, param="messages[0].content[1]", budget=PixelBudget(20_000_000))
    assert info.value.param == "messages[0].content[1]"
    parts = find_image_parts([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(_png(3000, 3000))}}
        for _ in range(3)]}], max_images=8)
    config = VisionConfig(max_decode_pixels=10_000_000, max_request_pixels=20_000_000, max_pixels=1 << 20)
    with pytest.raises(RequestError, match="max_request_pixels") as info:
        load_images(parts, config=config)
    assert info.value.param == "messages[0].content[2]"  # the third image passes the request's bound


def test_a_big_jpeg_counts_at_the_scale_it_decodes_at():
    out = io.BytesIO()
    Image.new("RGB", (8000, 6000), (10, 20, 30)).save(out, "JPEG", quality=50)
    decoded = decode_image(out.getvalue(), max_pixels=1 << 20, param="p", budget=PixelBudget(4_000_000))
    assert decoded.width * decoded.height <= 1 << 20


def test_pillows_own_bound_is_reported_as_ours(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    bound_pillow(10_000_000)
    with pytest.raises(RequestError, match=r"\(25000000 pixels\); at most 10000000 .*max_decode_pixels") as info:
        decode_image(_png(5000, 5000), max_pixels=1 << 20, param="p", budget=PixelBudget(10_000_000))
    assert info.value.param == "p" and "attack" not in info.value.message


@pytest.mark.parametrize("data", [b"not an image at all", _png(4, 4)[:40]])
def test_image_errors_show_no_object_reprs(data: bytes):
    with pytest.raises(RequestError, match="cannot be decoded") as info:
        decode_image(data, max_pixels=1 << 20, param="p")
    assert " at 0x" not in info.value.message and "<_io" not in info.value.message, info.value.message


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
