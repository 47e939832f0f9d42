"""`loraplex bench router`, section `fairness`: does a tenant that floods the cluster starve
another tenant?

A real local Serve app reached through Serve's HTTP proxy: the ingress (router/ingress.py:
keys, per-tenant limits) over one replica (replica/deployment.py: the engine and its
scheduler), tenants and keys in the registry on a real etcd. Two tenants send streamed
completions of the base model (token-id prompts, greedy, ignore_eos) over HTTP:

    B  open loop, Poisson at `b_rate_per_s`, short outputs
    A  `flood_streams` (64) streams of `flood_tokens` (256) tokens kept open from
       `flood_lead_s` before B's first request to its last (a stream that ends is followed
       by another): 8x the replica's batch, well inside a tenant's default 256 in flight
       (issue 27's flood)

Rounds alternate two windows with the same seeded schedule of B's requests, so that drift
in the machine's load falls on both alike:

    quiet   B alone
    flood   B, and A flooding

and each round runs on two apps in turn:

    protected    the defaults: the ingress's per-tenant limits (256 in flight) and the
                 scheduler's fair admission across tenants (a tenant over its share of a full
                 batch gives a slot back)
    unprotected  no in-flight limit; one FIFO queue for every tenant

and then, on a second Ray started with `http.ingress_proxy: haproxy` (HAProxy in front of
Serve's direct ingress instead of Serve's proxy actor: cluster/ingress_proxy.py), the
protected app once more (`protected_haproxy`): what the path to the ingress costs B.

Keys (TTFT: from a request's scheduled arrival to its first streamed event, at the client):

    b_p99_ttft_ratio              B's p99 TTFT in flood windows / in quiet windows, protected
                                  (target <= 1.5), over every round's requests (85 a kind)
    b_p99_ttft_ratio_ci_low/high  its 90% bootstrap interval: B's requests of each window
                                  kind resampled (a p99 of 85 rests on its top one or two, so the
                                  interval is wide: it says how far one run can be trusted)
    b_p50_ttft_ratio (+ _ci_*)    the same of the medians
    b_p99_ttft_ratio_unprotected  the same on the unprotected app
    b_p99_ttft_ratio_haproxy, b_p50_ttft_ratio_haproxy (+ _ci_*)
                                  the same of protected_haproxy (HAProxy's stats page and
                                  exporter bind every interface, on free ports, while it runs)
    a_429s, b_429s                requests refused for the tenant's in-flight limit, protected
                                  apps
    apps.<app>.<window>.<tenant>  offered, completed, cut, 429s, failed, p50/p99 TTFT per window
                                  (A's streams still open at a window's end are `cut`: offered,
                                  neither completed nor failed)
                                  (B's: every TTFT too, `ttft_ms`)
    apps.<app>.flood.a_chunks_per_s  streamed chunks of A's the client received a second: what
                                  the relay carried
    apps.<app>.<window>.cores_used  cores each process kept busy (Serve's proxy actor, or
                                  HAProxy's manager actor and `haproxy` itself; the ingress, the
                                  replica, this client), mean over the windows: where the
                                  machine's two cores went
    load_avg_1m                   before and after each app's rounds
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from ray import serve

from loraplex.benchmarks.report import log
from loraplex.benchmarks.router.runs import no_client_gc
from loraplex.demo.lean_ray import lean_ray_serve
from loraplex.demo.synthetic import ModelSpec, write_checkpoint
from loraplex.net import free_port
from loraplex.registry.auth import new_api_key
from loraplex.registry.etcd_client import EtcdSettings
from loraplex.registry.etcd_process import EtcdProcess
from loraplex.registry.models import Tenant
from loraplex.registry.store import RegistryStore
from loraplex.replica.deployment import deployment
from loraplex.router.limits import IngressLimits
from loraplex.router.settings import RouterSettings

TENANTS = ("a", "b")
ADMIN_KEY = "fairness-bench-admin-key"
APPS = ("protected", "unprotected")
MAX_MODEL_LEN = 512
REPLICA_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_QUIET_SERVE = {"enable_access_log": False, "log_level": "WARNING"}


@dataclass(frozen=True, slots=True)
class FairnessWorkload:
    model: ModelSpec
    b_rate_per_s: float = 4.0
    flood_streams: int = 64
    flood_tokens: int = 256
    flood_lead_s: float = 1.0
    window_s: float = 10.0
    rounds: int = 3
    max_num_seqs: int = 8
    prompt_tokens: tuple[int, int] = (16, 32)  # inclusive range
    output_tokens: tuple[int, int] = (8, 16)
    request_timeout_s: float = 60.0
    seed: int = 0
    # the paths to the ingress the protected app runs behind (http.ingress_proxy)
    ingress_proxies: tuple[str, ...] = ("serve", "haproxy")


FAIRNESS_MODEL = ModelSpec(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=None,  # the demo tokenizer's (the ingress needs a tokenizer)
    rope_scaling=None,
)
FULL = FairnessWorkload(FAIRNESS_MODEL)
# 5 rounds of 6 s: B's p99 over 85 requests per window kind (the seeded schedules), near the
# full run's 95 in 3 of 10 s (3 rounds gave ~56, whose p99 is nearly their maximum)
QUICK = replace(FULL, window_s=6.0, rounds=5)


@serve.ingress()
class FairnessIngress:
    """router/ingress.py's app over a ServeBackend to the replica, with the registry of the
    bench's etcd (the same assembly as cluster/app.py's Ingress, from plain arguments)."""

    def __init__(
        self, replicas, model_dir: str, etcd: dict, artifact_root: str, limits: dict
    ) -> None:
        self.replicas, self.model_dir = replicas, model_dir
        self.etcd, self.artifact_root, self.limits = etcd, artifact_root, limits

    async def __serve_build_asgi_app__(self):
        from loraplex.model_shape import read_model_shape
        from loraplex.registry.api import RegistryAPISettings
        from loraplex.registry.artifacts import ArtifactStore
        from loraplex.registry.watch import RegistryWatcher
        from loraplex.replica.tokenizer import Tokenizer
        from loraplex.router.ingress import RegistryHandles, build_ingress
        from loraplex.router.serve_backend import ServeBackend

        etcd = EtcdSettings(**self.etcd)
        settings = RegistryAPISettings(
            admin_key=ADMIN_KEY,
            base_model_id="bench",
            base_model=read_model_shape(self.model_dir),
        )
        registry = RegistryHandles(
            RegistryStore(etcd), RegistryWatcher(etcd), ArtifactStore(self.artifact_root), settings
        )
        return build_ingress(
            ServeBackend(self.replicas, first_chunk_timeout_s=60.0),
            await asyncio.to_thread(Tokenizer, Path(self.model_dir)),
            base_model_id="bench",
            max_model_len=MAX_MODEL_LEN,
            registry=registry,
            limits=IngressLimits(**self.limits),
        )


# -- the run --------------------------------------------------------------------------------


def measure_fairness(w: FairnessWorkload) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-fairness-") as tmp:
        root = Path(tmp)
        model_dir = root / "model"
        write_checkpoint(model_dir, w.model, seed=w.seed)
        etcd = EtcdProcess(root / "etcd")
        etcd.start()
        try:
            settings = EtcdSettings(endpoints=[etcd.endpoint])
            keys = asyncio.run(_tenants(settings))
            per_app = {}
            for proxy in w.ingress_proxies:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                with lean_ray_serve(http_port=port, ingress_proxy=proxy):
                    # Serve's proxy: both apps; HAProxy: the protected one, what it changes
                    for name in APPS if proxy == "serve" else APPS[:1]:
                        app = _app(name, w, model_dir, settings, root / "artifacts")
                        key = name if proxy == "serve" else f"{name}_{proxy}"
                        per_app[key] = _serve(name, app, url, keys, w)
        finally:
            etcd.stop(kill=True)
    return _summary(w, per_app)


async def _tenants(settings: EtcdSettings) -> dict[str, str]:
    """Tenants a and b, with no limits of their own (the app's defaults apply); their keys."""
    keys = {}
    async with RegistryStore(settings) as store:
        for name in TENANTS:
            key, digest = new_api_key()
            await store.create_tenant(Tenant(name=name, api_key_hashes=[digest]))
            keys[name] = key
    return keys


def _app(name: str, w: FairnessWorkload, model_dir: Path, etcd: EtcdSettings, artifacts: Path):
    protected = name == "protected"
    engine = {
        "model": str(model_dir),
        "max_model_len": MAX_MODEL_LEN,
        "page_bytes": 64 << 10,
        "pool_bytes": 256 * (64 << 10),
        "scheduler": {"max_num_seqs": w.max_num_seqs, "tenant_fairness": protected},
    }
    limits = IngressLimits() if protected else IngressLimits(tenant_max_requests_in_flight=None)
    router = RouterSettings()
    replica = deployment(
        name="replica",
        routing_stats_period_s=router.stats_period_s,
        routing_stats_timeout_s=router.stats_timeout_s,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": REPLICA_ENV}},
        max_ongoing_requests=4096,  # the engine queues; Serve only forwards
        graceful_shutdown_wait_loop_s=0.2,
        graceful_shutdown_timeout_s=2.0,
        logging_config=_QUIET_SERVE,
    ).bind(engine, etcd.model_dump(), str(artifacts))
    ingress = serve.deployment(
        FairnessIngress,
        name="ingress",
        num_replicas=1,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0},
        logging_config=_QUIET_SERVE,
    )
    return ingress.bind(
        replica, str(model_dir), etcd.model_dump(), str(artifacts), limits.model_dump()
    )


