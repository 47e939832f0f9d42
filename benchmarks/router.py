"""`loraplex bench router`: three request routers over the same replicas and the same load.

One run starts a real etcd (the adapters are registered there and in an artifact store) and
a local Ray, then serves one seeded workload three times, each on a fresh Serve app of
`num_replicas` replicas of one engine configuration, deleted before the next:

    affinity   ReplicaDeployment behind AffinityRequestRouter (replica/deployment.py)
    pow2       the same deployment behind Ray Serve's default power-of-two-choices router
    multiplex  MultiplexedReplica: the same engine, adapters loaded by `@serve.multiplexed`
               (at most `adapters_per_replica` per replica), Serve's multiplex routing

Every request goes through ServeBackend (one streaming `generate`, the adapter as the
multiplexed model id; the pow2 replicas report no model ids, so Serve's multiplex preference
is empty there and it picks by power of two). Open loop: Poisson arrivals at `rate_per_s`,
Zipf(a) adapter popularity, short prompts and outputs, greedy, ignore_eos.

Each replica's device pool (the engine's unified pool) is sized to hold a full batch's KV
plus `adapters_per_replica` adapters of mean size, and multiplex keeps that many adapters
per replica, so all three have one per-replica adapter capacity. The default workload has
more adapters than one replica holds (30 against 12) but fewer than all three hold
together (36): the case a router decides, since below it every router hits and above it
every router must evict.

    adapter_loads   adapter weights copied into a replica's device pool: the sum over replicas
                    of the engine's AdapterCache loads (for multiplex each multiplexed load is
                    registered under a name of its own, so it is one pool load on first use)
    artifact_reads  adapters read from the artifact store (AdapterSync reads, or multiplexed
                    loads)
    distinct_adapters_requested  the fewest loads (and reads) any router can make
    reloads         adapter_loads - distinct_adapters_requested: the loads a router caused,
                    beyond the first load of each adapter that every router makes
    ttft            client side, from the request's scheduled arrival to its first chunk
    router_costs    what the affinity router is told about this machine (AffinityConfig), as
                    measured here before the runs: a load from the artifact store and from
                    the host tier, the TTFT each running request adds (a CPU step grows
                    with the batch), the time a request holds a slot
    loads_ratio_vs_best_baseline = min(baseline adapter_loads) / affinity adapter_loads
    p99_ratio_vs_best_baseline   = min(baseline p99_ttft_ms) / affinity p99_ttft_ms
    reloads_ratio_vs_best_baseline = min(baseline reloads) / affinity reloads

The routers run one after another on a shared machine: each one's `load_avg_1m` (before,
after) shows whether other processes competed with it for the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.benchmarks.engine import SERVING_TARGETS, zipf_adapters
from loraplex.benchmarks.report import log, write_json
from loraplex.cluster.demo_assets import AdapterSpec, ModelSpec, write_adapter, write_checkpoint
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.etcd_client import EtcdSettings
from loraplex.registry.etcd_process import INSTALL_HINT, EtcdProcess, find_etcd_binary
from loraplex.registry.models import AdapterRecord, Tenant
from loraplex.registry.store import RegistryStore
from loraplex.replica.adapters import load_adapter, plan_layout
from loraplex.replica.deployment import ReplicaDeployment, build_engine_config, deployment
from loraplex.replica.engine import Engine, LLMEngine
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.protocol import GenerateChunk, GenerateRequest, adapter_id, chunk
from loraplex.replica.protocol import sampling_params as to_sampling_params
from loraplex.replica.sampling import SamplingParams
from loraplex.router.serve_backend import ServeBackend

ROUTERS = ("affinity", "pow2", "multiplex")
BASELINES = ("pow2", "multiplex")
TENANT = "bench"
PAGE_BYTES = 64 * 1024
REPLICA_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # 3 engines share 2 cores


@dataclass(frozen=True, slots=True)
class Workload:
    model: ModelSpec
    num_adapters: int
    num_replicas: int
    adapters_per_replica: int  # device-pool capacity (adapters of mean size); multiplex K
    num_requests: int
    rate_per_s: float
    zipf_a: float = 1.1
    prompt_tokens: tuple[int, int] = (16, 32)  # inclusive range
    output_tokens: tuple[int, int] = (8, 16)
    ranks: tuple[int, int] = (8, 64)
    max_num_seqs: int = 16
    routing_stats_period_s: float = 1.0
    request_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.adapters_per_replica < self.num_adapters:
            raise ValueError(
                f"adapters_per_replica must be in [1, num_adapters): more adapters than fit on "
                f"one replica, got {self.adapters_per_replica} of {self.num_adapters}"
            )
        if not (self.num_requests > 0 and self.rate_per_s > 0 and self.num_replicas > 0):
            raise ValueError("num_requests, rate_per_s and num_replicas must be > 0")


FULL = Workload(
    ModelSpec(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        rope_scaling=None,
    ),
    num_adapters=30,
    num_replicas=3,
    adapters_per_replica=12,
    num_requests=600,
    rate_per_s=25.0,  # near what 3 replicas on 2 cores serve (~28/s): queues form
)
QUICK = replace(FULL, num_requests=200)


def run_bench(args: argparse.Namespace) -> int:
    if find_etcd_binary() is None:
        log(f"no etcd server binary; install one: {INSTALL_HINT}")
        return 2
    workload = QUICK if args.quick else FULL
    results = {"quick": bool(args.quick), **measure(workload)}
    _print_table(results)
    write_json(args.json, results)
    return 0


def measure(workload: Workload, routers: tuple[str, ...] = ROUTERS) -> dict[str, Any]:
    """Serve the workload once per router; the figures, and per request raw timings."""
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-router-") as tmp:
        root = Path(tmp)
        model_dir, sources = _write_assets(root, workload)
        engine_config = _engine_config(model_dir, sources, workload)
        requests = _requests([adapter_id(TENANT, n) for n in sources], workload)
        costs = measure_router_costs(engine_config, sources, workload)
        log("router costs measured here: " + ", ".join(f"{k}={v:.4f}" for k, v in costs.items()))
        etcd = EtcdProcess(root / "etcd")
        etcd.start()
        try:
            settings = EtcdSettings(endpoints=[etcd.endpoint])
            artifacts = ArtifactStore(root / "artifacts")
            paths = asyncio.run(_register(settings, artifacts, sources))
            per_router = {}
            with _ray():
                for router in routers:
                    app = _app(router, workload, engine_config, settings, artifacts, paths, costs)
                    per_router[router] = _serve(router, app, requests, workload)
        finally:
            etcd.stop(kill=True)
    return {**_summary(workload, engine_config, requests, per_router), "router_costs": costs}


# -- assets and registry ----------------------------------------------------------------------


def _write_assets(root: Path, w: Workload) -> tuple[Path, dict[str, Path]]:
    """The model, and `num_adapters` adapters of ranks in `w.ranks`, SERVING_TARGETS in turn."""
    model_dir = root / "model"
    write_checkpoint(model_dir, w.model, seed=w.seed, with_tokenizer=False)
    ranks = np.random.default_rng(w.seed).integers(w.ranks[0], w.ranks[1] + 1, w.num_adapters)
    sources = {}
    for i, rank in enumerate(ranks.tolist()):
        name = f"a{i:02d}-r{rank}"
        spec = AdapterSpec(name, rank, 2.0 * rank, SERVING_TARGETS[i % 4], 1000 + i)
        write_adapter(root / "src" / name, w.model, spec)
        sources[name] = root / "src" / name
    return model_dir, sources


def _engine_config(model_dir: Path, sources: dict[str, Path], w: Workload) -> dict[str, Any]:
    """A pool of a full batch's KV blocks plus `adapters_per_replica` adapters of mean size."""
    model = ModelConfig.from_pretrained(model_dir)
    page_elems = PAGE_BYTES // 4  # float32 checkpoint
    pages = [
        plan_layout(load_adapter(p, n, model, w.ranks[1]), page_elems, model.num_layers)[
            0
        ].num_pages
        for n, p in sources.items()
    ]
    block_tokens = page_elems // model.kv_elems_per_token()
    kv_pages = w.max_num_seqs * math.ceil((w.prompt_tokens[1] + w.output_tokens[1]) / block_tokens)
    adapter_pages = math.ceil(w.adapters_per_replica * sum(pages) / len(pages))
    return {
        "model": str(model_dir),
        "page_bytes": PAGE_BYTES,
        "pool_bytes": (kv_pages + adapter_pages) * PAGE_BYTES,
        "scheduler": {"max_num_seqs": w.max_num_seqs},
    }


