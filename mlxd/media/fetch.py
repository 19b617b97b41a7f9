"""The encoded bytes of a request's image: a ``data:`` URI, an http(s) URL (opt-in) or a local file (opt-in).

http(s) fetches live in :mod:`mlxd.media.remote` (public addresses only, pinned connections, one deadline).

Bare base64 without the ``data:`` prefix is refused with a hint: the OpenAI API requires the data URI, and a bare
string is ambiguous with an absolute path (a JPEG's base64 starts with ``/9j/``). Anthropic-style base64
``source`` objects are turned into data URIs by :mod:`mlxd.media.parts`.
"""

from __future__ import annotations

import base64
import re
import stat
from collections.abc import Collection
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mlxd.config.schema import VisionConfig
from mlxd.errors import RequestError
from mlxd.media.remote import Resolver, fetch_remote, preview, too_large

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
# Long enough that no plausible path matches (paths have dots, dashes or underscores well before 256 characters).
_BASE64ISH = re.compile(r"[A-Za-z0-9+/]{256,}={0,2}")


def load_image_bytes(
    url: str,
    *,
    config: VisionConfig,
    param: str,
    base_dir: Path | None = None,
    resolver: Resolver | None = None,
    allow_hosts: Collection[str] = frozenset(),
) -> bytes:
    """The encoded image at ``url``, at most ``config.max_image_bytes``; any refusal is a RequestError on ``param``.

    ``base_dir`` is the folder a relative ``local_dir`` is relative to (the config file's). ``resolver`` replaces
    ``socket.getaddrinfo``; ``allow_hosts`` (tests only) exempts host names or addresses from the address checks.
    """
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else ""
    if scheme == "data":
        return decode_data_uri(url, max_bytes=config.max_image_bytes, param=param)
    if scheme in ("http", "https"):
        if not config.allow_remote:
            raise RequestError(
                "remote image URLs are refused ([vision] allow_remote is false); send the image as a "
                "data:image/...;base64, URI",
                param=param,
            )
        return fetch_remote(url, config=config, param=param, resolver=resolver, allow_hosts=allow_hosts)
    if not scheme and _BASE64ISH.fullmatch(url[:4096]):
        raise RequestError(
            "bare base64 image data is refused: send data:image/<type>;base64,<data>", param=param
        )
    if scheme == "file" or url.startswith("/"):
        return read_local(
            url, root=local_root(config, base_dir), max_bytes=config.max_image_bytes, param=param
        )
    raise RequestError(
        f"unsupported image URL {preview(url)}: expected a data:image/...;base64, URI, an http(s) URL, "
        "a file:// URL or an absolute path",
        param=param,
    )


# ---- data: URIs ----


def decode_data_uri(url: str, *, max_bytes: int, param: str) -> bytes:
    """The bytes of a ``data:[image/*];base64,...`` URI, decoded strictly; the size is bounded before decoding."""
    header, comma, payload = url[len("data:") :].partition(",")
    fields = [f.strip().lower() for f in header.split(";")]
    if not comma or "base64" not in fields[1:]:
        raise RequestError("image data URIs must be base64: data:image/<type>;base64,<data>", param=param)
    if fields[0] and not fields[0].startswith("image/") and fields[0] != "application/octet-stream":
        raise RequestError(f"data URI media type {fields[0]!r} is not an image type", param=param)
    # n bytes encode to 4 * ceil(n / 3) characters: anything longer cannot fit, and is not decoded to find out.
    if len(payload) > 4 * ((max_bytes + 2) // 3):
        raise too_large(f"about {len(payload) * 3 // 4} bytes", max_bytes, param)
    try:
        data = base64.b64decode(payload, validate=True)
    except ValueError as e:  # binascii.Error, or non-ASCII characters
        raise RequestError(f"image data URI is not valid base64 ({e})", param=param) from e
    if len(data) > max_bytes:
        raise too_large(f"{len(data)} bytes", max_bytes, param)
    if not data:
        raise RequestError("image data URI is empty", param=param)
    return data


# ---- local files ----


def local_root(config: VisionConfig, base_dir: Path | None) -> Path | None:
    """The resolved ``[vision] local_dir`` (relative to ``base_dir``, else the working folder); None when unset."""
    if not config.local_dir:
        return None
    root = Path(config.local_dir).expanduser()
    return ((base_dir or Path.cwd()) / root).resolve()


def read_local(url: str, *, root: Path | None, max_bytes: int, param: str) -> bytes:
    """A regular file named by a file:// URL or absolute path that lies under ``root`` once symlinks and ``..``
    are resolved; refused when ``root`` is None."""
    if root is None:
        raise RequestError("local image files are refused ([vision] local_dir is not set)", param=param)
    path = _local_path(url, param).resolve()
    if not path.is_relative_to(root):
        raise RequestError(f"image path {preview(url)} is outside [vision] local_dir", param=param)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the open below
            raise RequestError(f"image path {preview(url)} is not a regular file", param=param)
        if info.st_size > max_bytes:
            raise too_large(f"{info.st_size} bytes", max_bytes, param)
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise RequestError(f"cannot read image file {preview(url)} ({e.strerror})", param=param) from e
    if len(data) > max_bytes:
        raise too_large(f"more than {max_bytes} bytes", max_bytes, param)
    return data


def _local_path(url: str, param: str) -> Path:
    if url.lower().startswith("file:"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise RequestError(f"file URL host {parts.netloc!r} is not local", param=param)
        url = unquote(parts.path)
    if not url.startswith("/") or "\x00" in url:
        raise RequestError(f"image path {preview(url)} is not an absolute path", param=param)
    return Path(url)
