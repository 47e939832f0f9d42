"""The three Serve apps `loraplex bench router` compares: ReplicaDeployment behind the
affinity router or Serve's power-of-two router, and the same engine behind Ray Serve model
multiplexing. Each reports its engine's adapter counters, which the bench sums."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.benchmarks.peers.ray_routers import SERVE_LLM_MAX_ONGOING_REQUESTS
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.etcd_client import EtcdSettings
from loraplex.replica.async_engine import Engine
from loraplex.replica.config import build_engine_config
from loraplex.replica.deployment import ReplicaDeployment, deployment
from loraplex.replica.protocol import GenerateChunk, GenerateRequest, chunk, continuation
from loraplex.replica.protocol import sampling_params as to_sampling_params
from loraplex.router.settings import RouterSettings

if TYPE_CHECKING:
    from loraplex.benchmarks.router.workload import Workload

REPLICA_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # 3 engines share 2 cores


async def _engine_counters(engine: Engine) -> dict[str, float]:
    """Device loads (adapter copies into the pool), re-reads of adapters the host budget
    had dropped, and the seconds loads took (re-reads included)."""
    stats = await engine.stats()
    adapters = stats["adapters"]
    prefix = stats.get("prefix_cache") or {}  # prompt tokens asked for and computed
    return {
        "prompt_tokens": prefix.get("prompt_tokens", 0),
        "prompt_tokens_computed": prefix.get("prompt_tokens_computed", 0),
        "loads": adapters["loads"],
        "reads": adapters["disk_reads"],
        "load_seconds": adapters["load_seconds"],
        "hits": adapters["hits"],
        "evictions": adapters["evictions"],
        "registered": adapters["registered"],
        "resident": len(adapters["resident"]),
        "preemptions": stats["preemptions"],
        "steps": stats["steps"],
        "step_seconds": stats["step_seconds"],
    }


class BenchReplica(ReplicaDeployment):
    """ReplicaDeployment, plus its adapter counters in its routing stats, under "bench" (a
    key routers ignore), where the bench reads each replica's: the engine's, and the reads
    the registry sync made from the artifact store (first use of an adapter here)."""

    async def record_routing_stats(self) -> dict[str, Any]:
        assert self.engine is not None and self.sync is not None
        stats = await super().record_routing_stats()
        counters = await _engine_counters(self.engine)
        counters["reads"] += self.sync.reads
        counters["load_seconds"] += self.sync.read_seconds
        return {**stats, "bench": counters}


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
            continuation=continuation(request),  # the ingress resumes streams of a dead replica
        )
        try:
            async for out in outputs:
                yield chunk(out)
        finally:
            await outputs.aclose()
            if lease is not None:
                lease.release()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's default router ignores routing stats: these only carry the counters.
        Every multiplexed load is a read from the artifact store."""
        counters = await _engine_counters(self.engine)
        counters["reads"] += self.loads
        counters["load_seconds"] += self.load_s
        return {"bench": counters}

    def __del__(self) -> None:
        self.engine.shutdown()


def build_app(
    router: str,
    w: Workload,
    engine_config: dict[str, Any],
    settings: EtcdSettings,
    artifacts: ArtifactStore,
    paths: dict[str, str],
    costs: dict[str, float],
):
    """The app of one router. Every app's engines read adapters through the same read model
    and hold the same device pool; sync replicas keep `host_adapters_per_replica` adapters
    of mean size in their host tier, multiplexed ones as many models (Serve's LRU)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    common: dict[str, Any] = {
        "num_replicas": w.num_replicas,
        "ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": REPLICA_ENV}},
        # as Ray Serve LLM deploys its engines (and as loraplex's own default, the ingresses'
        # capacity, does): requests queue in the engine, where it can batch them
        "max_ongoing_requests": SERVE_LLM_MAX_ONGOING_REQUESTS,
        "graceful_shutdown_wait_loop_s": 0.2,
        "graceful_shutdown_timeout_s": 2.0,
        "health_check_period_s": 2.0,
        "logging_config": {"enable_access_log": False, "log_level": "WARNING"},
    }
    if router == "multiplex":
        unbudgeted = {**engine_config, "cache": {**engine_config["cache"], "host_bytes": None}}
        return serve.deployment(MultiplexedReplica, name=router, **common).bind(
            unbudgeted, paths, w.host_adapters_per_replica
        )
    replica = deployment(
        name=router,
        routing_stats_period_s=w.routing_stats_period_s,
        routing_stats_timeout_s=RouterSettings().stats_timeout_s,
        router_kwargs=costs,
        **common,
    )
    replica = replica.options(func_or_class=BenchReplica)
    if router == "pow2":  # Serve's default router class
        replica = replica.options(request_router_config=RequestRouterConfig())
    return replica.bind(engine_config, settings.model_dump(), str(artifacts.root))