async def _register(
    settings: EtcdSettings, artifacts: ArtifactStore, sources: dict[str, Path]
) -> dict[str, str]:
    """Register every adapter; their artifact folders by adapter id (what multiplex reads)."""
    paths = {}
    async with RegistryStore(settings) as store:
        await store.create_tenant(Tenant(name=TENANT, adapter_quota=len(sources)))
        for name, source in sources.items():
            stored = artifacts.put_dir(source)
            config = json.loads((source / "adapter_config.json").read_text())
            await store.create_adapter(
                AdapterRecord(
                    name=name,
                    tenant=TENANT,
                    base_model="bench-tiny-llama",
                    rank=config["r"],
                    alpha=config["lora_alpha"],
                    target_modules=config["target_modules"],
                    dtype="float32",
                    size_bytes=(source / "adapter_model.safetensors").stat().st_size,
                    sha256=stored.weights_sha256,
                    artifact=stored.path,
                )
            )
            paths[adapter_id(TENANT, name)] = str(artifacts.path_of(stored.path))
    return paths


# -- the router's costs on this machine --------------------------------------------------------


def measure_router_costs(
    engine_config: dict[str, Any], sources: dict[str, Path], w: Workload
) -> dict[str, float]:
    """AffinityConfig cost fields measured on one engine of the replicas' configuration, one
    thread (as each replica runs), before any replica starts. With `segment` the growth of
    a full batch's decode step per distinct adapter in it (the multi-LoRA loop runs once
    per adapter segment) and `out` the mean output tokens:

        host_load_cost_s  host tier -> pool (a first request's extra time) + segment * out:
                          an adapter new to a replica adds its segment to every step while
                          it runs. A replica pays this for an adapter it served before
                          (its host tier keeps it); a first use also reads the artifact
        load_cost_s       + reading the adapter from its folder
        busy_cost_s       2 x the step's growth per sequence, one adapter (a new request
                          waits out the current step, then runs its prefill step)
        request_time_s    out x the step time of a full batch of distinct adapters
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine(build_engine_config(engine_config))
        names = list(sources)[: min(w.adapters_per_replica, w.max_num_seqs)]
        prompt = list(range(10, 10 + sum(w.prompt_tokens) // 2))
        reads, copies = [], []
        for name in names:
            start = time.perf_counter()
            engine.add_adapter(name, sources[name])
            reads.append(time.perf_counter() - start)
            cold, warm = (_one_token(engine, prompt, name) for _ in range(2))
            copies.append(max(0.0, cold - warm))
        full = w.max_num_seqs
        one = _decode_step_s(engine, prompt, names[:1])
        same = _decode_step_s(engine, prompt, names[:1] * full)
        mixed = _decode_step_s(engine, prompt, [names[i % len(names)] for i in range(full)])
    finally:
        torch.set_num_threads(threads)
    out = sum(w.output_tokens) / 2
    segment = max(0.0, mixed - same) / max(1, len(names) - 1)
    host = float(np.median(copies)) + segment * out
    return {
        "load_cost_s": float(np.median(reads)) + host,
        "host_load_cost_s": host,
        "busy_cost_s": 2 * max(0.0, same - one) / (full - 1),
        "request_time_s": out * mixed,
    }


def _one_token(engine: LLMEngine, prompt: list[int], adapter: str) -> float:
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), adapter)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def _decode_step_s(engine: LLMEngine, prompt: list[int], adapters: list[str]) -> float:
    """Fastest of 5 decode steps of a batch of len(adapters) sequences."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(prompt, params, adapter) for adapter in adapters]
    while any(s.num_computed < len(s.prompt_ids) for s in seqs):  # prefill done
        engine.step()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for seq in seqs:
        engine.abort(seq.request_id)
    return min(times)


