"""http(s) image fetches, guarded against server-side request forgery.

Every address the host resolves to must be public; the connection goes to the checked address itself (a second DNS
answer cannot move it: DNS rebinding), with the URL's host in the Host header and as TLS server name; redirects are
followed by hand and checked the same way; one deadline covers resolution, connection, redirects and the body.
Proxy variables (``HTTP_PROXY`` ...) are ignored on purpose: a proxy would resolve the name again.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import cache
from typing import Any
from urllib.parse import urljoin, urlsplit

from mlxd.config.schema import VisionConfig
from mlxd.errors import RequestError

# socket.getaddrinfo's signature: (host, port, family=0, type=0, proto=0, flags=0) -> [(..., sockaddr)].
Resolver = Callable[..., list[tuple[Any, ...]]]

MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
CHUNK_BYTES = 64 * 1024
USER_AGENT = "mlxd-image-fetch"
# All of these are caught by the address classes too; listing them gives the clearer reason.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "169.254.0.23", "100.100.100.200", "fd00:ec2::254")
)
NAT64 = ipaddress.ip_network("64:ff9b::/96")
_DNS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mlxd-dns")


def fetch_remote(
    url: str,
    *,
    config: VisionConfig,
    param: str,
    resolver: Resolver | None = None,
    allow_hosts: Collection[str] = frozenset(),
) -> bytes:
    """GET an http(s) image from public addresses only, redirects (at most 5) checked alike, within
    ``config.remote_timeout_s`` and ``config.max_image_bytes``. Does not look at ``allow_remote``."""
    deadline = time.monotonic() + config.remote_timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        target = _Target.parse(url, param)
        addresses = _checked_addresses(target, resolver, allow_hosts, deadline, param)
        location, body = _get(target, addresses, config.max_image_bytes, deadline, param)
        if location is None:
            return body
        url = urljoin(url, location)
    raise RequestError(f"image URL redirected more than {MAX_REDIRECTS} times", param=param)


def address_refusal(address: str) -> str | None:
    """Why connecting to ``address`` is refused, or None for a public address. An IPv4-mapped IPv6 address is
    judged as its IPv4 address; NAT64, 6to4 and Teredo addresses by their IPv4 address and themselves."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    candidates: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):  # the IPv4 address inside first: it names the better reason
        teredo = ip.teredo[1] if ip.teredo else None
        nat64 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in NAT64 else None
        candidates = [a for a in (ip.sixtofour, teredo, nat64) if a is not None] + candidates
    for candidate in candidates:
        reason = _refusal(candidate)
        if reason:
            return reason
    return None


