"""`loraplex up | down | status`: a whole local cluster (etcd, Ray, the Serve app).

`up` hands the cluster to a supervisor process (`cluster/supervisor.py`, in its own
session) and waits until the app answers. The supervisor owns everything it starts: an
etcd (unless endpoints are configured) and the Ray head via `ray.init`, whose processes
share its fate. So `down`, from any shell, only signals the supervisor's pid; it shuts
Serve down, stops Ray and etcd, and exits. Nothing else on the machine is touched (no
`ray stop`, which would end every Ray cluster of the user). With `--address`, the
supervisor deploys onto an existing Ray cluster instead, and `down` removes only the app.

State folder (`--state-dir`, default ~/.loraplex), kept by `down`:
    admin_key        the admin key, 0600 (generated once; $LORAPLEX_ADMIN_KEY overrides)
    metrics_key      the key /metrics wants, 0600 (generated once; $LORAPLEX_METRICS_KEY
                     overrides)
    demo_api_key     the key of tenant `demo`, created at the first `up`, 0600
    cluster.json     supervisor pid, phase, Ray and etcd addresses, URL
    run.json         what the supervisor was asked to run (effective config), 0600
    cluster.log      the supervisor's log; etcd/ etcd.log: the started etcd
    artifacts/       adapter artifacts (unless artifact_root is configured)
    demo-assets/     the demo model and adapters (unless a model or --demo-dir is given)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.cluster.config import LoraplexConfig
from loraplex.cluster.errors import CLIError
from loraplex.cluster.flags import add_flags, flag_values
from loraplex.cluster.sections import AuthSection, HTTPSection
from loraplex.cluster.serve_status import adapter_homes_report, serve_report
from loraplex.cluster.state import (
    SUPERVISOR,
    pid_alive,
    read_state,
    stop_orphaned_etcd,
    stop_supervisor,
    write_private,
)
from loraplex.demo.assets import DEMO_MODEL_ID

if TYPE_CHECKING:
    from loraplex.registry.etcd_client import EtcdSettings

DEMO_TENANT = "demo"
DEMO_ADAPTER = "pirate-r16"
log = logging.getLogger("loraplex.cluster")


def add_parsers(sub) -> None:
    state = argparse.ArgumentParser(add_help=False)
    state.add_argument(
        "--state-dir",
        type=Path,
        default=Path("~/.loraplex"),
        help="keys, logs, etcd data, artifacts and demo assets (default ~/.loraplex)",
    )
    up = sub.add_parser(
        "up", parents=[state], help="start a local cluster (etcd, Ray, the Serve app)"
    )
    up.add_argument("--config", type=Path, help="LoraplexConfig YAML (default: the demo)")
    up.add_argument("--demo-dir", type=Path, help="where the demo assets go (no model set)")
    add_flags(up, HTTPSection, ["port"])
    up.add_argument(
        "--address", help="deploy onto this running Ray cluster (e.g. auto) instead of one"
    )
    up.add_argument("--etcd-host", help="address the started etcd listens on (overrides etcd.host)")
    up.add_argument("--object-store-mib", type=int, default=256, help="Ray object store")
    up.add_argument("--timeout", type=float, default=600, help="seconds to wait for serving")
    up.add_argument(
        "--check",
        action="store_true",
        help="only check the config, the model and the configured etcd as `up` would, and "
        "start or write nothing (the `ray up` files run it before `ray start`)",
    )
    sub.add_parser("down", parents=[state], help="stop the local cluster (data is kept)")
    status_parser = sub.add_parser(
        "status", parents=[state], help="replicas, adapters per tier, pool use"
    )
    status_parser.add_argument(
        "--full-ids",
        action="store_true",
        help="show adapter version ids whole (64 hex digits; default: the first 12)",
    )


def run(args: argparse.Namespace) -> int:
    # The environment is read here, once: keys for the cluster, Ray's auth mode for drivers.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    state_dir = args.state_dir.expanduser().resolve()
    if args.command == "up":
        return up(args, state_dir, dict(os.environ))
    if args.command == "down":
        return down(state_dir)
    return status(state_dir, args.full_ids)


# ---------------------------------------------------------------- up


def up(args: argparse.Namespace, state_dir: Path, env: dict[str, str]) -> int:
    started = time.monotonic()
    check_app_importable()
    state = read_state(state_dir)
    if not args.check and state and pid_alive(state.get("pid")):
        print(f"loraplex is already running ({state.get('phase')}); `loraplex status` shows it")
        return 0
    config = checked_config(args)
    if args.check:
        etcd = (
            f"etcd at {', '.join(config.etcd.endpoints)} answers"
            if config.etcd.endpoints is not None
            else "etcd: `loraplex up` starts one"
        )
        model = f"model {config.model} is a checkpoint" if config.model else "model: the demo's"
        print(f"loraplex up --check: the config reads; {model}; {etcd}")
        return 0
    if args.address is None:
        check_port_free(config.http.host, config.http.port)
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    demo = None
    if config.model is None:
        demo = demo_assets((args.demo_dir or state_dir / "demo-assets").expanduser().resolve())
        config = config.model_copy(
            update={"model": str(demo.model), "model_id": config.model_id or DEMO_MODEL_ID}
        )
    if config.artifact_root is None:
        config = config.model_copy(update={"artifact_root": str(state_dir / "artifacts")})
    admin_key = admin_key_for(state_dir, env.get(config.auth.admin_key_env))
    metrics_key = metrics_key_for(state_dir, env.get(config.auth.metrics_key_env))

    run_spec = {
        "config": config.model_dump(mode="json"),
        "ray": None
        if args.address
        else {
            "num_cpus": ray_cpus(config),
            "object_store_bytes": args.object_store_mib << 20,
            "temp_dir": ray_temp_dir(state_dir),
        },
        "ray_address": args.address,
    }
    write_private(state_dir / "run.json", json.dumps(run_spec, indent=2))
    (state_dir / "cluster.json").unlink(missing_ok=True)
    child_env = {
        **env,
        config.auth.admin_key_env: admin_key,
        config.auth.metrics_key_env: metrics_key,
    }
    with open(state_dir / "cluster.log", "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR, str(state_dir)],
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        state = wait_running(state_dir, process, args.timeout - (time.monotonic() - started))
        url = state["url"]
        wait_healthy(url, process, started + args.timeout)
    except KeyboardInterrupt:
        stop_supervisor(process.pid)
        raise CLIError("interrupted: the cluster was stopped") from None
    demo_key = demo_tenant_key(state_dir, url, admin_key)
    print_welcome(config, state_dir, url, admin_key, demo_key, demo, time.monotonic() - started)
    return 0


def checked_config(args: argparse.Namespace) -> LoraplexConfig:
    """The config `up` runs, its flags applied, once it has passed the refusals a cluster is
    not needed for (the model is a checkpoint on this node; a configured etcd answers):
    CLIError otherwise. Nothing is written or started for a config that cannot serve."""
    config = load_config(args.config)
    try:
        config = config.overridden("http", **flag_values(args, HTTPSection, ["port"]))
        if args.etcd_host is not None:
            config = config.overridden("etcd", host=args.etcd_host)
    except ValueError as e:
        raise CLIError(f"--port / --etcd-host: {e}") from None
    if config.model is not None:
        check_model(Path(config.model), on_cluster=args.address is not None)
    if config.etcd.endpoints is not None:
        check_etcd(config.etcd_settings())
    return config


def check_app_importable() -> None:
    """CLIError naming what the app needs and this install lacks."""
    try:
        from loraplex.cluster.app import app_parts

        app_parts()
    except ImportError as e:
        raise CLIError(f"the Serve app cannot be built: {e}") from None


def load_config(path: Path | None) -> LoraplexConfig:
    if path is None:
        return LoraplexConfig()
    try:
        return LoraplexConfig.from_yaml(path)
    except ValueError as e:
        raise CLIError(str(e)) from None


def demo_assets(dest: Path):
    """The demo model and adapters in `dest`, placed there first if missing."""
    from loraplex.demo.assets import demo_assets_complete, make_demo_assets
    from loraplex.demo.smollm import ModelNotFetched

    assets = demo_assets_complete(dest)
    if assets is not None:
        return assets
    print(f"placing the demo model and adapters in {dest}", file=sys.stderr)
    try:
        return make_demo_assets(dest)
    except ModelNotFetched as e:
        raise CLIError(str(e)) from None


def check_model(model: Path, on_cluster: bool) -> None:
    """CLIError unless `model` is a checkpoint here, a folder or a .gguf file (on a cluster,
    the ingress on this node reads its tokenizer, and every node needs it)."""
    from loraplex.checkpoint_shape import CheckpointError
    from loraplex.model_shape import read_model_shape

    try:
        read_model_shape(model)
    except CheckpointError as e:
        where = " on this node (every node of the cluster needs it)" if on_cluster else ""
        raise CLIError(f"model {model}{where}: {e}") from None


def check_etcd(settings: EtcdSettings) -> None:
    """CLIError naming each endpoint and why, unless one of the configured etcds answers."""
    import asyncio

    from loraplex.registry.etcd_client import EtcdConnection, RegistryUnavailable

    async def status() -> None:
        connection = EtcdConnection(settings)
        try:
            await connection.request(lambda client: client.status())
        finally:
            await connection.close()

    try:
        asyncio.run(status())
    except RegistryUnavailable as e:
        raise CLIError(f"{e}; check etcd.endpoints (unset: `loraplex up` starts one)") from None


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise CLIError(
                f"cannot serve on {host}:{port} ({e.strerror}); pass --port or set http.port"
            ) from None


def admin_key_for(state_dir: Path, from_env: str | None) -> str:
    """$admin_key_env if set, else the stored key, else a new one (stored, 0600)."""
    return _stored_key(state_dir / "admin_key", from_env, "admin key")


def metrics_key_for(state_dir: Path, from_env: str | None) -> str:
    """$metrics_key_env if set, else the stored key, else a new one (stored, 0600)."""
    return _stored_key(state_dir / "metrics_key", from_env, "metrics key")


def _stored_key(path: Path, from_env: str | None, what: str) -> str:
    if from_env:
        if len(from_env) < 16:
            raise CLIError(f"the {what} in the environment must have at least 16 characters")
        return from_env
    if path.is_file():
        return path.read_text().strip()
    key = secrets.token_urlsafe(24)
    write_private(path, key + "\n")
    return key


def ray_cpus(config: LoraplexConfig) -> int:
    """Logical CPUs for the head: the machine's, or what the app reserves if more (a demo
    with 2 replicas of 1 CPU must fit on a 1-core laptop)."""
    need = config.replicas.num_cpus * (config.replicas.autoscaling or {}).get(
        "max_replicas", config.replicas.num_replicas
    )
    need += config.http.ingress_num_cpus * config.http.ingress_replicas
    return max(os.cpu_count() or 1, int(need + 0.999))


def ray_temp_dir(state_dir: Path) -> str:
    # Under /tmp, not the state folder: Ray's unix socket paths must stay under ~107 bytes.
    tag = hashlib.sha256(str(state_dir).encode()).hexdigest()[:8]
    return str(Path(tempfile.gettempdir()) / f"loraplex-{os.getuid()}-{tag}")


def wait_running(state_dir: Path, process: subprocess.Popen, timeout_s: float) -> dict:
    """Relay the supervisor's phases until it reports running; CLIError if it fails."""
    deadline = time.monotonic() + timeout_s
    shown = None
    while time.monotonic() < deadline:
        state = read_state(state_dir) or {}
        phase = state.get("phase")
        if phase != shown and phase is not None:
            shown = phase
            print(
                f"  {phase}{': ' + state['detail'] if state.get('detail') else ''}", file=sys.stderr
            )
        if phase == "running":
            return state
        if phase == "failed" or process.poll() is not None:
            raise CLIError(
                f"the cluster did not start: {state.get('error') or 'the supervisor exited'} "
                f"(log: {state_dir / 'cluster.log'})"
            )
        time.sleep(0.2)
    stop_supervisor(process.pid)
    raise CLIError(f"not serving after {timeout_s:.0f}s (log: {state_dir / 'cluster.log'})")