# -- the workload ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchRequest:
    at_s: float  # arrival, from the start of the run
    adapter: str
    prompt: list[int]
    max_tokens: int


def _requests(adapters: list[str], w: Workload) -> list[BenchRequest]:
    rng = np.random.default_rng(w.seed)
    arrivals = np.cumsum(rng.exponential(1.0 / w.rate_per_s, w.num_requests)).tolist()
    popularity = rng.permutation(adapters).tolist()  # Zipf rank independent of adapter size
    picks = zipf_adapters(popularity, w.num_requests, seed=w.seed, a=w.zipf_a)
    prompts = rng.integers(w.prompt_tokens[0], w.prompt_tokens[1] + 1, w.num_requests)
    outputs = rng.integers(w.output_tokens[0], w.output_tokens[1] + 1, w.num_requests)
    vocab = w.model.vocab_size
    return [
        BenchRequest(at, adapter, rng.integers(10, vocab, int(p)).tolist(), int(o))
        for at, adapter, p, o in zip(arrivals, picks, prompts, outputs, strict=True)
    ]


@dataclass(slots=True)
class Outcome:
    ttft_s: float | None = None
    latency_s: float | None = None
    tokens: int = 0
    error: str | None = None


async def _drive(backend: ServeBackend, requests: list[BenchRequest], tag: str, timeout_s: float):
    start = time.perf_counter()

    async def one(i: int, r: BenchRequest) -> Outcome:
        arrival = start + r.at_s
        await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        outcome = Outcome()
        request = GenerateRequest(
            request_id=f"{tag}-{i}",
            prompt_token_ids=r.prompt,
            adapter=r.adapter,
            params={"max_tokens": r.max_tokens, "temperature": 0.0, "ignore_eos": True},
        )
        try:
            async with asyncio.timeout(timeout_s):
                async for piece in backend.generate(request):
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.perf_counter() - arrival
                    outcome.tokens += len(piece["new_token_ids"])
            outcome.latency_s = time.perf_counter() - arrival
        except Exception as e:  # counted and reported, never hidden
            outcome.error = repr(e)
        return outcome

    outcomes = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return outcomes, time.perf_counter() - start


