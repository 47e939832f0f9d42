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
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loraplex.cluster.config import APP_NAME, LoraplexConfig
from loraplex.cluster.errors import CLIError
from loraplex.cluster.supervisor import _text, read_state, write_private

DEMO_MODEL_ID = "loraplex-demo-llama"  # the demo adapters' base_model_name_or_path
DEMO_TENANT = "demo"
DEMO_ADAPTER = "sql-r8"
REPLICA_DEPLOYMENT = "replica"
# Modules of the app that `up` needs; named in the error when one is missing.
APP_MODULES = {
    "loraplex.replica.deployment": ("ReplicaDeployment", "deployment"),
    "loraplex.router.ingress": ("build_ingress", "RegistryHandles"),
    "loraplex.router.serve_backend": ("ServeBackend",),
}
_SUPERVISOR = "loraplex.cluster.supervisor"

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
    up.add_argument("--port", type=int, help="HTTP port (overrides http.port)")
    up.add_argument(
        "--address", help="deploy onto this running Ray cluster (e.g. auto) instead of one"
    )
    up.add_argument("--etcd-host", help="address the started etcd listens on (overrides etcd.host)")
    up.add_argument("--object-store-mib", type=int, default=256, help="Ray object store")
    up.add_argument("--timeout", type=float, default=600, help="seconds to wait for serving")
    sub.add_parser("down", parents=[state], help="stop the local cluster (data is kept)")
    sub.add_parser("status", parents=[state], help="replicas, adapters per tier, pool use")


def run(args: argparse.Namespace) -> int:
    # The environment is read here, once: keys for the cluster, Ray's auth mode for drivers.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    state_dir = args.state_dir.expanduser().resolve()
    if args.command == "up":
        return up(args, state_dir, dict(os.environ))
    if args.command == "down":
        return down(state_dir)
    return status(state_dir)


# ---------------------------------------------------------------- up


def up(args: argparse.Namespace, state_dir: Path, env: dict[str, str]) -> int:
    started = time.monotonic()
    check_app_modules()
    state = read_state(state_dir)
    if state and pid_alive(state.get("pid")):
        print(f"loraplex is already running ({state.get('phase')}); `loraplex status` shows it")
        return 0
    config = load_config(args.config)
    if args.port is not None:
        config = config.model_copy(
            update={"http": config.http.model_copy(update={"port": args.port})}
        )
    if args.etcd_host is not None:
        config = config.model_copy(
            update={"etcd": config.etcd.model_copy(update={"host": args.etcd_host})}
        )
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    demo = None
    if config.model is None:
        demo = demo_assets((args.demo_dir or state_dir / "demo-assets").expanduser().resolve())
        config = config.model_copy(
            update={"model": str(demo.model_dir), "model_id": config.model_id or DEMO_MODEL_ID}
        )
    if config.artifact_root is None:
        config = config.model_copy(update={"artifact_root": str(state_dir / "artifacts")})
    if args.address is None:  # on a cluster, the head may not hold the model
        model = Path(config.require_model())
        if not (model / "config.json").is_file():
            raise CLIError(f"model {model} has no config.json (a Hugging Face checkpoint folder)")
        check_port_free(config.http.host, config.http.port)
    admin_key = admin_key_for(state_dir, env.get(config.auth.admin_key_env))

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
    child_env = {**env, config.auth.admin_key_env: admin_key}
    with open(state_dir / "cluster.log", "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", _SUPERVISOR, str(state_dir)],
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


def check_app_modules() -> None:
    """CLIError naming what the app needs and this install lacks."""
    import importlib

    missing = []
    for module, names in APP_MODULES.items():
        try:
            loaded = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{module} ({e})")
            continue
        missing += [f"{module}.{name}" for name in names if not hasattr(loaded, name)]
    if missing:
        raise CLIError(f"the Serve app cannot be built: missing {', '.join(missing)}")


def load_config(path: Path | None) -> LoraplexConfig:
    if path is None:
        return LoraplexConfig()
    try:
        return LoraplexConfig.from_yaml(path)
    except ValueError as e:
        raise CLIError(str(e)) from None