@dataclass(frozen=True, slots=True)
class Request:
    at_s: float
    tenant: str
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    tenant: str
    status: int | None = None
    ttft_s: float | None = None
    error: str | None = None
    cut: bool = False  # an A stream still open when the window ended: offered, not completed


def _schedule(w: FairnessWorkload, tenant: str, rate: float, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    out, at = [], 0.0
    while True:
        at += rng.exponential(1.0 / rate)
        if at >= w.window_s:
            return out
        prompt = rng.integers(10, 500, rng.integers(*w.prompt_tokens, endpoint=True))
        max_tokens = int(rng.integers(*w.output_tokens, endpoint=True))
        out.append(Request(float(at), tenant, prompt.tolist(), max_tokens))


def _serve(name: str, app, url: str, keys: dict[str, str], w: FairnessWorkload) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    serve.run(app, name=f"fairness-{name}", route_prefix="/")
    log(f"fairness {name}: app up in {time.perf_counter() - started:.1f}s")
    windows: dict[str, list[Outcome]] = {"quiet": [], "flood": []}
    cpu: dict[str, list[dict[str, float]]] = {"quiet": [], "flood": []}
    a_chunks, flood_s = [0], 0.0
    try:
        asyncio.run(_warm_up(url, keys))
        pids = {**_serve_pids(f"fairness-{name}"), "client": os.getpid()}
        for r in range(w.rounds):
            b = _schedule(w, "b", w.b_rate_per_s, w.seed * 1000 + r)
            for window, flood in (("quiet", None), ("flood", w)):
                before, began = _cpu_seconds(pids), time.perf_counter()
                with no_client_gc():
                    outcomes = asyncio.run(
                        _drive(url, keys, b, w.request_timeout_s, flood, a_chunks)
                    )
                cpu[window].append(_cores(before, _cpu_seconds(pids), time.perf_counter() - began))
                if flood is not None:
                    flood_s += time.perf_counter() - began
                    settled = _settle(f"fairness-{name}", w.request_timeout_s)
                    log(f"fairness {name} round {r}: the flood's streams ended in {settled:.1f}s")
                windows[window] += outcomes
                log(f"fairness {name} round {r} {window}: {_line(outcomes)}")
    finally:
        serve.delete(f"fairness-{name}")
    figures: dict[str, Any] = {
        window: {t: _figures([o for o in outcomes if o.tenant == t]) for t in TENANTS}
        for window, outcomes in windows.items()
    }
    for window, outcomes in windows.items():
        figures[window]["b"]["ttft_ms"] = [round(v, 2) for v in _ttfts_ms(outcomes, "b")]
    figures["flood"]["a_chunks_per_s"] = a_chunks[0] / flood_s if flood_s else None
    for window, shares in cpu.items():
        figures[window]["cores_used"] = {
            process: float(np.mean([s[process] for s in shares])) for process in shares[0]
        }
    return figures | {"load_avg_1m": [load_before, os.getloadavg()[0]]}


def _settle(app: str, timeout_s: float) -> float:
    """Wait until the replica runs and queues nothing (A's cancelled streams aborted), so the
    next quiet window starts quiet; the seconds it took."""
    replica = serve.get_deployment_handle("replica", app_name=app)
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        stats = replica.stats.remote().result(timeout_s=timeout_s)
        if stats["running"] == 0 and stats["waiting"] == 0:
            return time.perf_counter() - started
        time.sleep(0.1)
    raise RuntimeError(f"the replica of {app} still runs A's flood after {timeout_s:.0f}s")


def _serve_pids(app: str) -> dict[str, int]:
    """Process ids of Serve's HTTP proxy (or HAProxy's manager and `haproxy`, its child) and
    of the app's ingress and replica."""
    import ray

    found = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        actor_name = actor["name"]
        if actor_name.startswith("SERVE_PROXY_ACTOR"):
            kind = "proxy"
        elif actor_name.startswith(f"SERVE_REPLICA::{app}#"):
            kind = actor_name.split("#")[1]  # "ingress" or "replica"
        else:
            continue
        handle = ray.get_actor(actor_name, namespace=actor["namespace"])
        found[kind] = ray.get(handle.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
        if kind == "proxy":
            for pid in _children(found[kind], "haproxy"):
                found["haproxy"] = pid
    return found


def _children(parent: int, name: str) -> list[int]:
    """Pids of `parent`'s child processes called `name` (Linux /proc; none elsewhere)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, fields = stat.read_text().split(" (", 1)[1].rsplit(") ", 1)
        except (OSError, ValueError):
            continue
        if comm == name and int(fields.split()[1]) == parent:
            pids.append(int(stat.parent.name))
    return pids


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each process so far (Linux /proc; NaN elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            seconds[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        except (OSError, IndexError, ValueError):
            seconds[name] = float("nan")
    return seconds


def _cores(before: dict[str, float], after: dict[str, float], elapsed: float) -> dict[str, float]:
    """Cores each process kept busy on average over `elapsed` seconds."""
    return {name: (after[name] - before[name]) / elapsed for name in before}


async def _warm_up(url: str, keys: dict[str, str]) -> None:
    """A few requests of each tenant, so the replica ran a forward and the ingress's watcher
    holds both tenants."""
    body = {"model": "bench", "prompt": list(range(10, 26)), "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as client:
        deadline = time.monotonic() + 60
        for tenant in TENANTS:
            headers = {"Authorization": f"Bearer {keys[tenant]}"}
            while (
                r := await client.post("/v1/completions", json=body, headers=headers)
            ).status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the fairness app does not serve: {r.status_code} {r.text}")
                await asyncio.sleep(0.5)


async def _drive(
    url: str,
    keys: dict[str, str],
    requests: list[Request],
    timeout_s: float,
    flood: FairnessWorkload | None,
    a_chunks: list[int],
) -> list[Outcome]:
    """B's `requests` on their schedule; with `flood`, A's streams from `flood_lead_s` before
    it until B's last request has ended, their chunks counted into `a_chunks[0]` (those of
    streams cut at the end too)."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(
        base_url=url, timeout=timeout_s, limits=limits, trust_env=False
    ) as client:
        a_outcomes: list[Outcome] = []
        streams = []
        if flood is not None:
            rng = np.random.default_rng(flood.seed * 1000 + 500)
            for _ in range(flood.flood_streams):
                prompt = rng.integers(10, 500, rng.integers(*flood.prompt_tokens, endpoint=True))
                a = Request(0.0, "a", prompt.tolist(), flood.flood_tokens)
                streams.append(
                    asyncio.create_task(_stream_on(client, keys, a, a_outcomes, a_chunks))
                )
            await asyncio.sleep(flood.flood_lead_s)
        start = time.perf_counter()
        try:
            b_outcomes = await asyncio.gather(*(_one(client, keys, r, start) for r in requests))
        finally:
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        return [*b_outcomes, *a_outcomes]


