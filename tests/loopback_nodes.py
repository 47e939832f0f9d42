"""Machines for `ray up` on this one: each node a loopback address with its own processes
and its own home, reached over real SSH.

A node is a PID and mount namespace (`unshare`, root only) whose first process is `serve`
below. It overlays the SSH user's home and /run copy-on-write, so what the node writes there
(the venv, ~/.bashrc, etcd's data) lands in the node's folder under the test's tmp dir, and
mounts the node's own tmp folder on ROOT/tmp, every node's TMPDIR: one path, as /tmp is on
every machine, and a folder of its own (Ray's worker nodes take the head's temp dir path
for their sockets). It runs one `sshd -i` (private config and host key, only the
throwaway key accepted) per TCP connection to ADDRESS:PORT, so sshd sets SSH_CONNECTION as
for any SSH login. Inside a node, `ps` and Ray's `ray stop` see that node's processes only: the head's
`ray stop` cannot end another Ray on this machine, nor a worker's `ray stop` the head.
Ending the first process ends the namespace and everything still in it.

Ray's launcher dials port 22. It reaches a node through `auth.ssh_proxy_command` (`connect`
below); the head's autoscaler, whose config Ray strips of the proxy command, through the
head's own ~/.ssh/config (`Port`), as a head behind a bastion would.

    python loopback_nodes.py serve NODE_DIR ADDRESS PORT SSHD_CONFIG HOME TMP  # a node's pid 1
    python loopback_nodes.py connect ADDRESS PORT                          # stdio <-> TCP
"""

from __future__ import annotations

import contextlib
import os
import pwd
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

SSHD = "/usr/sbin/sshd"
DEBIAN_PACKAGES = {"openssh-server": SSHD, "rsync": "/usr/bin/rsync"}