# -- the three apps ----------------------------------------------------------------------------


async def _engine_counters(engine: Engine) -> dict[str, int]:
    stats = await engine.stats()
    adapters = stats["adapters"]
    return {
        "loads": adapters["loads"],
        "hits": adapters["hits"],
        "evictions": adapters["evictions"],
        "registered": adapters["registered"],
        "resident": len(adapters["resident"]),
        "preemptions": stats["preemptions"],
    }


class BenchReplica(ReplicaDeployment):
    """ReplicaDeployment, plus its engine's adapter counters in its routing stats, under
    "bench" (a key routers ignore), where the bench reads each replica's."""

    async def record_routing_stats(self) -> dict[str, Any]:
        assert self.engine is not None
        stats = await super().record_routing_stats()
        return {**stats, "bench": await _engine_counters(self.engine)}


class AdapterLease:
    """One multiplexed load of an adapter, registered in the engine as `name` (unique per load,
    so reloading an adapter never collides with an evicted copy still in use). Serve calls
    `__del__` when it evicts the lease; the engine drops the weights once the lease's last
    request ends, since removing them at once would abort that adapter's queued requests."""

    def __init__(self, engine: Engine, name: str, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.name = name
        self.loop = loop
        self.users = 0
        self.evicted = False
        self.removal: asyncio.Task | None = None

    def release(self) -> None:
        self.users -= 1
        self.drop_if_unused()

    def drop_if_unused(self) -> None:
        if self.evicted and self.users == 0 and self.removal is None:
            self.removal = self.loop.create_task(self.engine.remove_adapter(self.name))

    def __del__(self) -> None:
        # Serve calls this from an executor thread on eviction; the garbage collector calls
        # it again later (evicted is then set).
        if self.evicted:
            return
        self.evicted = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            self.loop.call_soon_threadsafe(self.drop_if_unused)


class MultiplexedReplica:
    """Peer baseline: ReplicaDeployment's engine with Ray Serve model multiplexing in place
    of the registry sync; adapters are read from their artifact folders (`paths`)."""

    async def __init__(self, engine_config: dict[str, Any], paths: dict[str, str], k: int):
        from ray import serve

        self.engine = await asyncio.to_thread(Engine, build_engine_config(engine_config))
        self.paths = paths
        self.loads = 0
        self.load_s = 0.0
        self._names = itertools.count()

        async def load(adapter: str) -> AdapterLease:  # a function: Serve tags it with state
            return await self._load(adapter)

        self.lease = serve.multiplexed(max_num_models_per_replica=k)(load)

    async def _load(self, adapter: str) -> AdapterLease:
        start = time.perf_counter()
        name = f"{adapter}#{next(self._names)}"
        await self.engine.add_adapter(name, Path(self.paths[adapter]))
        self.loads += 1
        self.load_s += time.perf_counter() - start
        return AdapterLease(self.engine, name, asyncio.get_running_loop())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        lease = await self.lease(request["adapter"]) if request["adapter"] else None
        if lease is not None:
            lease.users += 1  # no await since the lease was handed over: it cannot be dropped
        outputs = self.engine.generate(
            request["prompt_token_ids"],
            to_sampling_params(request),
            lease.name if lease else None,
            request["request_id"],
        )
        try:
            async for out in outputs:
                yield chunk(out)
        finally:
            await outputs.aclose()
            if lease is not None:
                lease.release()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's default router ignores routing stats: these only carry the counters."""
        counters = await _engine_counters(self.engine)
        return {"bench": {**counters, "multiplexed_loads": self.loads, "load_s": self.load_s}}

    def __del__(self) -> None:
        self.engine.shutdown()


def _app(
    router: str,
    w: Workload,
    engine_config: dict[str, Any],
    settings: EtcdSettings,
    artifacts: ArtifactStore,
    paths: dict[str, str],
    costs: dict[str, float],
):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    common: dict[str, Any] = {
        "num_replicas": w.num_replicas,
        "ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": REPLICA_ENV}},
        "max_ongoing_requests": 64,  # above max_num_seqs: the engine batches, Serve forwards
        "graceful_shutdown_wait_loop_s": 0.2,
        "graceful_shutdown_timeout_s": 2.0,
        "logging_config": {"enable_access_log": False, "log_level": "WARNING"},
    }
    if router == "multiplex":
        return serve.deployment(MultiplexedReplica, name=router, **common).bind(
            engine_config, paths, w.adapters_per_replica
        )
    replica = deployment(
        name=router,
        routing_stats_period_s=w.routing_stats_period_s,
        router_kwargs=costs,
        **common,
    )
    replica = replica.options(func_or_class=BenchReplica)
    if router == "pow2":  # Serve's default router class
        replica = replica.options(request_router_config=RequestRouterConfig())
    return replica.bind(engine_config, settings.model_dump(), str(artifacts.root))


