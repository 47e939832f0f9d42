"""`loraplex registry`: the tenant API on its own (the ingress mounts the same router).

Points at etcd endpoints, or starts a single-member etcd keeping its data under
`--state-dir` when none are given, so a registry survives restarts either way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import sys
from pathlib import Path

from loraplex.adapter_format import AdapterLimits
from loraplex.cluster.config import LoraplexConfig
from loraplex.cluster.errors import CLIError
from loraplex.cluster.flags import add_flags, built, flag_values
from loraplex.cluster.sections import ADMIN_KEY_ENV
from loraplex.registry.settings import RegistrySettings

NAMED = ("model_id", "artifact_root")  # the YAML config's settings of these names


def add_parser(sub) -> None:
    p = sub.add_parser("registry", help="run the adapter registry's tenant API (HTTP)")
    p.add_argument(
        "--model",
        type=Path,
        required=True,
        help="base model: a checkpoint folder (config.json) or a .gguf file",
    )
    add_flags(p, LoraplexConfig, NAMED)
    p.add_argument(
        "--etcd",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="etcd endpoint (repeat for several); default: start one",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path(".loraplex"),
        help="artifacts and the started etcd's data",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the tenant API binds")
    p.add_argument("--port", type=int, default=8100, help="port the tenant API binds")
    limits = p.add_argument_group("limits (as the YAML config sets them)")
    add_flags(limits, RegistrySettings, aliases={"allowed_roots": "--allowed-root"})
    add_flags(limits, AdapterLimits)


# h11 refuses a request whose head (request line and headers) passes this (400 at once);
# httptools, uvicorn's default when installed, reads a header of any size: one 64 MiB
# header slowed every other tenant's requests 1,000-fold while the API read it.
MAX_REQUEST_HEAD_BYTES = 64 << 10
HTTP_LIMITS = {"http": "h11", "h11_max_incomplete_event_size": MAX_REQUEST_HEAD_BYTES}


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from loraplex.model_shape import read_model_shape
    from loraplex.registry.api import RegistryAPISettings, create_app
    from loraplex.registry.etcd_process import EtcdProcess
    from loraplex.registry.store import EtcdSettings

    admin_key = os.environ.get(ADMIN_KEY_ENV)
    if admin_key is None:
        admin_key = secrets.token_urlsafe(24)
        print(f"admin key (set {ADMIN_KEY_ENV} to choose one): {admin_key}", file=sys.stderr)
    named = built(lambda: LoraplexConfig(**flag_values(args, LoraplexConfig, NAMED)))
    try:
        shape = read_model_shape(args.model)
    except ValueError as e:
        raise CLIError(str(e)) from None
    settings = built(
        lambda: RegistryAPISettings(
            admin_key=admin_key,
            base_model_id=named.model_id or args.model.resolve().name,
            base_model=shape,
            **flag_values(args, RegistrySettings),
            **flag_values(args, AdapterLimits),
        )
    )
    args.state_dir.mkdir(parents=True, exist_ok=True)
    # uvicorn shuts down on SIGTERM, then raises it again under the handler found at start:
    # the default one would kill the process before the ExitStack stops the started etcd.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    with contextlib.ExitStack() as stack:
        endpoints = args.etcd
        if not endpoints:
            try:
                etcd = stack.enter_context(EtcdProcess(args.state_dir / "etcd"))
            except FileNotFoundError as e:
                raise CLIError(str(e)) from None
            endpoints = [etcd.endpoint]
            print(
                f"started etcd at {etcd.endpoint} (data in {args.state_dir / 'etcd'})",
                file=sys.stderr,
            )
        app = create_app(
            settings,
            EtcdSettings(endpoints=endpoints),
            named.artifact_root or args.state_dir / "artifacts",
        )
        print(f"tenant API on http://{args.host}:{args.port} (OpenAPI at /docs)", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **HTTP_LIMITS)
    return 0


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)