def install_debian_packages() -> None:
    """apt-get the packages whose programs are missing (by name; root on Debian)."""
    missing = [name for name, program in DEBIAN_PACKAGES.items() if not Path(program).exists()]
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(install)}` failed:\n{done.stdout}\n{done.stderr}")


class Node:
    """One node: its namespaces, its folder (ROOT/nI) and its sshd on ADDRESS:PORT."""

    def __init__(self, root: Path, index: int, address: str, port: int):
        self.address = address
        self.port = port
        self.dir = root / f"n{index}"  # short: Ray's socket paths under tmp/ must be
        self.tmp = self.dir / "tmp"  # what the node sees at ROOT/tmp
        self.mounted_tmp = root / "tmp"
        self.sshd_config = root / "ssh" / f"sshd_config.{address}"
        self.process: subprocess.Popen | None = None
        self.init_pid: int | None = None  # the namespace's pid 1, as this machine sees it

    def start(self, home_files: dict[str, str] | None = None, timeout_s: float = 20.0) -> None:
        """Start the node with `home_files` (path in the home -> text) in its home."""
        self.tmp.mkdir(parents=True)
        for relative, text in (home_files or {}).items():
            path = self.dir / "home.upper" / relative
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.write_text(text)
        with open(self.dir / "node.log", "ab") as log:
            self.process = subprocess.Popen(
                [
                    "unshare", "--pid", "--mount", "--fork", "--mount-proc",
                    "--propagation=private", sys.executable, __file__, "serve", str(self.dir),
                    self.address, str(self.port), str(self.sshd_config), ssh_home(),
                    str(self.mounted_tmp),
                ],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not _accepts(self.address, self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"node {self.address} did not start:\n{self.log_tail()}")
            time.sleep(0.05)
        self.init_pid = _child_of(self.process.pid)

    def pids(self) -> dict[int, str]:
        """Every process in the node but its first: pid -> command line."""
        if self.init_pid is None:
            return {}
        try:
            namespace = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        except OSError:
            return {}
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.init_pid:
                continue
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "pid") == namespace:
                    found[int(entry.name)] = _cmdline(int(entry.name))
        return found

    def stop(self) -> None:
        """End the node: its first process exits, and the kernel kills the rest."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGTERM)  # unshare passes it on
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            if self.init_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.init_pid, signal.SIGKILL)
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = (self.dir / "node.log").read_text(errors="replace")
        except OSError:
            return "(no node.log)"
        return "\n".join(text.splitlines()[-lines:])


def ssh_home() -> str:
    return pwd.getpwuid(os.getuid()).pw_dir


def common_free_port(addresses: list[str]) -> int:
    """A TCP port free on every address now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((addresses[0], 0))
            port = s.getsockname()[1]
        if all(_bindable(a, port) for a in addresses[1:]):
            return port
    raise RuntimeError(f"no port free on all of {addresses}")


def write_ssh_files(root: Path, nodes: list[Node], environment: dict[str, str]) -> Path:
    """A throwaway client key, a host key, a private known-hosts and one sshd config per
    node (sessions get TMPDIR and `environment`); returns the client's private key."""
    ssh = root / "ssh"
    ssh.mkdir(mode=0o700)
    for name in ("id_ed25519", "host_ed25519"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "loraplex-test", "-f", ssh / name],
            check=True, timeout=30,
        )  # fmt: skip
    shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
    kind, key, _ = (ssh / "host_ed25519.pub").read_text().split()
    (ssh / "known_hosts").write_text(
        "".join(f"[{n.address}]:{n.port} {kind} {key}\n" for n in nodes)
    )
    for node in nodes:
        node.sshd_config.write_text(
            f"HostKey {ssh / 'host_ed25519'}\n"
            f"AuthorizedKeysFile {ssh / 'authorized_keys'}\n"
            "PidFile none\nUsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nLogLevel ERROR\n"
            "SetEnv "
            + " ".join(f"{k}={v}" for k, v in {"TMPDIR": node.mounted_tmp, **environment}.items())
            + "\n"
        )
    return ssh / "id_ed25519"


def proxy_command(port: int) -> str:
    """`auth.ssh_proxy_command`: ssh substitutes the node's address for %h."""
    return f"{sys.executable} {Path(__file__).resolve()} connect %h {port}"


@contextlib.contextmanager
def loopback_nodes(
    root: Path, addresses: list[str], environment: dict[str, str] | None = None
) -> Iterator[tuple[list[Node], Path]]:
    """Nodes on `addresses` (the first is the head), whose SSH sessions have `environment`
    (values without spaces); yields them and the client's key."""
    port = common_free_port(addresses)
    (root / "tmp").mkdir()
    nodes = [Node(root, i, address, port) for i, address in enumerate(addresses)]
    key = write_ssh_files(root, nodes, environment or {})
    head, *workers = nodes
    routes = "".join(f"Host {w.address}\n  Port {w.port}\n" for w in workers)
    try:
        head.start(home_files={".ssh/config": routes} if workers else None)
        for worker in workers:
            worker.start()
        yield nodes, key
    finally:
        for node in nodes:
            node.stop()


def _bindable(address: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
        return True


def _accepts(address: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=1):
        return True
    return False


def _child_of(pid: int) -> int | None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if children:
                return int(children[0])
        time.sleep(0.02)
    return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


# ---------------------------------------------------------------- inside a node


def serve(node_dir: Path, address: str, port: int, sshd_config: Path, home: str, tmp: Path) -> None:
    """Pid 1 of a node: overlay the home and /run (their writes go to node_dir), mount
    node_dir/tmp on `tmp`, then one `sshd -i` per connection to address:port; reap every
    orphan; SIGTERM ends it all."""
    for target, name in ((home, "home"), ("/run", "run")):
        upper, work = node_dir / f"{name}.upper", node_dir / f"{name}.work"
        upper.mkdir(exist_ok=True)
        work.mkdir()
        options = f"lowerdir={target},upperdir={upper},workdir={work}"
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, target], check=True)
    subprocess.run(["mount", "--bind", str(node_dir / "tmp"), str(tmp)], check=True)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.create_server((address, port))
    listener.settimeout(0.5)
    log = os.open(node_dir / "sshd.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    argv = [SSHD, "-i", "-e", "-f", str(sshd_config)]
    while True:
        with contextlib.suppress(TimeoutError):
            conn, _ = listener.accept()
            with conn:
                actions = [
                    (os.POSIX_SPAWN_DUP2, conn.fileno(), 0),
                    (os.POSIX_SPAWN_DUP2, conn.fileno(), 1),
                    (os.POSIX_SPAWN_DUP2, log, 2),
                ]
                os.posix_spawn(SSHD, argv, os.environ, file_actions=actions)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass


def connect(address: str, port: int) -> None:
    """Copy stdin to address:port and what comes back to stdout, until the far end closes."""
    conn = socket.create_connection((address, port))
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(conn, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj == 0:
                data = os.read(0, 65536)
                if data:
                    conn.sendall(data)
                else:
                    selector.unregister(0)
                    conn.shutdown(socket.SHUT_WR)
            else:
                data = conn.recv(65536)
                if not data:
                    return
                os.write(1, data)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "serve":
        serve(Path(args[0]), args[1], int(args[2]), Path(args[3]), args[4], Path(args[5]))
    else:
        connect(args[0], int(args[1]))
