"""Ray Serve's flags for `http.ingress_proxy` (cluster/ingress_proxy.py tells what the two
proxies are): Ray reads them from the environment of `ray start`, or of the process whose
`ray.init` starts a local Ray.

    serve     Serve's proxy actor: both flags 0
    haproxy   HAProxy in front of Serve's direct ingress: both 1
"""

from __future__ import annotations

import os
from typing import Literal, get_args

from loraplex.net import free_port

IngressProxy = Literal["serve", "haproxy"]  # http.ingress_proxy's type (cluster/sections.py)
INGRESS_PROXIES: tuple[str, ...] = get_args(IngressProxy)
FLAGS = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY")
# HAProxy's stats page and Prometheus exporter: fixed ports (8404, 9101) on every
# interface unless these are set.
HAPROXY_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def ray_env(proxy: str) -> dict[str, str]:
    """Ray Serve's flags for `proxy`, as `ray start`'s environment must hold them."""
    if proxy not in INGRESS_PROXIES:
        raise ValueError(f"ingress_proxy must be one of {INGRESS_PROXIES}, not {proxy!r}")
    on = "1" if proxy == "haproxy" else "0"
    return dict.fromkeys(FLAGS, on)


def local_ray_env(proxy: str, environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """`ray_env(proxy)` for a Ray that `loraplex up` starts on this machine: with HAProxy,
    its stats and exporter on free ports unless `environ` names them, so that two local
    clusters (or anything else on 8404 and 9101) do not collide."""
    env = ray_env(proxy)
    if proxy == "haproxy":
        env |= {name: environ.get(name) or str(free_port()) for name in HAPROXY_PORTS}
    return env