def wait_healthy(url: str, process: subprocess.Popen, deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        if process.poll() is not None:
            raise CLIError("the supervisor exited while waiting for /health")
        time.sleep(0.5)
    raise CLIError(
        f"{url}/health did not answer in time; the cluster is still up: see `loraplex status`, "
        "stop it with `loraplex down`"
    )


def demo_tenant_key(state_dir: Path, url: str, admin_key: str) -> str | None:
    """The demo tenant's key: stored, or created now (a new key if the tenant exists)."""
    import httpx

    path = state_dir / "demo_api_key"
    if path.is_file():
        return path.read_text().strip()
    auth = {"Authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=url, headers=auth, timeout=30, trust_env=False) as client:
        r = client.post("/v1/tenants", json={"name": DEMO_TENANT})
        if r.status_code == 409:
            r = client.post(f"/v1/tenants/{DEMO_TENANT}/keys")
    if r.status_code != 201:
        print(f"could not create tenant {DEMO_TENANT!r}: {r.status_code} {r.text}", file=sys.stderr)
        return None
    key = r.json()["api_key"]
    write_private(path, key + "\n")
    return key


def print_welcome(config, state_dir, url, admin_key, demo_key, demo, elapsed_s) -> None:
    model = config.base_model_id
    replicas = config.replicas.num_replicas if config.replicas.autoscaling is None else "auto"
    json_header = "-H 'Content-Type: application/json'"
    print(f"loraplex is serving {model} at {url} ({replicas} replicas, up in {elapsed_s:.0f} s)")
    print(f"  admin key:  {admin_key}  (in {state_dir / 'admin_key'})")
    print(f"  metrics:    {url}/metrics with the key in {state_dir / 'metrics_key'} (Bearer)")
    if demo_key:
        print(f"  API key:    {demo_key}  (tenant {DEMO_TENANT}; in {state_dir / 'demo_api_key'})")
    print(f"  state:      {state_dir}  (log: cluster.log); stop with `loraplex down`")
    print("\nTry it:")
    print(f"  export LORAPLEX_URL={url} LORAPLEX_API_KEY={demo_key or '<a tenant key>'}")
    adapter, path = (DEMO_ADAPTER, demo.adapters_dir / DEMO_ADAPTER) if demo else ("mine", "DIR")
    print(f"  loraplex adapters add {adapter} {path}")
    body = {
        "model": adapter,
        "messages": [{"role": "user", "content": "What is the capital of Peru?"}],
        "max_tokens": 32,
    }
    print(
        f'  curl -s $LORAPLEX_URL/v1/chat/completions -H "Authorization: Bearer $LORAPLEX_API_KEY" '
        f"{json_header} -d '{json.dumps(body)}'"
    )
    print("  # a tenant of your own (the admin key creates it and prints its API key):")
    print(
        f"  curl -s $LORAPLEX_URL/v1/tenants -H 'Authorization: Bearer {admin_key}' {json_header} "
        '-d \'{"name": "acme"}\''
    )


# ---------------------------------------------------------------- down


def down(state_dir: Path) -> int:
    state = read_state(state_dir)
    if not state or not pid_alive(state.get("pid")):
        print(f"no loraplex cluster is running (state in {state_dir})")
        return 0
    print(f"stopping the cluster (supervisor pid {state['pid']})...", file=sys.stderr)
    stop_supervisor(state["pid"])
    stop_orphaned_etcd(read_state(state_dir) or state, state_dir)
    print(f"stopped; data kept in {state_dir}")
    return 0


# ---------------------------------------------------------------- status


def status_metrics_key(state_dir: Path) -> str | None:
    """The key `status` sends to /metrics: $LORAPLEX_METRICS_KEY (the default variable, as
    `up` reads it) or the one `up` stored; None when neither is there."""
    from_env = os.environ.get(AuthSection().metrics_key_env)
    if from_env:
        return from_env
    path = state_dir / "metrics_key"
    return path.read_text().strip() if path.is_file() else None


def status(state_dir: Path, full_ids: bool = False) -> int:
    import httpx

    state = read_state(state_dir)
    if not state or not pid_alive(state.get("pid")):
        print(f"not running (state in {state_dir})")
        return 1
    url = state.get("url")
    health = "no answer"
    if url:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(f"{url}/health", timeout=2, trust_env=False)
            health = "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
    print(
        f"cluster:  {state['phase']} (supervisor pid {state['pid']}), {url or '-'} /health: {health}"
    )
    print(f"proxy:    {state.get('ingress_proxy') or '-'} (http.ingress_proxy)")
    print(f"ray:      {state.get('ray_address') or '-'}")
    etcd = state.get("etcd_endpoints") or []
    print(
        f"etcd:     {', '.join(etcd) or '-'}{' (started by loraplex)' if state.get('etcd_pid') else ''}"
    )
    if url and health == "ok":
        report = adapter_homes_report(url, status_metrics_key(state_dir), full_ids)
        print("\n".join(report))
    if not state.get("ray_address"):
        return 0
    try:
        lines = serve_report(state["ray_address"], full_ids)
    except Exception as e:  # a half-started cluster: show what is known
        lines = [f"serve:    unavailable ({type(e).__name__}: {e})"]
    print("\n".join(lines))
    return 0
