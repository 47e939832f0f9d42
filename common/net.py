"""Network helpers every part may use (this package is below all of them)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (another process may still take it before you bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
