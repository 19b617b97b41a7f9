"""Rank 0's control connections (mlxd/engine/distributed/control.py), in one process: the ranks are threads, and
the announcement that goes over the group's collective in a job is handed over in memory."""

from __future__ import annotations

import json
import socket
import threading
import time

import msgspec
import pytest

from mlxd.engine.distributed.control import ControlClient, ControlServer, Hello, leader_hosts, send_frame
from mlxd.errors import DistributedFault
from tests.helpers import free_port


class Group:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class Board:
    """Rank 0's announcement, passed to the other ranks; a stranger knocks on the port before they connect."""

    def __init__(self) -> None:
        self.hello: Hello | None = None
        self.stranger: socket.socket | None = None
        self.knocked = threading.Event()

    def tell(self, group: Group, hello: Hello) -> Hello:
        self.hello = hello
        # Queued before the ranks; rank 0 accepts it first, reads the wrong nonce and closes it.
        self.stranger = socket.create_connection(("127.0.0.1", hello.port))
        send_frame(self.stranger, msgspec.msgpack.encode((hello.nonce + 1, 1)))
        self.knocked.set()
        return hello

    def hear(self, group: Group, hello: None) -> Hello:
        assert self.knocked.wait(10)
        return self.hello


def connected(size: int, port: int = 0) -> tuple[ControlServer, dict[int, ControlClient]]:
    board, clients = Board(), {}

    def join(rank: int) -> None:
        clients[rank] = ControlClient(Group(rank, size), 10, hear=board.hear)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(1, size)]
    for thread in threads:
        thread.start()
    server = ControlServer(Group(0, size), 10, tell=board.tell, port=port)
    for thread in threads:
        thread.join(10)
    assert sorted(clients) == list(range(1, size))
    with board.stranger as stranger:
        stranger.settimeout(5)
        assert stranger.recv(1) == b""  # refused: closed on it
    return server, clients


def test_frames_reach_every_rank_in_order_and_counters_come_back():
    server, clients = connected(3)
    try:
        payloads = [b"", b"x" * 100_000, msgspec.msgpack.encode([1, 2, 3])]
        for payload in payloads:
            server.send(payload)
        for client in clients.values():
            assert [client.receive() for _ in payloads] == payloads
        with pytest.raises(DistributedFault, match="did not report within 0.2 s"):
            server.wait_reported(0.2)
        clients[1].report([1, 2, 3])
        clients[2].report([4, 5, 6])
        server.wait_reported(5)
        assert server.stats[1:] == [[1, 2, 3], [4, 5, 6]]
        clients[2].report([7, 8, 9])  # later reports replace earlier ones
        deadline = time.monotonic() + 5
        while server.stats[2] != [7, 8, 9] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.stats[2] == [7, 8, 9] and server.lost is None
    finally:
        server.close()
        for client in clients.values():
            client.close()


def test_a_rank_whose_connection_ends_is_lost_and_sending_to_it_fails():
    server, clients = connected(3)
    try:
        clients[2].close()  # the rank died
        deadline = time.monotonic() + 5
        while server.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.lost is not None and "rank 2" in server.lost
        with pytest.raises(DistributedFault, match="rank 2"):
            server.wait_reported(5)
        with pytest.raises(DistributedFault, match="cannot reach rank 2"):
            for _ in range(100):  # the first frames may still fit the socket's buffer
                server.send(b"step")
                time.sleep(0.01)
        server.close()
        with pytest.raises(DistributedFault, match="rank 1: the control connection to rank 0 ended"):
            while True:
                clients[1].receive()  # what was sent before, then the end
    finally:
        server.close()
        for client in clients.values():
            client.close()


def test_ranks_leaving_after_stop_are_not_lost_and_read_everything_sent():
    server, clients = connected(2)
    clients[1].report([1])
    server.send(b"stop")
    server.expect_close()
    received = []

    def leave() -> None:  # the rank reads stop, then leaves
        time.sleep(0.3)
        received.append(clients[1].receive())
        clients[1].close()

    threading.Thread(target=leave).start()
    started = time.monotonic()
    server.close(wait_s=5)  # waits for the rank to leave first
    assert 0.2 < time.monotonic() - started < 5
    assert received == [b"stop"] and server.lost is None


def test_rank_0s_addresses_come_from_the_launch_environment_first(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.5:5000", "10.0.0.5:5001"], ["10.0.0.6:5000"]]))
    assert leader_hosts({"MLX_HOSTFILE": str(hostfile)})[0] == "10.0.0.5"
    assert leader_hosts({"NCCL_HOST_IP": "10.1.2.3", "MLX_HOSTFILE": str(hostfile)})[:2] == ["10.1.2.3", "10.0.0.5"]
    assert leader_hosts({"MLX_JACCL_COORDINATOR": "10.9.9.9:32323"})[0] == "10.9.9.9"
    plain = leader_hosts({"MLX_HOSTFILE": str(tmp_path / "missing.json")})
    assert plain[-1] == "127.0.0.1" and len(plain) == len(set(plain))


def test_a_configured_control_port_is_the_one_announced_and_a_taken_one_is_named():
    port = free_port()
    server, clients = connected(2, port)
    try:
        assert clients[1]._sock.getpeername()[1] == port
    finally:
        server.close()
        clients[1].close()
    with socket.create_server(("0.0.0.0", 0)) as taken:
        taken_port = taken.getsockname()[1]
        with pytest.raises(DistributedFault, match=f"control_port = {taken_port}: rank 0 cannot listen on it"):
            ControlServer(Group(0, 2), 1, tell=lambda group, hello: hello, port=taken_port)