def demo_assets(dest: Path):
    from loraplex.demo.assets import DEMO_ADAPTERS, DemoAssets, make_demo_assets

    names = tuple(a.name for a in DEMO_ADAPTERS)
    complete = (dest / "model" / "config.json").is_file() and all(
        (dest / "adapters" / n / "adapter_model.safetensors").is_file() for n in names
    )
    if complete:
        return DemoAssets(dest / "model", dest / "adapters", names)
    print(f"writing the demo model and adapters to {dest}", file=sys.stderr)
    return make_demo_assets(dest)


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
    if from_env:
        if len(from_env) < 16:
            raise CLIError("the admin key in the environment must have at least 16 characters")
        return from_env
    path = state_dir / "admin_key"
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
    if demo_key:
        print(f"  API key:    {demo_key}  (tenant {DEMO_TENANT}; in {state_dir / 'demo_api_key'})")
    print(f"  state:      {state_dir}  (log: cluster.log); stop with `loraplex down`")
    print("\nTry it:")
    print(f"  export LORAPLEX_URL={url} LORAPLEX_API_KEY={demo_key or '<a tenant key>'}")
    adapter, path = (DEMO_ADAPTER, demo.adapters_dir / DEMO_ADAPTER) if demo else ("mine", "DIR")
    print(f"  loraplex adapters add {adapter} {path}")
    body = {"model": adapter, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
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


def stop_supervisor(pid: int, timeout_s: float = 90.0) -> None:
    """SIGTERM the supervisor and wait; SIGKILL after timeout_s (Ray's processes share its
    fate; a started etcd is then killed by its recorded pid)."""
    if not is_supervisor(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def stop_orphaned_etcd(state: dict, state_dir: Path) -> None:
    """Kill the etcd a killed supervisor left behind: only the pid it recorded, and only
    while that pid still runs etcd on this state folder's data."""
    pid = state.get("etcd_pid")
    if not isinstance(pid, int):
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if str(state_dir / "etcd").encode() in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return is_supervisor(pid)


def is_supervisor(pid: int) -> bool:
    """The pid runs our supervisor (not a process that reused the number)."""
    try:
        return _SUPERVISOR.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return sys.platform != "linux"  # no /proc: trust the pid


# ---------------------------------------------------------------- status


def status(state_dir: Path) -> int:
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
    print(f"ray:      {state.get('ray_address') or '-'}")
    etcd = state.get("etcd_endpoints") or []
    print(
        f"etcd:     {', '.join(etcd) or '-'}{' (started by loraplex)' if state.get('etcd_pid') else ''}"
    )
    if url and health == "ok":
        print("\n".join(adapter_homes_report(url)))
    if not state.get("ray_address"):
        return 0
    try:
        lines = serve_report(state["ray_address"])
    except Exception as e:  # a half-started cluster: show what is known
        lines = [f"serve:    unavailable ({type(e).__name__}: {e})"]
    print("\n".join(lines))
    return 0


def adapter_homes_report(url: str) -> list[str]:
    """The router's view of the busiest adapters, read from the ingress's /metrics: request
    rate and homes (the replicas it is routed to), the rest summed as "other"."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    except httpx.HTTPError as e:
        return [f"adapters: unavailable ({type(e).__name__}: {e})"]
    rates: dict[str, float] = {}
    homes: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            adapter = sample.labels.get("adapter")
            if sample.name == "loraplex_adapter_request_rate":
                rates[adapter] = sample.value
            elif sample.name == "loraplex_adapter_homes":
                counts[adapter] = int(sample.value)
            elif sample.name == "loraplex_adapter_home":
                homes.setdefault(adapter, []).append(sample.labels["replica"])
    if not rates:
        return ["adapters: no requests routed yet"]
    lines = ["adapters: busiest first (router's estimate), their homes"]
    ranked = sorted((a for a in rates if a != "other"), key=rates.__getitem__, reverse=True)
    for adapter in [*ranked, "other"]:
        where = ", ".join(sorted(homes.get(adapter, []))) or f"{counts.get(adapter, 0)} replicas"
        lines.append(f"  {adapter:<32} {rates.get(adapter, 0.0):8.2f}/s  {where}")
    return lines


def serve_report(ray_address: str) -> list[str]:
    """Deployments and their replicas; per replica, its routing stats (adapters per tier,
    queue, pool pages), read from each replica actor."""
    import ray
    from ray import serve

    ray.init(address=ray_address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        app = serve.status().applications.get(APP_NAME)
        if app is None:
            return [f"serve:    application {APP_NAME!r} not deployed"]
        lines = [
            f"app:      {APP_NAME} {_text(app.status)}"
            + (f" ({app.message})" if app.message else "")
        ]
        for name, dep in app.deployments.items():
            counts = ", ".join(f"{n} {_text(s).lower()}" for s, n in dep.replica_states.items())
            message = f"  {dep.message}" if dep.message else ""
            lines.append(f"  {name:<10} {_text(dep.status):<10} {counts}{message}")
        lines += replica_table(ray)
        return lines
    finally:
        ray.shutdown()


def replica_table(ray) -> list[str]:
    prefix = f"SERVE_REPLICA::{APP_NAME}#{REPLICA_DEPLOYMENT}#"
    names = sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith(prefix)
    )
    rows = [("replica", "queue", "pages free/total", "device", "host", "loading")]
    for name in names:
        try:
            stats = ray.get(
                ray.get_actor(name, namespace="serve").record_routing_stats.remote(), timeout=10
            )
        except Exception as e:
            rows.append(
                (name.removeprefix(prefix), f"unavailable: {type(e).__name__}", "", "", "", "")
            )
            continue
        total = stats.get("num_pages")
        pages = f"{stats.get('free_pages', '?')}/{total if total is not None else '?'}"
        rows.append(
            (
                name.removeprefix(prefix),
                str(stats.get("queue_len", "?")),
                pages,
                _names(stats.get("device_adapters")),
                _names(stats.get("host_adapters")),
                _names(stats.get("loading_adapters")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _names(adapters: list[str] | None) -> str:
    return ", ".join(adapters) if adapters else "-"
