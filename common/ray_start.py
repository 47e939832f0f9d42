"""Starting a local Ray head from this process (`ray.init` with no address to join), tried
once more when the head was slow to come up on a loaded machine: used by the lean Ray of
tests and benchmarks (demo/lean_ray.py) and by `loraplex up`'s supervisor."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Ray's fixed 30 s for the raylet to register (ray/_private/node.py, "The current node
# timed out during startup"), and its 30 s for the GCS to publish its port
# (node.py's start_gcs_server, "Timed out waiting for file .../gcs_server_port_...",
# longer when RAY_gcs_server_port_wait_time_s says so).
SLOW_STARTS = ("timed out during startup", "Timed out waiting for file")
GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"
GCS_SECOND_WAIT_S = 90
_GCS_PORT_FILE = re.compile(r"Timed out waiting for file (\S+)/gcs_server_port_")


def init_once_more_if_slow(ray: Any, **options: Any) -> None:
    """`ray.init(**options)`, tried a second time when the head did not come up within Ray's
    waits: seen in full CI runs on a loaded 2-core machine, before the test's own work ran
    (the raylet once, the GCS once). The second try waits 90 s for the GCS unless the
    operator set the wait. The warning carries the tail of the GCS's log. Any other
    failure, or a second timeout, is raised."""
    try:
        ray.init(**options)
    except Exception as e:
        if not any(s in str(e) for s in SLOW_STARTS):
            raise
        log.warning(
            "Ray's head did not start within its wait; starting it once more: %s%s",
            e,
            _gcs_log_tail(str(e)),
        )
        ray.shutdown()
        with _longer_gcs_wait():
            ray.init(**options)


@contextlib.contextmanager
def _longer_gcs_wait() -> Any:
    if GCS_WAIT_ENV in os.environ:
        yield
        return
    os.environ[GCS_WAIT_ENV] = str(GCS_SECOND_WAIT_S)
    try:
        yield
    finally:
        os.environ.pop(GCS_WAIT_ENV, None)


def _gcs_log_tail(message: str, lines: int = 20) -> str:
    """The last lines of the GCS's stdout and stderr in the session named by the message, or
    nothing when it names none or they cannot be read."""
    found = _GCS_PORT_FILE.search(message)
    if found is None:
        return ""
    tails = []
    for name in ("gcs_server.out", "gcs_server.err"):
        with contextlib.suppress(OSError):
            text = (Path(found.group(1)) / "logs" / name).read_text(errors="replace")
            tails.append(f"\n--- {name} ---\n" + "\n".join(text.splitlines()[-lines:]))
    return "".join(tails)
