"""``/docs`` renders offline: Swagger UI's assets come with the package, so Chromium with every request outside
loopback aborted (and no host name resolving) still shows the API. A missing chromium fails the test."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, Route, expect, sync_playwright

from tests.helpers import free_port, serve_subprocess, write_config

CHROMIUM = Path("/usr/bin/chromium")
NO_NETWORK = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
URL = re.compile(rb"""(?:https?:)?//[^\s"'<>)]+""")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", NO_NETWORK])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    config = write_config(tmp_path_factory.mktemp("docs"), tiny_model_dir, port=port)
    with serve_subprocess(config, port) as (base, _):
        yield base


def test_docs_render_with_the_network_blocked(browser, server):
    requested: list[str] = []
    left_loopback: list[str] = []
    page_errors: list[str] = []

    def only_loopback(route: Route) -> None:
        url = route.request.url
        requested.append(url)
        if urlsplit(url).hostname == "127.0.0.1":
            route.continue_()
        else:
            left_loopback.append(url)
            route.abort()

    context = browser.new_context()
    page = context.new_page()
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    page.on("console", lambda msg: page_errors.append(msg.text) if msg.type == "error" else None)
    page.route("**/*", only_loopback)
    page.goto(server + "/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("mlxd", timeout=30_000)
    expect(page.locator(".opblock-summary-path", has_text=re.compile(r"^/v1/chat/completions$"))).to_have_count(1)
    context.close()
    assert left_loopback == []
    assert page_errors == []  # nothing refused by the page's CSP, no script error
    assert server + "/docs/assets/swagger-ui-bundle.js" in requested
    assert server + "/docs/openapi.json" in requested


def test_docs_html_names_no_other_server(server):
    response = httpx.get(server + "/docs", timeout=10)
    assert response.status_code == 200
    assert b"/docs/assets/swagger-ui-bundle.js" in response.content
    assert URL.findall(response.content) == []  # every script, style and icon is a path on this server
    policy = response.headers["content-security-policy"]
    assert "script-src 'self';" in policy and "default-src 'none'" in policy


def test_docs_assets_are_only_the_listed_files(server):
    assert httpx.get(server + "/docs/assets/docs-init.js", timeout=10).status_code == 200
    missing = httpx.get(server + "/docs/assets/swagger-editor-bundle.js", timeout=10)
    assert missing.status_code == 404
    assert "error" in missing.json()


def test_docs_and_their_assets_need_a_key_when_keys_are_set(tiny_model_dir, tmp_path):
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port)
    with serve_subprocess(config, port, env={"MLXD_API_KEYS": "docs-key-5e1d"}) as (base, _):
        for path in ("/docs", "/docs/openapi.json", "/docs/assets/swagger-ui-bundle.js"):
            assert httpx.get(base + path, timeout=10).status_code == 401, path
            assert httpx.get(base + path, headers={"x-api-key": "docs-key-5e1d"}, timeout=10).status_code == 200, path
