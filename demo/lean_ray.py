"""A lean local Ray with Serve, for one process (tests, benchmarks): not `loraplex up`'s
cluster, which other processes join."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


@contextlib.contextmanager
def lean_ray_serve(
    num_cpus: int = 2, object_store_mib: int = 200, http_port: int | None = None
) -> Iterator[None]:
    """A new Ray instance (never another user's cluster on this machine) with no dashboard,
    a small object store and a temp dir of its own, short because Ray's socket paths must
    be; RAY_AUTH_MODE disabled, else Ray writes a token under $HOME. Serve runs without an
    HTTP proxy (callers use handles), or with one on 127.0.0.1:`http_port`. Everything is
    stopped and removed on exit, and the environment restored."""
    import ray
    from ray import serve

    assert not ray.is_initialized(), "a Ray driver already runs in this process"
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    previous = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        init_once_more_if_slow(
            ray,
            address="local",
            include_dashboard=False,
            num_cpus=num_cpus,
            object_store_memory=object_store_mib << 20,
            _temp_dir=temp_dir,
            log_to_driver=False,
        )
        if http_port is None:
            serve.start(proxy_location="Disabled")
        else:
            serve.start(
                proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port}
            )
        yield
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if previous is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = previous


def init_once_more_if_slow(ray: Any, **options: Any) -> None:
    """`ray.init(**options)`, tried a second time when the raylet did not register within
    Ray's fixed 30 s ("The current node timed out during startup", ray/_private/node.py):
    seen once in a full CI run on a loaded 2-core machine, before any of the test ran. Any
    other failure, or a second timeout, is raised."""
    try:
        ray.init(**options)
    except Exception as e:
        if "timed out during startup" not in str(e):
            raise
        log.warning("Ray's node did not start within 30 s; starting it once more: %s", e)
        ray.shutdown()
        ray.init(**options)
