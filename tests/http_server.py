"""A FastAPI app under a real uvicorn on a free loopback port, in a thread (tests)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from loraplex.net import free_port


@contextmanager
def serve(app: FastAPI, timeout_s: float = 15) -> Iterator[str]:
    """The app's base URL while it serves; stopped (and checked to stop) on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        assert not thread.is_alive(), "uvicorn did not stop"
