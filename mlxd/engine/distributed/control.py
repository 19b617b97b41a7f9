"""Rank 0's control connection to every other rank: TCP, length-prefixed msgpack frames, off the device stream.

Rank 0's messages (:class:`~mlxd.engine.distributed.channel.Message`) must not queue behind the model's work: a
collective on the device stream can only be read once the step before it has finished on every rank, so rank 0
could not plan step n+1 while step n runs. A socket is read by the host as soon as the bytes arrive.

Setting up (once, after warm-up, on every rank at the same point): rank 0 listens on a port of every interface
(``[distributed] control_port``, else an ephemeral one) and tells the group, in one ``all_sum`` over the group's own backend, its port, the addresses it may be
reached at (what the launch environment says of rank 0's host, then its own addresses) and a random nonce; each
other rank connects to the first address that answers with that nonce. Then rank 0 sends frames; the others send
their counters back now and then (:meth:`ControlClient.report`), read by one thread per rank on rank 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
import numpy as np

from mlxd.errors import DistributedFault
from mlxd.log import get_logger

log = get_logger("mlxd.distributed")

_LENGTH = struct.Struct(">I")
_ANNOUNCE_WORDS = 256  # int32 words of the one set-up all_sum (1 KiB: a port, a nonce, a few addresses)
_CONNECT_S = 5.0  # one address's connect and handshake


class Hello(msgspec.Struct, array_like=True):
    """What rank 0 announces: where it listens, and the nonce that proves a connection reached it."""

    port: int
    nonce: int
    hosts: list[str]


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes:
    """One frame's payload; raises ``ConnectionError`` when the peer closed the connection."""
    (size,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the connection was closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def announce(group: Any, hello: Hello | None) -> Hello:
    """Rank 0's ``hello`` on every rank (the others pass None): one ``all_sum`` of its msgpack bytes."""
    words = np.zeros(_ANNOUNCE_WORDS, dtype=np.int32)
    if hello is not None:
        raw = msgspec.msgpack.encode(hello)
        if len(raw) > 4 * (_ANNOUNCE_WORDS - 1):
            raise DistributedFault(f"rank 0's control address does not fit the announcement: {hello}")
        words[0] = len(raw)
        words.view(np.uint8)[4:4 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    total = np.array(mx.distributed.all_sum(mx.array(words), group=group))
    size = int(total[0])
    return msgspec.msgpack.decode(total.view(np.uint8)[4:4 + size].tobytes(), type=Hello)


def leader_hosts(environ: dict[str, str] | None = None) -> list[str]:
    """Addresses rank 0 may be reached at, most specific first: what ``mlx.launch`` told the ranks of rank 0's
    host (NCCL's master, the ring's first host, the JACCL coordinator), this host's own addresses, loopback."""
    env = os.environ if environ is None else environ
    hosts = [env.get("NCCL_HOST_IP", ""), _ring_first_host(env.get("MLX_HOSTFILE", "")),
             env.get("MLX_JACCL_COORDINATOR", "").rpartition(":")[0]]
    with contextlib.suppress(OSError):
        hosts += socket.gethostbyname_ex(socket.gethostname())[2]
    hosts.append("127.0.0.1")
    return list(dict.fromkeys(h for h in hosts if h))


def _ring_first_host(hostfile: str) -> str:
    """The first rank's address in the ring's hostfile (a JSON list of each rank's ``ip:port`` list; the variable
    holds the file's path or, from some launchers, the JSON itself)."""
    if not hostfile:
        return ""
    try:
        text = Path(hostfile).read_text() if not hostfile.lstrip().startswith("[") else hostfile
        return str(json.loads(text)[0][0]).rpartition(":")[0]
    except (OSError, ValueError, IndexError, TypeError):
        return ""


Announce = Callable[[Any, Hello | None], Hello]


class ControlServer:
    """Rank 0's end: a connection to each other rank, frames sent to all, their counters read on threads.
    ``tell`` passes the :class:`Hello` to the other ranks (:func:`announce`, over the group)."""

    def __init__(self, group: Any, timeout_s: float, tell: Announce = announce, port: int = 0) -> None:
        self.size = group.size()
        self.lost: str | None = None  # why a rank's connection ended while the job ran
        self.stats: list[list[int] | None] = [None] * self.size  # each rank's last report (rank 0's unused)
        self._heard = threading.Condition()
        self._closing = False
        try:
            listener = socket.create_server(("0.0.0.0", port))
        except OSError as e:
            raise DistributedFault(f"[distributed] control_port = {port}: rank 0 cannot listen on it ({e})") from e
        with listener:
            hello = Hello(listener.getsockname()[1], secrets.randbits(62), leader_hosts())
            tell(group, hello)
            self._peers = self._accept(listener, hello.nonce, timeout_s)
        self._readers = [threading.Thread(target=self._read, args=(rank, sock), name=f"mlxd-control-{rank}",
                                          daemon=True) for rank, sock in self._peers.items()]
        for reader in self._readers:
            reader.start()

    def _accept(self, listener: socket.socket, nonce: int, timeout_s: float) -> dict[int, socket.socket]:
        peers: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout_s
        while len(peers) < self.size - 1:
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock, _ = listener.accept()
            except TimeoutError as e:
                missing = sorted(set(range(1, self.size)) - set(peers))
                raise DistributedFault(f"ranks {missing} did not connect to rank 0's control port within "
                                       f"{timeout_s:g} s") from e
            try:
                sock.settimeout(_CONNECT_S)
                their_nonce, rank = msgspec.msgpack.decode(recv_frame(sock), type=tuple[int, int])
                if their_nonce != nonce or not 0 < rank < self.size or rank in peers:
                    raise ValueError(f"a connection that is not a rank of this job (rank {rank})")
                send_frame(sock, msgspec.msgpack.encode(nonce))
            except (OSError, ValueError, msgspec.DecodeError) as e:
                log.warning("control_connection_refused", error=str(e))
                sock.close()
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peers[rank] = sock
        return peers

    def send(self, payload: bytes) -> None:
        """Send one frame to every other rank; raises :class:`DistributedFault` when a connection is broken."""
        for rank, sock in self._peers.items():
            try:
                send_frame(sock, payload)
            except OSError as e:
                raise DistributedFault(f"rank 0 cannot reach rank {rank} ({e}): it died or lost its "
                                       "connection") from e

    def wait_reported(self, timeout_s: float) -> None:
        """Until every other rank has reported at least once; raises when one is lost or the time is up."""
        deadline = time.monotonic() + timeout_s
        with self._heard:
            while self.lost is None and any(s is None for s in self.stats[1:]):
                if not self._heard.wait(max(0.0, deadline - time.monotonic())):
                    raise DistributedFault(f"the other ranks did not report within {timeout_s:g} s")
        if self.lost is not None:
            raise DistributedFault(self.lost)

    def expect_close(self) -> None:
        """Rank 0 has sent stop: connections that end now are the ranks leaving, not lost."""
        self._closing = True

    def close(self, wait_s: float = 0.0) -> None:
        """Close every connection; ``wait_s``: first wait that long for the ranks to close theirs (after stop),
        so that nothing they sent is left unread (a socket closed with unread bytes resets the connection, and
        the peer could lose what was sent last)."""
        self._closing = True
        deadline = time.monotonic() + wait_s
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        for sock in self._peers.values():
            _close(sock)

    def _read(self, rank: int, sock: socket.socket) -> None:
        try:
            while True:
                stats = msgspec.msgpack.decode(recv_frame(sock), type=list[int])
                with self._heard:
                    self.stats[rank] = stats
                    self._heard.notify_all()
        except (OSError, msgspec.DecodeError) as e:
            if self._closing:
                return
            with self._heard:
                self.lost = (f"rank {rank}'s control connection to rank 0 ended ({e}): the rank died or lost its "
                             "connection")
                self._heard.notify_all()
            log.error("distributed_rank_lost", rank=rank, reason=self.lost)


class ControlClient:
    """The end of a rank other than 0: rank 0's frames in order, and this rank's counters sent back."""

    def __init__(self, group: Any, timeout_s: float, hear: Announce = announce) -> None:
        self.rank = group.rank()
        hello = hear(group, None)
        self._sock = self._connect(hello, timeout_s)
        self._send_lock = threading.Lock()

    def _connect(self, hello: Hello, timeout_s: float) -> socket.socket:
        deadline, errors = time.monotonic() + timeout_s, {}
        while time.monotonic() < deadline:
            for host in hello.hosts:
                try:
                    sock = socket.create_connection((host, hello.port), timeout=_CONNECT_S)
                except OSError as e:
                    errors[host] = str(e)
                    continue
                try:
                    send_frame(sock, msgspec.msgpack.encode((hello.nonce, self.rank)))
                    if msgspec.msgpack.decode(recv_frame(sock), type=int) != hello.nonce:
                        raise ValueError("another service answered")
                except (OSError, ValueError, msgspec.DecodeError) as e:
                    errors[host] = str(e)
                    sock.close()
                    continue
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            time.sleep(0.2)
        raise DistributedFault(f"rank {self.rank} cannot connect to rank 0's control port {hello.port}: {errors}")

    def receive(self) -> bytes:
        """The next frame from rank 0 (blocks on the host, not on the device); raises :class:`DistributedFault`
        when rank 0's connection ends."""
        try:
            return recv_frame(self._sock)
        except OSError as e:
            raise DistributedFault(f"rank {self.rank}: the control connection to rank 0 ended ({e})") from e

    def report(self, stats: list[int]) -> None:
        """Send this rank's counters to rank 0 (a few bytes; rank 0 reads them on a thread of its own)."""
        try:
            with self._send_lock:
                send_frame(self._sock, msgspec.msgpack.encode(stats))
        except OSError as e:
            raise DistributedFault(f"rank {self.rank}: the control connection to rank 0 ended ({e})") from e

    def close(self) -> None:
        _close(self._sock)


def _close(sock: socket.socket) -> None:
    """Shut the connection down first: a thread blocked reading it wakes up (a plain close does not wake it, and
    sends nothing to the peer while that read holds the socket)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
