"""What carries HTTP to the ingress replicas (`http.ingress_proxy`), and the Ray Serve flags
that choose it.

    serve     Ray Serve's proxy actor on each node: Python, and every streamed chunk is
              relayed to it over Ray before it reaches the client
    haproxy   Ray Serve's direct ingress: HAProxy on each node forwards the connection to
              the ingress replica's own HTTP server, which streams to the client itself

Ray reads the choice once, from the environment of `ray start` (its controller, proxies and
replicas inherit it), so it belongs to the Ray cluster, not to the app: `loraplex up` sets
it for the Ray it starts, the `ray up` files export it from the cluster's config file
before `ray start` (`python -m loraplex.cluster.ingress_proxy CONFIG` prints it), the Helm
chart puts it in the Ray pods' environment, and `loraplex up --address` refuses a Ray
cluster started with the other one. The flags themselves are `loraplex.serve_flags`'s (the
demo's lean Ray sets them too).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from loraplex.serve_flags import FLAGS, INGRESS_PROXIES, ray_env


def running_proxy(ray: Any, timeout_s: float = 60.0) -> str:
    """The ingress proxy the connected Ray cluster was started with, as a task on it sees
    its node's environment (ray start's)."""

    @ray.remote(num_cpus=0)
    def flags() -> dict[str, str]:
        return {name: os.environ.get(name, "0") for name in FLAGS}

    seen = ray.get(flags.remote(), timeout=timeout_s)
    for proxy in INGRESS_PROXIES:
        if seen == ray_env(proxy):
            return proxy
    return "mixed (" + ", ".join(f"{k}={v}" for k, v in seen.items()) + ")"


def check_running_proxy(ray: Any, wanted: str) -> None:
    """RuntimeError unless the connected Ray cluster runs the ingress proxy `wanted`."""
    running = running_proxy(ray)
    if running != wanted:
        flags = " ".join(f"{k}={v}" for k, v in ray_env(wanted).items())
        raise RuntimeError(
            f"http.ingress_proxy is {wanted!r} but this Ray cluster runs {running!r}: Ray "
            f"reads it from `ray start`'s environment; restart Ray on every node with {flags} "
            f"or set http.ingress_proxy to {running!r}"
        )


def main(argv: list[str] | None = None) -> int:
    """Print `ray_env` of a config file's `http.ingress_proxy` as NAME=VALUE words, for
    `export $(python -m loraplex.cluster.ingress_proxy CONFIG)` before `ray start`."""
    from loraplex.cluster.config import LoraplexConfig

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m loraplex.cluster.ingress_proxy CONFIG.yaml", file=sys.stderr)
        return 2
    try:
        config = LoraplexConfig.from_yaml(args[0])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(" ".join(f"{k}={v}" for k, v in ray_env(config.http.ingress_proxy).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
