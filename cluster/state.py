"""The state folder and the supervisor process that `up`, `down` and `status` share.

State folder (`--state-dir`, default ~/.loraplex): `cluster.json` is the supervisor's pid,
phase, Ray and etcd addresses and URL (written by the supervisor, read by the others);
`run.json` what `up` asked it to run. Only the pid recorded there is ever signalled, and
only while it still runs the supervisor.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

SUPERVISOR = "loraplex.cluster.supervisor"  # its module: `python -m` runs it


def read_state(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / "cluster.json").read_text())
    except (OSError, ValueError):
        return None


def write_state(state_dir: Path, state: dict) -> None:
    tmp = state_dir / "cluster.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(state_dir / "cluster.json")


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (created 0600, never world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def stop_supervisor(pid: int, timeout_s: float = 90.0) -> None:
    """SIGTERM the supervisor and wait; SIGKILL after timeout_s (Ray's processes share its
    fate; a started etcd is then killed by its recorded pid)."""
    if not is_supervisor(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def stop_orphaned_etcd(state: dict, state_dir: Path) -> None:
    """Kill the etcd a killed supervisor left behind: only the pid it recorded, and only
    while that pid still runs etcd on this state folder's data."""
    pid = state.get("etcd_pid")
    if not isinstance(pid, int):
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if str(state_dir / "etcd").encode() in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return is_supervisor(pid)


def is_supervisor(pid: int) -> bool:
    """The pid runs our supervisor (not a process that reused the number)."""
    try:
        return SUPERVISOR.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return sys.platform != "linux"  # no /proc: trust the pid
