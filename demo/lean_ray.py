"""A lean local Ray with Serve, for one process (tests, benchmarks): not `loraplex up`'s
cluster, which other processes join."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def lean_ray_serve(
    num_cpus: int = 2,
    object_store_mib: int = 200,
    http_port: int | None = None,
    ingress_proxy: str | None = None,
) -> Iterator[None]:
    """A new Ray instance (never another user's cluster on this machine) with no dashboard,
    a small object store and a temp dir of its own, short because Ray's socket paths must
    be; RAY_AUTH_MODE disabled, else Ray writes a token under $HOME. Serve runs without an
    HTTP proxy (callers use handles), or with one on 127.0.0.1:`http_port`: Serve's proxy
    actor (`ingress_proxy` None or "serve"), or with "haproxy" HAProxy in front of the
    ingress replicas' own servers (cluster/ingress_proxy.py; its stats page and exporter
    bind every interface, on free ports). Everything is stopped and removed on exit, and the
    environment restored."""
    import ray
    from ray import serve

    from loraplex.ray_start import init_once_more_if_slow
    from loraplex.serve_flags import local_ray_env

    assert not ray.is_initialized(), "a Ray driver already runs in this process"
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = {"RAY_AUTH_MODE": "disabled", **local_ray_env(ingress_proxy or "serve", os.environ)}
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
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
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
