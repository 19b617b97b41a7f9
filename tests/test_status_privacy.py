"""``/v1/status`` never shows one client's prompt to another: rendered prompts appear only for an admin key, and only
with ``[server] status_shows_prompts = true``. Real servers on loopback, two tenants' requests running at once."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, serve_subprocess, write_config
from tests.test_status_page import NO_EOS, wait_running

TENANTS = {"tenant-a": "key-tenant-a-51c9", "tenant-b": "key-tenant-b-77e0"}
ADMIN_KEY = "admin-key-0d3f"
SECRETS = {name: f"secret words of {name} zq{i}x" for i, name in enumerate(TENANTS)}


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@contextlib.contextmanager
def streams(base: str, keys: dict[str, str | None]) -> Iterator[None]:
    """Each tenant's streaming completion of its secret prompt, decoding until the block ends."""
    stop = threading.Event()

    def run(name: str, key: str | None) -> None:
        body = {"model": "tiny", "prompt": SECRETS[name], "max_tokens": 20000, "temperature": 0,
                "logit_bias": NO_EOS, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers(key), timeout=60) as response:
            assert response.status_code == 200
            for _ in response.iter_bytes():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in keys.items()]
    for thread in threads:
        thread.start()
    try:
        wait_running(base, len(threads))
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


def server_lines(tmp: Path, *, tenants: bool, admin: bool, show: bool) -> str:
    lines = []
    if tenants:
        (tmp / "api.keys").write_text("\n".join(TENANTS.values()) + "\n")
        lines.append('api_keys_file = "api.keys"')
    if admin:
        (tmp / "admin.keys").write_text(ADMIN_KEY + "\n")
        lines.append('admin_keys_file = "admin.keys"')
    if show:
        lines.append("status_shows_prompts = true")
    return "\n".join(lines)


def shown_secrets(base: str, key: str | None) -> set[str]:
    """The tenants whose prompt the status (and the other read-only endpoints) show to ``key``."""
    texts = [httpx.get(base + path, headers=headers(key), timeout=10).text
             for path in ("/v1/status", "/v1/cache/stats", "/metrics", "/")]
    return {name for name, secret in SECRETS.items() if any(secret in text for text in texts)}


def status_lists(base: str, key: str | None) -> bool:
    body = httpx.get(base + "/v1/status", headers=headers(key), timeout=10).json()
    return body["num_running"] == 2 and len(body.get("running", [])) == 2


# (keys files, status_shows_prompts) -> what each caller sees: request lists, and whose prompts.
CASES = {
    "tenants+admin, prompts on": (dict(tenants=True, admin=True, show=True),
                                  {"tenant-a": (False, set()), "tenant-b": (False, set()),
                                   "admin": (True, set(SECRETS))}),
    "tenants+admin, prompts off": (dict(tenants=True, admin=True, show=False),
                                   {"tenant-a": (False, set()), "tenant-b": (False, set()), "admin": (True, set())}),
    # Every API key is an admin key for the request lists, but prompts need a key from the admin keys.
    "tenants only, prompts on": (dict(tenants=True, admin=False, show=True),
                                 {"tenant-a": (True, set()), "tenant-b": (True, set())}),
    "no keys": (dict(tenants=False, admin=False, show=False), {"anyone": (True, set())}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_status_shows_prompts_only_to_admins_who_asked(case, tiny_model_dir, tmp_path):
    config_keys, expected = CASES[case]
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port=port, server_extra=server_lines(tmp_path, **config_keys))
    keys = {**TENANTS, "admin": ADMIN_KEY, "anyone": None}
    with serve_subprocess(config, port, env={"MLXD_API_KEYS": "", "MLXD_ADMIN_KEYS": ""}) as (base, _), \
            streams(base, {name: keys[name] if config_keys["tenants"] else None for name in TENANTS}):
        for caller, (lists, secrets) in expected.items():
            assert status_lists(base, keys[caller]) == lists, caller
            assert shown_secrets(base, keys[caller]) == secrets, caller
        if expected.get("admin", (False, set()))[1]:  # the prompt is the rendered one, clipped, under each request's entry
            running = httpx.get(base + "/v1/status", headers=headers(ADMIN_KEY), timeout=10).json()["running"]
            assert sorted(SECRETS[name] in entry["prompt"] for entry in running for name in SECRETS) == [
                False, False, True, True]