@contextlib.contextmanager
def _ray() -> Iterator[None]:
    import ray
    from ray import serve

    assert not ray.is_initialized(), "the bench starts its own Ray"
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths
    previous = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # else Ray writes a token under $HOME
    try:
        ray.init(
            address="local",  # a new instance, never another user's cluster on this machine
            include_dashboard=False,
            num_cpus=2,
            object_store_memory=200 * 1024 * 1024,
            _temp_dir=temp_dir,
            log_to_driver=False,
        )
        serve.start(proxy_location="Disabled")
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


def _serve(router: str, app, requests: list[BenchRequest], w: Workload) -> dict[str, Any]:
    from ray import serve

    name = f"bench-{router}"
    load_avg = os.getloadavg()[0]  # other processes on the machine skew latencies
    started = time.perf_counter()
    handle = serve.run(app, name=name, route_prefix=None)
    log(f"{router}: {w.num_replicas} replicas up in {time.perf_counter() - started:.1f}s")
    try:
        backend = ServeBackend(handle, retries=0)
        outcomes, elapsed = asyncio.run(_warm_up_and_drive(backend, requests, router, w))
        replicas = _replica_counters(name, router)
    finally:
        serve.delete(name)
    done = sum(o.error is None for o in outcomes)
    log(f"{router}: {done}/{len(outcomes)} requests in {elapsed:.1f}s")
    return {
        **_router_figures(outcomes, elapsed, replicas),
        "load_avg_1m": [load_avg, os.getloadavg()[0]],
    }


