"""Image inputs (mlxd.media): data URIs, local files, guarded remote fetches, decoding and the parts walk.

No test sends a packet anywhere but loopback: ``socket.create_connection`` is wrapped for every test so that a
connection to any other address is recorded and refused before a socket exists, and host names are only ever
resolved by injected resolvers (the default resolver sees IP literals only, numeric-only).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import TCPServer
from urllib.parse import parse_qs, urlsplit

import msgspec
import pytest
from PIL import Image

from mlxd.config.schema import DaemonConfig, VisionConfig
from mlxd.errors import RequestError
from mlxd.media import (
    address_refusal,
    collect_images,
    decode_image,
    find_image_parts,
    is_image_part,
    load_image_bytes,
)
from mlxd.media.images import MAX_DECODE_PIXELS, fit_pixels

P = "messages[0].content[0]"
REMOTE = VisionConfig(allow_remote=True, remote_timeout_s=5.0)
LOOPBACK = ("127.0.0.1", "::1")


def png(
    width: int = 40, height: int = 30, color: tuple[int, ...] = (10, 200, 30), mode: str = "RGB"
) -> bytes:
    out = io.BytesIO()
    Image.new(mode, (width, height), color).save(out, "PNG")
    return out.getvalue()


def _noise_jpeg() -> bytes:
    out = io.BytesIO()
    Image.frombytes("RGB", (32, 32), os.urandom(32 * 32 * 3)).save(out, "JPEG")
    return out.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def refused(url: str, match: str, config: VisionConfig = REMOTE, **kw) -> RequestError:
    with pytest.raises(RequestError, match=match) as info:
        load_image_bytes(url, config=config, param=P, **kw)
    assert info.value.status == 400 and info.value.param == P
    return info.value


def resolving(*addresses: str, calls: list[str] | None = None):
    """A getaddrinfo-shaped resolver answering every name with ``addresses`` (and recording the names)."""

    def resolve(host: str, port: int, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0):
        if calls is not None:
            calls.append(host)
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, type, 6, "", (a, port)) for a in addresses]

    return resolve


@pytest.fixture(autouse=True)
def connections(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every outgoing connection attempt; only loopback ones are really made. Names are never looked up."""
    attempts: list[tuple[str, int]] = []
    real_connect, real_resolve = socket.create_connection, socket.getaddrinfo

    def connect(address, *args, **kwargs):
        attempts.append(address[:2])
        if address[0] not in LOOPBACK:
            raise ConnectionRefusedError(f"test guard: no packets to {address[0]}")
        return real_connect(address, *args, **kwargs)

    def numeric_only(host, port, family=0, type=0, proto=0, flags=0):
        return real_resolve(host, port, family, type, proto, flags | socket.AI_NUMERICHOST)

    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setattr(socket, "getaddrinfo", numeric_only)
    return attempts


# ---- a local HTTP server ----


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.requests.append((self.path, self.headers.get("Host")))
        url = urlsplit(self.path)
        route = getattr(self, "route_" + url.path.strip("/"), None)
        if route is None:
            self.send_error(404)
            return
        route(parse_qs(url.query))

    def route_img(self, query) -> None:
        self._send(200, {"Content-Type": "image/png", "Content-Length": str(len(self.server.image))})
        self.wfile.write(self.server.image)

    def route_redirect(self, query) -> None:
        self._send(302, {"Location": query["to"][0], "Content-Length": "0"})

    def route_loop(self, query) -> None:
        self._send(302, {"Location": "/loop", "Content-Length": "0"})

    def route_big(self, query) -> None:
        self._send(200, {"Content-Length": str(10**9)})

    def route_stream(self, query) -> None:  # no Content-Length: the body ends when the connection closes
        self._send(200, {})
        try:
            for _ in range(64):
                self.wfile.write(b"\0" * 16384)
        except OSError:
            pass  # the client stopped reading, as it should

    def _send(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:  # HTTPServer's own looks its address up (getfqdn); this one does not
        TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def handle_error(self, request, client_address) -> None:
        pass


@pytest.fixture
def server():
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.requests, httpd.image = [], png()
    httpd.base = f"http://127.0.0.1:{httpd.server_port}"
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def fetch(url: str, config: VisionConfig = REMOTE, **kw) -> bytes:
    return load_image_bytes(
        url, config=config, param=P, allow_hosts=kw.pop("allow_hosts", {"127.0.0.1"}), **kw
    )


# ---- data URIs and decoding ----


def test_data_uri_round_trip_keeps_digest_size_and_pixels():
    encoded = png(40, 30, (10, 200, 30))
    text = {"type": "text", "text": "what is this?"}
    messages = [
        {"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": data_uri(encoded)}}]}
    ]
    [image] = collect_images(messages, config=VisionConfig())
    assert (image.message, image.part) == (0, 1)
    assert image.digest == hashlib.sha256(encoded).hexdigest()
    assert (image.width, image.height) == (40, 30) == image.image.size
    assert image.image.mode == "RGB" and image.image.getpixel((5, 5)) == (10, 200, 30)


