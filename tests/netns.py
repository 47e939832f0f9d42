"""A command run in a network namespace of its own, whose only interface is its own
loopback (`unshare --net`, root only): for servers that bind every interface, which tests
must not do on the machine's (HAProxy's stats page and exporter, in Ray's template)."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any


def refused() -> str | None:
    """Why a network namespace cannot be made here, or None."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs util-linux's unshare and iproute2's ip"
    tried = subprocess.run(
        ["unshare", "--net", "--fork", "ip", "link", "set", "lo", "up"],
        capture_output=True,
        text=True,
    )
    if tried.returncode != 0:
        return f"cannot make a network namespace (root only): {tried.stderr.strip()}"
    return None


def run(argv: list[str], **options: Any) -> subprocess.CompletedProcess[str]:
    """`argv` in a new network namespace with its loopback up; `options` as subprocess.run's
    (output captured as text)."""
    namespaced = ["unshare", "--net", "--fork", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    return subprocess.run([*namespaced, *argv], capture_output=True, text=True, **options)