async def _stream_on(
    client: httpx.AsyncClient,
    keys: dict[str, str],
    r: Request,
    outcomes: list[Outcome],
    chunks: list[int],
) -> None:
    """`r` again and again, each outcome added once its stream has ended, until cancelled; the
    stream open at the cancel is added as `cut` (on a slow machine a window can end before any
    of A's streams has finished, and its figures must still show them offered)."""
    while True:
        outcome = Outcome(r.tenant)
        try:
            await _one(client, keys, r, time.perf_counter(), chunks, outcome)
        except asyncio.CancelledError:
            outcome.cut = True
            raise
        finally:
            outcomes.append(outcome)


async def _one(
    client: httpx.AsyncClient,
    keys: dict[str, str],
    r: Request,
    start: float,
    chunks: list[int] | None = None,
    outcome: Outcome | None = None,
) -> Outcome:
    """`r` streamed at its arrival; its status, TTFT and error filled into `outcome` as they
    come (a new one unless given), so a caller that cancels it still holds what was seen."""
    arrival = start + r.at_s
    outcome = outcome or Outcome(r.tenant)
    await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
    body = {
        "model": "bench",
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {keys[r.tenant]}"}
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            outcome.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                return outcome
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.perf_counter() - arrival
                    if chunks is not None:
                        chunks[0] += 1
    except Exception as e:  # counted and reported, never hidden
        outcome.error = repr(e)
    return outcome


def _line(outcomes: list[Outcome]) -> str:
    parts = []
    for t in TENANTS:
        mine = [o for o in outcomes if o.tenant == t]
        if mine:
            f = _figures(mine)
            parts.append(
                f"{t}: {f['completed']}/{f['offered']} done, {f['cut']} cut, {f['rate_limited']} x 429, "
                f"p99 TTFT {_ms(f['p99_ttft_ms'])}"
            )
    return "; ".join(parts)


def _ttfts_ms(outcomes: list[Outcome], tenant: str | None = None) -> np.ndarray:
    return 1e3 * np.array(
        [o.ttft_s for o in outcomes if o.ttft_s is not None and tenant in (None, o.tenant)],
        dtype=float,
    )


def _figures(outcomes: list[Outcome]) -> dict[str, Any]:
    ttft = _ttfts_ms(outcomes)
    failed = [
        o for o in outcomes if not o.cut and (o.error is not None or o.status not in (200, 429))
    ]
    return {
        "offered": len(outcomes),
        "completed": sum(o.status == 200 and o.error is None and not o.cut for o in outcomes),
        "cut": sum(o.cut for o in outcomes),
        "rate_limited": sum(o.status == 429 for o in outcomes),
        "failed": len(failed),
        "errors": sorted({o.error or str(o.status) for o in failed})[:5],
        "p50_ttft_ms": float(np.percentile(ttft, 50)) if len(ttft) else None,
        "p99_ttft_ms": float(np.percentile(ttft, 99)) if len(ttft) else None,
    }


def _summary(w: FairnessWorkload, per_app: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def ratio(app: str, key: str = "p99_ttft_ms") -> float | None:
        quiet = per_app[app]["quiet"]["b"][key]
        flood = per_app[app]["flood"]["b"][key]
        return None if not quiet or flood is None else flood / quiet

    def interval(app: str, q: float) -> dict[str, float | None]:
        quiet, flood = (per_app[app][window]["b"]["ttft_ms"] for window in ("quiet", "flood"))
        low, high = percentile_ratio_interval(quiet, flood, q)
        return {f"b_p{q:g}_ttft_ratio_ci_low": low, f"b_p{q:g}_ttft_ratio_ci_high": high}

    def ratios(app: str, suffix: str) -> dict[str, float | None]:
        found = {
            "b_p99_ttft_ratio": ratio(app),
            **interval(app, 99),
            "b_p50_ttft_ratio": ratio(app, "p50_ttft_ms"),
            **interval(app, 50),
        }
        return {k.replace("_ratio", f"_ratio{suffix}", 1): v for k, v in found.items()}

    workload = asdict(w)
    workload["model"] = {k: v for k, v in workload["model"].items() if k != "rope_scaling"}
    result: dict[str, Any] = {"workload": workload}
    if "protected" in per_app:
        result |= ratios("protected", "")
        result["b_p99_ttft_ratio_unprotected"] = ratio("unprotected")
    for app in per_app:
        if app.startswith("protected_"):
            result |= ratios(app, app.removeprefix("protected"))
    protected = [per_app[app]["flood"] for app in per_app if app.startswith("protected")]
    result["a_429s"] = sum(p["a"]["rate_limited"] for p in protected)
    result["b_429s"] = sum(p["b"]["rate_limited"] for p in protected)
    return result | {"apps": per_app}


def percentile_ratio_interval(
    quiet: list[float], flood: list[float], q: float, level: float = 0.9, resamples: int = 4000
) -> tuple[float | None, float | None]:
    """The `level` bootstrap interval of percentile q of `flood` / of `quiet`: each list
    resampled with replacement, independently (the windows are). Seeded; (None, None) when
    either list is empty."""
    if not quiet or not flood:
        return None, None
    rng = np.random.default_rng(0)

    def draws(values: list[float]) -> np.ndarray:
        x = np.asarray(values, dtype=float)
        return np.percentile(x[rng.integers(0, len(x), (resamples, len(x)))], q, axis=1)

    ratios = draws(flood) / draws(quiet)
    tail = (1.0 - level) / 2
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1.0 - tail))


