"""The status page at / in a real headless browser: Playwright driving Debian's chromium (apt-get install
chromium) against a real server on loopback. A missing chromium fails the test; it is never skipped."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import free_port, serve_subprocess, write_config

CHROMIUM = Path("/usr/bin/chromium")
NO_EOS = {"0": -100.0, "2": -100.0}  # the tiny tokenizer's end-of-sequence ids: keep the request going
LONG = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 20000, "temperature": 0, "logit_bias": NO_EOS,
        "stream": True}
USER_KEY, ADMIN_KEY = "user-key-7f3a", "admin-key-91c2"
RUNNING_ROWS = "#running tbody tr[data-request-id]"
NUMBER = re.compile(r"^\d+(\.\d+)?$")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    with sync_playwright() as playwright:
        # Root (CI, containers) needs --no-sandbox; Playwright's own browser download is not used.
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield browser
        browser.close()


@contextlib.contextmanager
def long_stream(base: str, headers: dict[str, str] | None = None) -> Iterator[None]:
    """A streaming completion that keeps decoding until the block ends (closing it cancels the request)."""
    stop = threading.Event()

    def run() -> None:
        with httpx.stream("POST", base + "/v1/completions", json=LONG, headers=headers, timeout=60) as response:
            assert response.status_code == 200
            for _ in response.iter_bytes():
                if stop.is_set():
                    return

    thread = threading.Thread(target=run, name="long-stream", daemon=True)
    thread.start()
    try:
        wait_running(base, 1)
        yield
    finally:
        stop.set()
        thread.join(30)


def wait_running(base: str, expected: int, timeout: float = 30) -> None:
    """Until /metrics (open) reports ``expected`` running requests."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(base + "/metrics", timeout=10).text
        running = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "mlxd_running"]
        if running == [expected]:
            return
        assert time.monotonic() < deadline, f"mlxd_running is {running}, not {expected}"
        time.sleep(0.1)


def expect_live_data(page: Page) -> None:
    """The running request with its phase and tokens, then totals, memory and cache figures."""
    row = page.locator(RUNNING_ROWS)
    expect(row).to_have_count(1, timeout=15_000)
    cells = row.locator("td")
    expect(cells.nth(0)).to_have_text(row.get_attribute("data-request-id"))
    assert row.get_attribute("data-request-id").startswith("cmpl-")
    expect(cells.nth(1)).to_have_text("decode")
    expect(cells.nth(4)).to_have_text(NUMBER, timeout=10_000)  # tok/s, once two tokens are out
    assert int(cells.nth(3).inner_text()) > 0  # generated tokens
    expect(page.locator("#counts")).to_have_text("1 running · 0 waiting")
    expect(page.locator("#waiting tbody tr.empty")).to_have_count(1)
    totals = dict(zip(page.locator("#totals dt").all_inner_texts(), page.locator("#totals dd").all_inner_texts(),
                      strict=True))
    assert {"requests", "prompt tokens", "generated tokens"} <= set(totals)
    memory = dict(zip(page.locator("#memory dt").all_inner_texts(), page.locator("#memory dd").all_inner_texts(),
                      strict=True))
    assert {"active", "peak", "limit", "weights"} <= set(memory)
    assert memory["active"].endswith(("KiB", "MiB", "GiB"))
    cache = page.locator("#cache dt").all_inner_texts()
    assert {"entries", "size", "hits: exact", "misses", "evictions"} <= set(cache)
    [model] = page.locator("#models dd").all_inner_texts()  # the model's memory as the models' budget counts it
    assert model.startswith("ready · ") and " held (" in model and " KV, " in model and " prefix cache) " in model


def test_page_shows_the_running_request(browser, tiny_model_dir, tmp_path):
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port)
    with serve_subprocess(config, port) as (base, _), long_stream(base):
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        page.goto(base + "/")
        expect(page).to_have_title("mlxd status")
        expect(page.locator("#model")).to_have_text("tiny")
        expect_live_data(page)
        expect(page.locator("#key-form")).to_be_hidden()
        page.screenshot(path=tmp_path / "status-page.png", full_page=True)
        page.close()


def test_page_asks_for_a_key_and_keeps_it_for_the_session(browser, tiny_model_dir, tmp_path):
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port)
    env = {"MLXD_API_KEYS": USER_KEY, "MLXD_ADMIN_KEYS": ADMIN_KEY}
    with serve_subprocess(config, port, env=env) as (base, _), long_stream(base, {"x-api-key": USER_KEY}):
        context = browser.new_context(viewport={"width": 1280, "height": 760})
        page = context.new_page()
        page.goto(base + "/")
        form = page.locator("#key-form")
        expect(form).to_be_visible()
        expect(page.locator("#message")).to_contain_text("needs an API key")
        expect(page.locator(RUNNING_ROWS)).to_have_count(0)
        page.screenshot(path=tmp_path / "status-page-asks-for-a-key.png")

        # A valid key that is not an admin key: counts, but the page asks again for the request details.
        page.fill("#key-input", USER_KEY)
        page.click("#key-form button")
        expect(page.locator("#counts")).to_have_text("1 running · 0 waiting")
        expect(page.locator("#key-label")).to_have_text("Request details need an admin key:")
        expect(form).to_be_visible()
        expect(page.locator(RUNNING_ROWS)).to_have_count(0)

        page.fill("#key-input", ADMIN_KEY)
        page.press("#key-input", "Enter")
        expect_live_data(page)
        expect(form).to_be_hidden()
        expect(page.locator("#message")).to_be_empty()
        page.screenshot(path=tmp_path / "status-page-with-key.png", full_page=True)

        # The key lasts for the browser session: a reload does not ask again, a new session does.
        assert page.evaluate("sessionStorage.getItem('mlxd.key')") == ADMIN_KEY
        page.reload()
        expect(page.locator(RUNNING_ROWS)).to_have_count(1, timeout=15_000)
        expect(form).to_be_hidden()
        context.close()
        fresh = browser.new_page()
        fresh.goto(base + "/")
        expect(fresh.locator("#key-form")).to_be_visible()
        fresh.close()

    log = (tmp_path / f"server-{port}.log").read_text()
    assert "api_keys" in log
    assert USER_KEY not in log and ADMIN_KEY not in log