def test_images_come_back_in_prompt_order():
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    red, green, blue = (_image(data_uri(png(8, 8, c))) for c in colors)
    text = {"type": "text", "text": "compare"}
    messages = [
        {"role": "user", "content": [red, text, green]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [text, blue]},
    ]
    images = collect_images(messages, config=VisionConfig())
    assert [(i.message, i.part) for i in images] == [(0, 0), (0, 2), (2, 1)]
    assert [i.image.getpixel((0, 0)) for i in images] == colors


def test_data_uri_size_limit_is_exact():
    encoded = png()
    assert (
        load_image_bytes(data_uri(encoded), config=VisionConfig(max_image_bytes=len(encoded)), param=P)
        == encoded
    )
    refused(data_uri(encoded), "too large", VisionConfig(max_image_bytes=len(encoded) - 1))


def test_oversized_data_uri_is_refused_before_decoding():
    # Not valid base64 at all: a size refusal proves the length was compared before anything was decoded.
    refused("data:image/png;base64," + "!" * 1_000_000, "too large", VisionConfig(max_image_bytes=1000))


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("data:image/png;base64,iVBO@@==", "not valid base64"),
        ("data:image/png;base64,iVBO\nRw0K", "not valid base64"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:text/plain;base64,aGVsbG8=", "not an image type"),
        ("data:image/png;base64,", "empty"),
        (base64.b64encode(_noise_jpeg()).decode(), "bare base64"),  # "/9j/...": not taken for a path
        ("images/cat.png", "unsupported image URL"),
    ],
)
def test_malformed_image_urls_are_refused(url: str, match: str):
    refused(url, match, VisionConfig())


@pytest.mark.parametrize("data", [b"definitely not an image", png()[:60], b"%!PS-Adobe-3.0 EPSF-3.0\n"])
def test_undecodable_data_is_refused(data: bytes):
    with pytest.raises(RequestError, match="cannot be decoded") as info:
        decode_image(data, max_pixels=10**6, param=P)
    assert info.value.param == P


