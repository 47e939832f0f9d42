"""Stops this node's Ray once the head's GCS has stopped answering.

`ray down` with provider `local` runs `ray stop` on the head only (Ray's
autoscaler/_private/commands.py, `teardown_cluster`: the workers are only marked
terminated). A worker's raylet exits on its own once the GCS is gone, but other processes
its `ray start` began (the log monitor) stay for good. The worker start command of the
`ray up` files (cluster/ray_up_files.py) runs this in the background, in its own session:

    python3 -m loraplex.cluster.ray_node_watch HEAD_IP:GCS_PORT

One watcher per node (a lock in ~/.loraplex): a restarted worker does not add another.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

# How long the GCS may refuse connections before it is taken for gone: longer than a GCS
# restart takes when it is fault tolerant, short next to `ray down`'s own wait.
RAY_LOST_AFTER_S = 5.0


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def accepts(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=1.0):
            return True
    except OSError:
        return False


def watch(gcs: tuple[str, int], poll_s: float = 1.0) -> None:
    """Return once `gcs` has refused connections for RAY_LOST_AFTER_S."""
    refused_since = None
    while True:
        if accepts(gcs):
            refused_since = None
        else:
            refused_since = refused_since or time.monotonic()
            if time.monotonic() - refused_since > RAY_LOST_AFTER_S:
                return
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    (address,) = argv if argv is not None else sys.argv[1:]
    lock_dir = Path.home() / ".loraplex"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    lock = os.open(lock_dir / "ray_node_watch.lock", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # this node has its watcher
    watch(host_port(address))
    print(f"the head's GCS at {address} is gone: ray stop", flush=True)
    ray = Path(sys.executable).parent / "ray"
    return subprocess.run([str(ray), "stop"], timeout=120).returncode


if __name__ == "__main__":
    sys.exit(main())