def _refusal(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    # Reserved before private: Python counts 240.0.0.0/4 as both, and "reserved" is the better name.
    for name in ("unspecified", "loopback", "link_local", "multicast", "reserved", "private"):
        if getattr(ip, f"is_{name}"):
            return f"a {name.replace('_', '-')} address"
    return None if ip.is_global else "not a globally routable address"


@dataclass(frozen=True)
class _Target:
    https: bool
    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str, param: str) -> _Target:
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https"):
            raise RequestError(f"image URL {preview(url)}: only http(s) can be fetched", param=param)
        try:
            port = parts.port
        except ValueError as e:
            raise RequestError(f"image URL {preview(url)} has an invalid port", param=param) from e
        if not parts.hostname or parts.username is not None:
            raise RequestError(f"image URL {preview(url)} needs a host and no credentials", param=param)
        https = parts.scheme.lower() == "https"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(https, parts.hostname, port or (443 if https else 80), path)

    def connection(self, address: str, timeout: float) -> http.client.HTTPConnection:
        kind = _PinnedHTTPSConnection if self.https else _PinnedHTTPConnection
        return kind(self.host, self.port, address=address, timeout=timeout)


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to one checked address while naming the URL's host (Host header; SNI and certificate for TLS)."""

    def __init__(self, host: str, port: int, *, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPSConnection(_PinnedHTTPConnection):
    default_port = 443

    def connect(self) -> None:
        super().connect()  # self.sock is the plain socket during the handshake, so the deadline can cut it
        self.sock = _tls_context().wrap_socket(self.sock, server_hostname=self.host)


@cache
def _tls_context() -> ssl.SSLContext:
    try:  # certifi's bundle where installed (the Python builds of macOS often have no usable system store)
        import certifi

        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:
        return ssl.create_default_context()


def _checked_addresses(
    target: _Target, resolver: Resolver | None, allow_hosts: Collection[str], deadline: float, param: str
) -> list[str]:
    addresses = _resolve(target, resolver, deadline, param)
    for address in addresses:
        if target.host in allow_hosts or address in allow_hosts:
            continue
        reason = address_refusal(address)
        if reason:
            raise RequestError(f"image host {target.host!r} resolves to {address}, {reason}", param=param)
    return addresses


def _resolve(target: _Target, resolver: Resolver | None, deadline: float, param: str) -> list[str]:
    with suppress(ValueError):
        return [str(ipaddress.ip_address(target.host))]
    future = _DNS.submit(resolver or socket.getaddrinfo, target.host, target.port, type=socket.SOCK_STREAM)
    try:
        infos = future.result(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError as e:
        raise _timed_out(param) from e
    except (OSError, UnicodeError) as e:
        raise RequestError(f"cannot resolve image host {target.host!r} ({e})", param=param) from e
    # The scope of a link-local IPv6 address ("fe80::1%eth0") is dropped: the address itself is refused.
    addresses = list(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))
    if not addresses:
        raise RequestError(f"image host {target.host!r} has no address", param=param)
    return addresses


def _get(
    target: _Target, addresses: list[str], max_bytes: int, deadline: float, param: str
) -> tuple[str | None, bytes]:
    """(Location, b"") for a redirect, (None, body) for a 200."""
    attempts: list[http.client.HTTPConnection] = []  # the last one is connecting or connected
    try:
        with _deadline_cuts(attempts, deadline):
            conn = _connect(target, addresses, deadline, param, attempts)
            conn.request("GET", target.path, headers={"Accept": "image/*", "User-Agent": USER_AGENT})
            response = conn.getresponse()
            if response.status in REDIRECT_STATUSES:
                location = response.getheader("Location")
                if not location:
                    raise RequestError("image URL redirected without a Location", param=param)
                return location, b""
            if response.status != 200:
                raise RequestError(
                    f"image URL answered HTTP {response.status} {response.reason}", param=param
                )
            body = _read_body(response, max_bytes, param)
    except (OSError, http.client.HTTPException) as e:
        if isinstance(e, TimeoutError) or time.monotonic() >= deadline:
            raise _timed_out(param) from e
        raise RequestError(f"fetching the image from {target.host!r} failed ({e!r})", param=param) from e
    finally:
        for conn in attempts:
            conn.close()
    if time.monotonic() >= deadline:  # a body cut short by the deadline can look complete
        raise _timed_out(param)
    return None, body


def _connect(
    target: _Target,
    addresses: list[str],
    deadline: float,
    param: str,
    attempts: list[http.client.HTTPConnection],
) -> http.client.HTTPConnection:
    """Connect to the first address that answers (all of them were checked)."""
    error: OSError | None = None
    for address in addresses:
        conn = target.connection(address, timeout=max(0.001, deadline - time.monotonic()))
        attempts.append(conn)
        try:
            conn.connect()
            return conn
        except TimeoutError:
            raise
        except OSError as e:
            conn.close()
            error = e
    raise RequestError(f"cannot connect to image host {target.host!r} ({error})", param=param)


@contextmanager
def _deadline_cuts(attempts: list[http.client.HTTPConnection], deadline: float) -> Iterator[None]:
    """Shut the current connection's socket at the deadline (a TLS handshake included): a server trickling bytes
    cannot outlast it."""

    def cut() -> None:
        sock = attempts[-1].sock if attempts else None
        if sock is not None:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), cut)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _read_body(response: http.client.HTTPResponse, max_bytes: int, param: str) -> bytes:
    length = (response.getheader("Content-Length") or "").strip()
    if length.isdigit() and int(length) > max_bytes:
        raise too_large(f"Content-Length {length}", max_bytes, param)
    chunks: list[bytes] = []
    size = 0
    while chunk := response.read(CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            raise too_large(f"more than {max_bytes} bytes", max_bytes, param)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(size: str, max_bytes: int, param: str) -> RequestError:
    return RequestError(f"image is too large: {size}; [vision] max_image_bytes is {max_bytes}", param=param)


def preview(url: str, limit: int = 80) -> str:
    """``url`` quoted for an error message, cut at ``limit`` characters (a data URI can be megabytes)."""
    return repr(url if len(url) <= limit else url[:limit] + "...")


def _timed_out(param: str) -> RequestError:
    return RequestError("fetching the image timed out ([vision] remote_timeout_s)", param=param)