def _png_header(width: int, height: int) -> bytes:
    """A well-formed PNG declaring ``width`` x ``height`` whose pixel data is a few bytes (one empty row)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0"))
        + chunk(b"IEND", b"")
    )


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("side", [100_000, 10_000])  # Pillow's own refusal; then ours, below Pillow's error
def test_decompression_bomb_is_refused_without_allocating(side: int):
    bomb = _png_header(side, side)
    assert len(bomb) < 100 and side * side > MAX_DECODE_PIXELS
    tracemalloc.start()
    started = time.monotonic()
    with pytest.raises(RequestError, match="too large to decode"):
        decode_image(bomb, max_pixels=4096 * 4096, param=P)
    elapsed, (_, peak) = time.monotonic() - started, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 1.0 and peak < 5 * 2**20


def test_large_image_is_downscaled_with_aspect_kept():
    image = Image.new("RGB", (3000, 1000), (255, 0, 0))
    image.paste((0, 0, 255), (1500, 0, 3000, 1000))
    out = io.BytesIO()
    image.save(out, "PNG")
    decoded = decode_image(out.getvalue(), max_pixels=30_000, param=P)
    assert decoded.image.size == (decoded.width, decoded.height) == (300, 100)
    assert decoded.image.getpixel((20, 50)) == (255, 0, 0) and decoded.image.getpixel((280, 50)) == (
        0,
        0,
        255,
    )


def test_large_jpeg_is_decoded_reduced_then_downscaled():
    out = io.BytesIO()
    Image.new("RGB", (4000, 3000), (200, 100, 50)).save(out, "JPEG", quality=90)
    decoded = decode_image(out.getvalue(), max_pixels=120_000, param=P)
    assert decoded.image.size == (400, 300)
    assert all(
        abs(a - b) <= 3 for a, b in zip(decoded.image.getpixel((200, 150)), (200, 100, 50), strict=True)
    )


@pytest.mark.parametrize(
    ("size", "limit", "expected"),
    [
        ((100, 50), 5000, (100, 50)),
        ((100_000, 1), 100, (100, 1)),
        ((1, 100_000), 100, (1, 100)),
        ((7, 3), 1, (1, 1)),
    ],
)
def test_fit_pixels(size, limit, expected):
    assert fit_pixels(*size, limit) == expected


@pytest.mark.parametrize("size", [(1920, 1080), (4032, 3024), (5000, 7), (33, 9999), (12345, 6789)])
def test_fit_pixels_keeps_aspect_within_a_pixel(size):
    width, height = fit_pixels(*size, 100_000)
    assert width * height <= 100_000
    assert abs(width - height * size[0] / size[1]) <= max(1.0, size[0] / size[1])


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    out = io.BytesIO()
    Image.new("RGB", (40, 20), (0, 0, 0)).save(out, "JPEG", exif=exif)
    assert decode_image(out.getvalue(), max_pixels=10**6, param=P).image.size == (20, 40)


def test_transparency_becomes_white_and_animation_gives_the_first_frame():
    clear = decode_image(png(4, 4, (0, 0, 0, 0), mode="RGBA"), max_pixels=100, param=P)
    assert clear.image.getpixel((1, 1)) == (255, 255, 255)
    out = io.BytesIO()
    frames = [Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))]
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert decode_image(out.getvalue(), max_pixels=100, param=P).image.getpixel((4, 4)) == (255, 0, 0)


def test_sixteen_bit_grey_is_scaled_not_clipped():
    assert (
        decode_image(png(4, 4, 40_000, mode="I;16"), max_pixels=100, param=P).image.getpixel((0, 0))
        == (155,) * 3
    )


# ---- the parts walk ----


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_too_many_images_names_the_first_part_over_before_loading_any():
    remote = "http://198.51.100.7/x.png"  # never fetched: the count is checked first (and remote is off)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [_image(remote), {"type": "text", "text": "and"}, _image(remote)]},
        {"role": "user", "content": [_image(remote)]},
    ]
    with pytest.raises(RequestError, match="too many images: at most 2") as info:
        collect_images(messages, config=VisionConfig(max_images=2))
    assert info.value.param == "messages[2].content[0]"
    with pytest.raises(RequestError, match="at most 0") as info:
        find_image_parts(messages, max_images=0)
    assert info.value.param == "messages[1].content[0]"


@pytest.mark.parametrize("kind", ["video_url", "input_video", "video"])
def test_video_parts_are_refused_naming_the_part(kind: str):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": kind, kind: {"url": "v.mp4"}}]}
    ]
    with pytest.raises(RequestError, match="video input is not supported") as info:
        collect_images(messages, config=VisionConfig())
    assert info.value.param == "messages[0].content[1]" and info.value.status == 400


def test_image_part_shapes():
    parts = [
        {"type": "image_url", "image_url": "http://a/1.png"},
        {"type": "input_image", "image_url": "http://a/2.png", "detail": "low"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "http://a/4.png"}},
        {"type": "image", "image": "/srv/5.png"},
    ]
    urls = [p.url for p in find_image_parts([{"role": "user", "content": parts}], max_images=8)]
    assert urls == [
        "http://a/1.png",
        "http://a/2.png",
        "data:image/png;base64,AAAA",
        "http://a/4.png",
        "/srv/5.png",
    ]
    messages = [{"role": "user", "content": "no parts"}, {"role": "user", "content": ["x", *parts]}]
    assert [p.param for p in find_image_parts(messages, max_images=8)] == [
        f"messages[1].content[{j}]" for j in range(1, 6)]
    assert not is_image_part("x") and not is_image_part({"type": "text", "text": "image_url"})
    for bad, match in [
        ({"type": "input_image", "file_id": "f"}, "file_id"),
        ({"type": "image_url"}, "no URL"),
    ]:
        with pytest.raises(RequestError, match=match) as info:
            find_image_parts([{"role": "user", "content": ["x", bad]}], max_images=8)
        assert info.value.param == "messages[0].content[1]"


# ---- local files ----


@pytest.fixture
def files(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    (root / "cat.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png(2, 2))
    (tmp_path / "images-evil").mkdir()
    (tmp_path / "images-evil" / "x.png").write_bytes(png(3, 3))
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    (root / "alias.png").symlink_to(root / "cat.png")
    return tmp_path, VisionConfig(local_dir=str(root))


def test_local_files_inside_local_dir_are_read(files):
    tmp, config = files
    for url in (f"file://{tmp}/images/cat.png", f"{tmp}/images/cat.png", f"file://{tmp}/images/alias.png"):
        assert load_image_bytes(url, config=config, param=P) == png()
    relative = VisionConfig(local_dir="images")
    assert load_image_bytes(f"file://{tmp}/images/cat.png", config=relative, param=P, base_dir=tmp) == png()


def test_local_escapes_are_refused(files):
    tmp, config = files
    for url in (
        f"file://{tmp}/secret.png",
        f"file://{tmp}/images/../secret.png",
        f"{tmp}/images/./../secret.png",
        f"file://{tmp}/images/escape.png",  # a symlink out
        f"file://{tmp}/images-evil/x.png",  # a sibling whose name starts like the folder's
    ):
        refused(url, "outside", config)
    refused(f"file://{tmp}/images/cat.png", "local_dir is not set", VisionConfig())
    refused(f"file://example.com{tmp}/images/cat.png", "not local", config)


def test_local_file_errors(files):
    tmp, config = files
    os.mkfifo(tmp / "images" / "pipe.png")
    refused(f"{tmp}/images/pipe.png", "not a regular file", config)  # and does not block
    refused(f"{tmp}/images", "not a regular file", config)
    refused(f"{tmp}/images/missing.png", "cannot read", config)
    refused(
        f"{tmp}/images/cat.png", "too large", VisionConfig(local_dir=config.local_dir, max_image_bytes=10)
    )


# ---- remote fetches ----


def test_remote_is_refused_unless_allowed(server, connections):
    refused(f"{server.base}/img", "allow_remote is false", VisionConfig(), allow_hosts={"127.0.0.1"})
    assert connections == [] and server.requests == []


def test_remote_fetch_from_the_local_server(server, connections):
    assert fetch(f"{server.base}/img") == server.image
    assert connections == [("127.0.0.1", server.server_port)]


def test_connection_goes_to_the_checked_address_with_the_host_named(server, connections):
    calls: list[str] = []
    resolver = resolving("127.0.0.1", calls=calls)
    url = f"http://images.test:{server.server_port}/redirect?to=/img"
    assert fetch(url, resolver=resolver, allow_hosts={"images.test"}) == server.image
    assert calls == ["images.test", "images.test"]  # once per hop, by our resolver only
    assert connections == [("127.0.0.1", server.server_port)] * 2
    assert {host for _, host in server.requests} == {f"images.test:{server.server_port}"}


REFUSED_ADDRESSES = [
    ("127.0.0.1", "loopback"),
    ("::1", "loopback"),
    ("169.254.169.254", "cloud metadata"),
    ("fd00:ec2::254", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"),
    ("10.0.0.1", "private"),
    ("10.200.3.4", "private"),
    ("172.16.0.1", "private"),
    ("192.168.1.10", "private"),
    ("fd12:3456:789a::1", "private"),
    ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:10.0.0.1", "private"),
    ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
    ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
    ("fe80::1", "link-local"),
    ("169.254.1.1", "link-local"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("224.0.0.1", "multicast"),
    ("240.0.0.1", "reserved"),
    ("100.64.0.1", "not a globally routable"),
]


@pytest.mark.parametrize(("address", "reason"), REFUSED_ADDRESSES)
def test_refused_addresses_are_refused_before_connecting(address: str, reason: str, connections):
    assert reason in address_refusal(address)
    literal = f"[{address}]" if ":" in address else address
    refused(f"http://{literal}/img", reason)
    refused(f"https://{literal}:8443/img", reason)
    calls: list[str] = []
    refused("http://images.example.com/img", reason, resolver=resolving(address, calls=calls))
    refused(
        "http://images.example.com/img", reason, resolver=resolving("93.184.216.34", address)
    )  # any of them
    assert calls == ["images.example.com"] and connections == []


def test_public_addresses_pass_and_numeric_tricks_are_resolved_first(connections):
    for address in ("93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"):
        assert address_refusal(address) is None
    # A public answer is connected to at that address (the test guard refuses the packet itself).
    refused("http://images.example.com/img", "cannot connect", resolver=resolving("93.184.216.34"))
    assert connections == [("93.184.216.34", 80)]
    # 127.0.0.1 spelled as inet_aton reads it: judged by the address it resolves to (a C library that does not
    # read these forms cannot connect to them either).
    for url in ("http://2130706433/img", "http://0x7f.1/img", "http://127.1/img"):
        refused(url, "loopback|cannot resolve")
    assert connections == [("93.184.216.34", 80)]


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
        ("http://internal.test/x.png", "private"),
        ("http://[::ffff:127.0.0.1]:1/x.png", "loopback"),
        ("file:///etc/passwd", "only http"),
    ],
)
def test_redirects_are_checked_like_the_first_url(server, connections, target: str, match: str):
    refused(
        f"{server.base}/redirect?to={target}",
        match,
        allow_hosts={"127.0.0.1"},
        resolver=resolving("10.0.0.1"),
    )
    assert connections == [("127.0.0.1", server.server_port)]


def test_redirects_are_limited(server):
    refused(f"{server.base}/loop", "redirected more than 5 times", allow_hosts={"127.0.0.1"})
    assert len(server.requests) == 6


def test_size_limits_while_fetching(server):
    small = VisionConfig(allow_remote=True, max_image_bytes=100_000)
    refused(f"{server.base}/big", "Content-Length 1000000000", small, allow_hosts={"127.0.0.1"})
    refused(f"{server.base}/stream", "more than 100000 bytes", small, allow_hosts={"127.0.0.1"})
    refused(f"{server.base}/missing", "HTTP 404", small, allow_hosts={"127.0.0.1"})


@pytest.fixture
def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock
    sock.close()


def _timed_refusal(url: str, timeout: float, **kw) -> float:
    started = time.monotonic()
    refused(url, "timed out", VisionConfig(allow_remote=True, remote_timeout_s=timeout), **kw)
    return time.monotonic() - started


def test_timeout_when_the_server_never_answers(listener):
    # Connected (the kernel's backlog accepts) but never answered.
    elapsed = _timed_refusal(
        f"http://127.0.0.1:{listener.getsockname()[1]}/img", 0.3, allow_hosts={"127.0.0.1"}
    )
    assert 0.25 < elapsed < 2.0


@pytest.mark.parametrize(
    ("scheme", "head", "byte"),
    [
        ("http", b"HTTP/1.0 200 OK\r\nX-Slow: ", b"a"),  # a header that never ends
        ("https", b"\x16\x03\x03\x40\x00", b"\x02"),  # a 16 KiB TLS handshake record, a byte at a time
    ],
)
def test_timeout_covers_the_whole_fetch_when_the_server_trickles(listener, scheme, head, byte):
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        give_up = time.monotonic() + 5.0  # so that a client without a whole-fetch deadline fails, not hangs
        with conn:
            conn.sendall(head)
            while not stop.wait(0.05) and time.monotonic() < give_up:  # each byte well inside a read timeout
                conn.sendall(byte)

    threading.Thread(target=trickle, daemon=True).start()
    url = f"{scheme}://127.0.0.1:{listener.getsockname()[1]}/img"
    try:
        elapsed = _timed_refusal(url, 0.5, allow_hosts={"127.0.0.1"})
    finally:
        stop.set()
    assert elapsed < 2.0


def test_timeout_covers_name_resolution():
    def slow(host, port, **kwargs):
        time.sleep(1.0)
        return resolving("93.184.216.34")(host, port)

    assert _timed_refusal("http://slow.example/img", 0.2, resolver=slow) < 0.8


# ---- config and layering ----


def test_vision_config_table():
    config = msgspec.convert(
        {"model": {"source": "m"}, "vision": {"allow_remote": True, "max_images": 2}}, DaemonConfig
    )
    assert config.vision.allow_remote and config.vision.max_images == 2
    defaults = VisionConfig()
    assert (defaults.allow_remote, defaults.local_dir, defaults.max_image_bytes) == (False, "", 20 * 2**20)
    for bad in ({"max_images": -1}, {"remote_timeout_s": 0}, {"max_pixels": 0}, {"allow_remote_hosts": []}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, VisionConfig)


def test_media_does_not_import_mlx():
    code = "import sys, mlxd.media; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'mlx_vlm')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