async def _warm_up_and_drive(
    backend: ServeBackend, requests: list[BenchRequest], router: str, w: Workload
) -> tuple[list[Outcome], float]:
    """Base-model requests first (no adapter loads) so every replica ran a forward, and a
    stats period so routers hold every replica's routing stats; then the workload."""
    prompt = list(range(10, 10 + w.prompt_tokens[0]))
    params = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}

    async def warm(i: int) -> None:
        request = GenerateRequest(
            request_id=f"warm-{i}", prompt_token_ids=prompt, adapter=None, params=params
        )
        async for _ in backend.generate(request):
            pass

    await asyncio.gather(*(warm(i) for i in range(4 * w.num_replicas)))
    await asyncio.sleep(w.routing_stats_period_s * 1.5)
    return await _drive(backend, requests, router, w.request_timeout_s)


def _replica_counters(app: str, deployment: str) -> list[dict[str, Any]]:
    """Each replica's "bench" counters, asked of the replica actors themselves."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = [
        (entry["name"], entry["namespace"])
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"].startswith(prefix)
    ]
    refs = [ray.get_actor(n, namespace=ns).record_routing_stats.remote() for n, ns in names]
    return [
        {"replica": n.removeprefix(prefix), **stats["bench"]}
        for (n, _), stats in zip(names, ray.get(refs, timeout=30), strict=True)
    ]


# -- figures -----------------------------------------------------------------------------------


def _router_figures(
    outcomes: list[Outcome], elapsed: float, replicas: list[dict[str, Any]]
) -> dict[str, Any]:
    done = [o for o in outcomes if o.error is None]
    ttft = np.array([o.ttft_s for o in done], dtype=float) * 1e3
    latency = np.array([o.latency_s for o in done], dtype=float) * 1e3
    for r in replicas:  # sync-based replicas never drop a read adapter during the run
        r["artifact_reads"] = r.get("multiplexed_loads", r["registered"])
    figures: dict[str, Any] = {
        "adapter_loads": sum(r["loads"] for r in replicas),
        "artifact_reads": sum(r["artifact_reads"] for r in replicas),
        "p50_ttft_ms": _percentile(ttft, 50),
        "p99_ttft_ms": _percentile(ttft, 99),
        "mean_ttft_ms": float(ttft.mean()) if len(ttft) else None,
        "p50_latency_ms": _percentile(latency, 50),
        "p99_latency_ms": _percentile(latency, 99),
        "throughput_rps": len(done) / elapsed,
        "output_tok_per_s": sum(o.tokens for o in done) / elapsed,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for o in outcomes if o.error is not None})[:5],
        "duration_s": elapsed,
        "replicas": replicas,
    }
    reads = sum(r.get("multiplexed_loads", 0) for r in replicas)
    if reads:
        figures["mean_multiplexed_load_ms"] = sum(r["load_s"] for r in replicas) / reads * 1e3
    figures["raw"] = {
        "ttft_ms": [None if o.ttft_s is None else o.ttft_s * 1e3 for o in outcomes],
        "latency_ms": [None if o.latency_s is None else o.latency_s * 1e3 for o in outcomes],
    }
    return figures


def _percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _summary(
    w: Workload,
    engine_config: dict[str, Any],
    requests: list[BenchRequest],
    per_router: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    distinct = len({r.adapter for r in requests})
    for figures in per_router.values():
        figures["reloads"] = figures["adapter_loads"] - distinct

    def ratio(key: str) -> float | None:
        baselines = [per_router[b][key] for b in BASELINES if b in per_router]
        ours = per_router.get("affinity", {}).get(key)
        if not baselines or ours is None or None in baselines:
            return None
        return min(baselines) / ours if ours else math.inf

    workload = asdict(w)
    workload["model"] = {k: v for k, v in workload["model"].items() if k != "rope_scaling"}
    return {
        "workload": workload,
        "capacity": (
            f"{w.adapters_per_replica} adapters of mean size per replica: a device pool of "
            f"{engine_config['pool_bytes'] // PAGE_BYTES} pages of {PAGE_BYTES // 1024} KiB, "
            f"a full batch's KV included; multiplex max_num_models_per_replica="
            f"{w.adapters_per_replica}"
        ),
        # Every adapter requested is loaded at least once, whatever the router.
        "distinct_adapters_requested": distinct,
        "adapter_loads": {r: f["adapter_loads"] for r, f in per_router.items()},
        "reloads": {r: f["reloads"] for r, f in per_router.items()},
        "p50_ttft_ms": {r: f["p50_ttft_ms"] for r, f in per_router.items()},
        "p99_ttft_ms": {r: f["p99_ttft_ms"] for r, f in per_router.items()},
        "loads_ratio_vs_best_baseline": ratio("adapter_loads"),
        "p99_ratio_vs_best_baseline": ratio("p99_ttft_ms"),
        "reloads_ratio_vs_best_baseline": ratio("reloads"),
        "routers": per_router,
        "requests": {
            "arrival_s": [r.at_s for r in requests],
            "adapter": [r.adapter for r in requests],
        },
    }


def _print_table(r: dict[str, Any]) -> None:
    w = r["workload"]
    print(
        f"{w['num_requests']} requests at {w['rate_per_s']:g}/s over {w['num_adapters']} "
        f"adapters (Zipf a={w['zipf_a']}, {r['distinct_adapters_requested']} requested: the "
        f"fewest loads possible), {w['num_replicas']} replicas\ncapacity: {r['capacity']}"
    )
    print(
        f"{'router':10} {'loads':>6} {'reloads':>7} {'reads':>6} {'p50 ttft':>9} {'p99 ttft':>9} "
        f"{'p99 e2e':>9} {'req/s':>6} {'done':>5} {'loadavg':>8}"
    )
    for name, f in r["routers"].items():
        print(
            f"{name:10} {f['adapter_loads']:6d} {f['reloads']:7d} {f['artifact_reads']:6d} "
            f"{_ms(f['p50_ttft_ms'])} {_ms(f['p99_ttft_ms'])} {_ms(f['p99_latency_ms'])} "
            f"{f['throughput_rps']:6.2f} {f['completed']:5d} {max(f['load_avg_1m']):8.1f}"
        )
    costs = ", ".join(f"{k} {v * 1e3:.2f}ms" for k, v in r["router_costs"].items())
    print(f"affinity router told (measured here): {costs}")
    for key, target in (
        ("loads_ratio_vs_best_baseline", 3),
        ("p99_ratio_vs_best_baseline", 2),
        ("reloads_ratio_vs_best_baseline", None),
    ):
        value = r[key]
        shown = "n/a" if value is None else f"{value:.2f}"
        print(
            f"{key:30} {shown:>8}  " + ("(reported)" if target is None else f"target >= {target}")
        )


def _ms(value: float | None) -> str:
    return f"{'n/a':>9}" if value is None else f"{value:7.1f}ms"
