"""What a web page of another origin can make a daemon do, or read from it: nothing.

- A POST must declare a JSON body (``mlxd.api.body.check_media_type``, a 415 otherwise): without a
  ``Content-Type``, or with ``text/plain`` or a form type, a page may send it to any origin without a CORS preflight.
- A daemon bound to a loopback address answers only requests whose ``Host`` is a loopback name (``localhost``, a
  loopback address such as ``127.0.0.1`` or ``[::1]``, any port) or one of ``[server] allowed_hosts``; anything
  else is a 403. A page that points a name of its own at 127.0.0.1 (DNS rebinding) is same-origin with the daemon
  for the browser, but its requests carry that name.
- The status page is sent with a content security policy allowing only its own inline script and style (by hash)
  and requests to its own origin, and may not be framed.

Both checks are one app-wide guard (a coroutine doing no blocking work), run before the API keys are checked and
before a body is read, so their errors leave in each surface's error shape.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from mlxd.api.auth import Guard
from mlxd.api.body import check_media_type
from mlxd.api.errors import clip
from mlxd.config.schema import ServerConfig
from mlxd.errors import HostNotAllowed

ANY_HOST = "*"
NONE = "'none'"
_INLINE = re.compile(rb"<(script|style)>(.*?)</\1>", re.DOTALL)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is ``localhost`` or a loopback
    address."""
    host = host.strip().lower().rstrip(".")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a ``Host`` header: lower case, without its port, brackets or a final dot."""
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _arrived_on_loopback(connection: ASGIConnection) -> bool:
    # uvicorn sets `server` to the address the connection reached: a daemon bound to loopback reaches only these.
    server = connection.scope.get("server")
    return bool(server) and is_loopback(str(server[0]))


def make_origin_guard(server: ServerConfig) -> Guard:
    """The app-wide guard of the module docstring, for ``[server]`` ``host`` and ``allowed_hosts``."""
    allowed = {host_name(host) for host in server.allowed_hosts}
    check_host = is_loopback(server.host) and ANY_HOST not in allowed

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if check_host and _arrived_on_loopback(connection):
            header = connection.headers.get("host")
            if header is not None and not is_loopback(host_name(header)) and host_name(header) not in allowed:
                raise HostNotAllowed(f"this server answers requests for localhost only, not for "
                                     f"{clip(header)!r}; add the name to [server] allowed_hosts to serve it")
        if connection.scope.get("method") == "POST":
            check_media_type(connection.headers.get("content-type"))

    return guard


def _hash_source(text: bytes) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text).digest()).decode() + "'"


def page_headers(html: bytes) -> dict[str, str]:
    """Security headers for a page whose only scripts and styles are its inline ``<script>`` and ``<style>``
    elements (hashed from ``html`` here, once, so the policy cannot drift from the page)."""
    sources: dict[bytes, list[str]] = {b"script": [], b"style": []}
    for kind, body in _INLINE.findall(html):
        sources[kind].append(_hash_source(body))
    scripts, styles = (" ".join(sources[kind]) or NONE for kind in (b"script", b"style"))
    policy = [f"default-src {NONE}", f"script-src {scripts}", f"style-src {styles}", "connect-src 'self'",
              f"base-uri {NONE}", f"form-action {NONE}", f"frame-ancestors {NONE}"]
    return {
        "Content-Security-Policy": "; ".join(policy),
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }
