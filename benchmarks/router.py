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
                    with the batch), the time a request holds a slot. Once the replicas
                    publish their own measurements (replica/step_costs.py, after 32 steps)
                    the router uses those for the busy and host-load costs
    loads_ratio_vs_best_baseline = min(baseline adapter_loads) / affinity adapter_loads
    p99_ratio_vs_best_baseline   = min(baseline p99_ttft_ms) / affinity p99_ttft_ms
    reloads_ratio_vs_best_baseline = min(baseline reloads) / affinity reloads

The routers run one after another on a shared machine: each one's `load_avg_1m` (before,
after) shows whether other processes competed with it for the cores.

Section `fairness` (benchmarks/router_fairness.py): a tenant flooding at ten times its share
beside one within it, through the ingress and one replica; `fairness.b_p99_ttft_ratio`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.benchmarks.engine import SERVING_TARGETS, zipf_adapters
from loraplex.benchmarks.report import log
from loraplex.benchmarks.router_apps import build_app
from loraplex.benchmarks.router_costs import measure_router_costs
from loraplex.benchmarks.router_figures import (
    PAGE_BYTES,
    router_figures,
    summary,
)
from loraplex.benchmarks.router_workload import BenchRequest, Outcome, Workload
from loraplex.demo.lean_ray import lean_ray_serve
from loraplex.demo.synthetic import AdapterSpec, ModelSpec, write_adapter, write_checkpoint
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.etcd_client import EtcdSettings
from loraplex.registry.etcd_process import EtcdProcess
from loraplex.registry.models import AdapterRecord, Tenant
from loraplex.registry.store import RegistryStore
from loraplex.replica.memory.adapters import load_adapter, plan_layout
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.protocol import GenerateRequest, adapter_id
from loraplex.router.serve_backend import ServeBackend

ROUTERS = ("affinity", "pow2", "multiplex")
TENANT = "bench"


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


def measure(workload: Workload, routers: tuple[str, ...] = ROUTERS) -> dict[str, Any]:
    """Serve the workload once per router; the figures, and per request raw timings."""
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-router-") as tmp:
        root = Path(tmp)
        model_dir, sources = _write_assets(root, workload)
        engine_config = _engine_config(model_dir, sources, workload)
        costs = measure_router_costs(engine_config, sources, workload)
        log("router costs measured here: " + ", ".join(f"{k}={v:.4f}" for k, v in costs.items()))
        etcd = EtcdProcess(root / "etcd")
        etcd.start()
        try:
            settings = EtcdSettings(endpoints=[etcd.endpoint])
            artifacts = ArtifactStore(root / "artifacts")
            paths = asyncio.run(_register(settings, artifacts, sources))
            requests = _requests(list(paths), workload)
            per_router = {}
            with lean_ray_serve():
                for router in routers:
                    app = build_app(
                        router, workload, engine_config, settings, artifacts, paths, costs
                    )
                    per_router[router] = _serve(router, app, requests, workload)
        finally:
            etcd.stop(kill=True)
    return {**summary(workload, engine_config, requests, per_router), "router_costs": costs}


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
    """Register every adapter; their artifact folders by adapter (version) id, in the order
    of `sources` (what multiplex reads)."""
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
            paths[adapter_id(TENANT, name, stored.digest)] = str(artifacts.path_of(stored.path))
    return paths


# -- the workload ------------------------------------------------------------------------------


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
        **router_figures(outcomes, elapsed, replicas),
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
