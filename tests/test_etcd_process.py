"""EtcdProcess when another process takes its port between the pick and etcd's bind: the
race that failed `ray up` in CI (Ray's gRPC servers open ephemeral ports all the time, and
one answered etcd's health poll with HTTP/2 frames)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.registry.etcd_process import INSTALL_HINT, EtcdProcess, find_etcd_binary

# What a gRPC server sends first on any connection: an HTTP/2 SETTINGS frame.
HTTP2_SETTINGS = bytes.fromhex("000006040000000000000500004000")


@pytest.fixture(name="binary")
def binary_fixture() -> str:
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip(f"no etcd server binary; install one: {INSTALL_HINT}")
    return binary


class ForeignServer:
    """Holds host:port and answers every connection as a gRPC server would."""

    def __init__(self, port: int):
        self.socket = socket.socket()
        # as a server does: a port etcd just left (TIME_WAIT) can be taken at once
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", port))
        self.socket.listen()
        self.port = port
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.socket.accept()
            except OSError:
                return
            with conn:
                conn.sendall(HTTP2_SETTINGS)
                conn.settimeout(1.0)
                try:
                    conn.recv(65536)  # the HTTP/1 request: unread, the close would be a reset
                except OSError:
                    pass
                conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        # close() alone leaves accept() blocked on Linux (the join then waited its 5 s in
        # every test); shutdown() wakes it with an OSError
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        self.socket.close()
        self.thread.join(5)
        assert not self.thread.is_alive(), "the foreign server's thread did not end"


@pytest.fixture(name="started")
def started_fixture() -> Iterator[list[EtcdProcess | ForeignServer]]:
    things: list[EtcdProcess | ForeignServer] = []
    yield things
    for thing in things:
        if isinstance(thing, EtcdProcess):
            thing.stop(kill=True)
        else:
            thing.close()


def _health(etcd: EtcdProcess) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{etcd.endpoint}/health", timeout=5) as response:
        return json.loads(response.read())["health"]


def test_a_foreign_server_on_the_port_is_not_healthy_etcd(tmp_path: Path, binary: str, started):
    """The CI failure itself: the health poll read an HTTP/2 frame and raised BadStatusLine,
    which ended `loraplex up` before etcd's exit could be seen."""
    etcd = EtcdProcess(tmp_path / "etcd", binary=binary)
    started.append(ForeignServer(etcd.client_port))
    assert etcd._healthy() is False


def test_a_picked_port_taken_before_etcd_binds_is_picked_afresh(
    tmp_path: Path, binary: str, started: list
):
    etcd = EtcdProcess(tmp_path / "etcd", binary=binary)
    taken = etcd.client_port
    started.append(ForeignServer(taken))
    started.append(etcd)
    etcd.start()
    assert etcd.client_port != taken
    assert _health(etcd) == "true"


def test_a_restart_comes_back_on_the_ports_clients_know(tmp_path: Path, binary: str, started):
    etcd = EtcdProcess(tmp_path / "etcd", binary=binary)
    started.append(etcd)
    etcd.start()
    endpoint = etcd.endpoint
    etcd.stop()
    started.append(ForeignServer(etcd.client_port))
    with pytest.raises(RuntimeError, match="another process holds it"):
        etcd.start(timeout_s=10)
    assert etcd.endpoint == endpoint


def test_a_configured_port_that_is_taken_is_a_clear_error(tmp_path: Path, binary: str, started):
    foreign = ForeignServer(0)
    started.append(foreign)
    port = foreign.socket.getsockname()[1]
    etcd = EtcdProcess(tmp_path / "etcd", binary=binary, client_port=port)
    started.append(etcd)
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port} .*another process holds it"):
        etcd.start(timeout_s=10)
    assert not etcd.running