def print_fairness(r: dict[str, Any]) -> None:
    w = r["workload"]
    print(
        f"\nfairness: tenant b at {w['b_rate_per_s']:g}/s, tenant a holding "
        f"{w['flood_streams']} streams of {w['flood_tokens']} tokens open (batch "
        f"{w['max_num_seqs']}), {w['rounds']} rounds of {w['window_s']:g} s windows; "
        f"protected: the default limits + fair admission"
    )
    print(
        f"{'app':12} {'window':6} {'tenant':6} {'done':>5} {'cut':>5} {'429':>5} {'failed':>6} "
        f"{'p50 ttft':>9} {'p99 ttft':>9} {'loadavg':>8}"
    )
    for app, windows in r["apps"].items():
        for window in ("quiet", "flood"):
            for tenant in TENANTS:
                f = windows[window][tenant]
                if not f["offered"]:
                    continue
                print(
                    f"{app:12} {window:6} {tenant:6} {f['completed']:5d} {f.get('cut', 0):5d} "
                    f"{f['rate_limited']:5d} "
                    f"{f['failed']:6d} {_ms(f['p50_ttft_ms'])} {_ms(f['p99_ttft_ms'])} "
                    f"{max(windows['load_avg_1m']):8.1f}"
                )
    for app, windows in r["apps"].items():
        for window in ("quiet", "flood"):
            used = ", ".join(f"{p} {c:.2f}" for p, c in windows[window]["cores_used"].items())
            print(f"cores used, {app} {window}: {used}")
        print(f"a's chunks received a second, {app}: {windows['flood']['a_chunks_per_s']:.0f}")
    for key, target in (
        ("b_p99_ttft_ratio", "target <= 1.5"),
        ("b_p50_ttft_ratio", "(reported)"),
        ("b_p99_ttft_ratio_unprotected", "(reported)"),
        ("b_p99_ttft_ratio_haproxy", "(reported: behind HAProxy)"),
        ("b_p50_ttft_ratio_haproxy", "(reported: behind HAProxy)"),
    ):
        if key not in r:
            continue
        value, low, high = r[key], r.get(f"{key}_ci_low"), r.get(f"{key}_ci_high")
        shown = "n/a" if value is None else f"{value:.2f}"
        if low is not None and high is not None:
            shown += f" [{low:.2f}, {high:.2f}]"
        print(f"{key:30} {shown:>20}  {target}")


def _ms(value: float | None) -> str:
    return f"{'n/a':>9}" if value is None else f"{value:7.1f}ms"
