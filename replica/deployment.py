"""One replica as a Ray Serve deployment: the engine, the registry watch and routing stats.

`ReplicaDeployment` is a plain class; `deployment()` wraps it with `serve.deployment` and
the adapter-affinity request router. Its constructor is `async` (Ray Serve awaits an async
`__init__`), so a replica reports ready only once its engine is built and it holds the
registry's snapshot: the first request already finds every registered adapter.

Ray Serve calls, besides the request methods `generate` and `stats`:
    record_routing_stats  every request_routing_stats_period_s; the dict reaches every
                          router as `RunningReplica.routing_stats` (router/routing_stats.py
                          has the contract, replica/routing_report.py computes it)

A change of tiers reaches the routers at the next poll, not sooner: Ray 2.60 has no push
for routing stats that lasts. The controller's `record_request_routing_info` (the path
`@serve.multiplexed` pushes model ids by) takes `routing_stats` too, but every control loop
(0.1 s) records each healthy replica's last polled dict over it (deployment_state.py
`_process_healthy_replica`); tried, the router never saw a pushed change. The lag is
bounded by request_routing_stats_period_s, which the controller honours down to its loop.
    check_health          every health_check_period_s; raising restarts the replica
    __del__               on graceful shutdown: stops the engine thread
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.etcd_client import EtcdSettings
from loraplex.registry.watch import RegistryWatcher
from loraplex.replica.adapter_sync import AdapterSync
from loraplex.replica.async_engine import Engine
from loraplex.replica.config import build_engine_config
from loraplex.replica.demand import DEMAND_TAU_S, AdapterDemand
from loraplex.replica.memory.adapter_cache import UnknownAdapter
from loraplex.replica.protocol import (
    AdapterNotFound,
    GenerateChunk,
    GenerateRequest,
    autoscaling_stats,
    cache_salts,
    chunk,
    continuation,
    measured_token_s,
    parse_adapter_id,
    sampling_params,
    tier_bytes,
    token_utilisation,
)
from loraplex.replica.routing_report import published_tiers, routing_stats

log = logging.getLogger(__name__)

# The router is named by import path: replica/ does not import router/ (DESIGN.md layout).
AFFINITY_ROUTER = "loraplex.router.request_router:AffinityRequestRouter"
DEPLOYMENT_NAME = "replica"


class ReplicaDeployment:
    """A replica: serves the base model and every adapter the registry holds.

    engine_config  EngineConfig fields (`scheduler` as a dict of SchedulerConfig fields)
    etcd           EtcdSettings fields; None serves the base model only
    artifact_root  where the registry's artifacts are (required with etcd)
    demand_window_s  how long the adapters' demand is remembered for the autoscaling
                   policy's step-down projection (replica/demand.py)
    """

    async def __init__(
        self,
        engine_config: dict[str, Any],
        etcd: dict[str, Any] | None = None,
        artifact_root: str | None = None,
        demand_window_s: float = DEMAND_TAU_S,
    ):
        from ray import serve

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine: Engine | None = None
        self.watcher: RegistryWatcher | None = None
        self.sync: AdapterSync | None = None
        cfg = build_engine_config(engine_config)
        if etcd is not None and artifact_root is None:
            raise ValueError("artifact_root is required when etcd is given")
        self.max_concurrency = cfg.scheduler.max_num_seqs
        self.host_bytes = cfg.cache.host_bytes
        self._start_counters(demand_window_s)
        self.engine = await asyncio.to_thread(Engine, cfg)  # reads the checkpoint
        # before the first request: what counts as a quick re-read (adapter_cache.py)
        self.engine.core.adapters.reread_window_s = demand_window_s
        if etcd is None:
            return
        try:
            self.watcher = RegistryWatcher(EtcdSettings(**etcd))
            await self.watcher.start()
            store = await asyncio.to_thread(ArtifactStore, artifact_root)
            self.sync = AdapterSync(self.engine, self.watcher, store)
            self.sync.start()
        except BaseException:
            await self.shutdown()
            raise

    def _start_counters(self, demand_window_s: float = DEMAND_TAU_S) -> None:
        self.requests_total = 0  # generate calls received (for operators and tests)
        self.in_flight = 0  # generate calls not finished, those waiting for a read included
        self.output_tokens = 0  # tokens streamed (what the autoscaling report counts as made)
        # (when, store re-reads, prompt tokens computed, output tokens) at the last report
        self._autoscale_mark = (time.monotonic(), 0, 0, 0)
        self._asked: set[str] = set()  # adapters asked for since the last report
        self.demand = AdapterDemand(time.monotonic(), demand_window_s)  # for fewer tiers' reads

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks. AdapterNotFound if its adapter version is not
        registered (or is deleted before the request is queued)."""
        assert self.engine is not None
        adapter = request["adapter"]
        if adapter is None:
            held: contextlib.AbstractAsyncContextManager = contextlib.nullcontext()
        elif self.sync is None:
            raise AdapterNotFound(f"adapter {adapter!r}: this replica has no registry")
        else:
            held = self.sync.serving(adapter, request.get("adapter_revision"))
            self._asked.add(adapter)
            if nbytes := self._adapter_bytes(adapter):  # 0: not a version (refused below)
                self.demand.asked(adapter, nbytes, time.monotonic())
        # aclosing: a caller that stops early must abort the engine's request at once
        self.in_flight += 1
        try:
            async with held, contextlib.aclosing(self._generate(request)) as chunks:
                async for item in chunks:
                    self.output_tokens += len(item["new_token_ids"])
                    yield item
        finally:
            self.in_flight -= 1

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        assert self.engine is not None
        self.requests_total += 1
        adapter = request["adapter"]
        params = sampling_params(request)
        outputs = self.engine.generate(
            request["prompt_token_ids"],
            params,
            adapter,
            request["request_id"],
            **cache_salts(request),
            continuation=continuation(request),
        )
        try:
            async for out in outputs:
                yield chunk(out)
        except UnknownAdapter:  # deleted between ensure() and the engine queueing it
            raise AdapterNotFound(f"adapter {adapter!r} is not registered") from None
        finally:
            await outputs.aclose()

    async def stats(self) -> dict[str, Any]:
        """The engine's stats plus this replica's id (`replica`, as routers know it), the
        adapters of each tier (ids) and the registry's count: what the ingress's /metrics
        shows of this replica (`Backend.replica_stats`)."""
        assert self.engine is not None
        stats = await self.engine.stats()
        stats["replica"] = self.replica_id
        stats["tiers"] = self._tiers(stats)
        stats["registered_adapters"] = len(self.sync.registered) if self.sync else 0
        stats["registry_connected"] = self.watcher.connected if self.watcher else False
        return stats

    async def record_routing_stats(self) -> dict[str, Any]:
        """Routing stats for AffinityRequestRouter (router/routing_stats.py `RoutingStats`):
        the engine's own tiers and store reads, and `recorded_at` (time.time()) so routers
        can tell their age."""
        assert self.engine is not None
        stats = await self.engine.stats()
        sync = self.sync
        published = routing_stats(
            stats,
            reading=sync.loading if sync else (),
            read_s=sync.mean_read_s if sync else None,
            in_flight=self.in_flight,
            adapter_queue=sync.requests if sync else {},
            max_concurrency=self.max_concurrency,
            recorded_at=time.time(),
        )
        published["requests_total"] = self.requests_total
        return published

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What the `lora` autoscaling policy reads (router/autoscaling.py); Serve calls this
        every few seconds and averages it over look_back_period_s. The store reads reported are
        the engine's re-reads of adapters its tiers had dropped, within the demand window of
        their previous load here (`quick_rereads`): a working set past the tiers. A first
        read (AdapterSync's) is not: a new replica, or an adapter new to this one, is read
        once whatever its tiers can keep; nor is a re-read long after the adapter was last
        here: demand that came back (a step down's adapters at homes that last had them
        long before), read once. The mean read time is the
        first reads' (the same artifacts from the same store, paced alike). The adapters
        asked for since the last report are reported in bytes (the registry's sizes), beside
        what its pool and host tier hold at most: the policy keeps the replicas that hold
        them once their re-reads have stopped; and the reads its demand would make from
        smaller tiers (replica/demand.py): what a step down would read."""
        assert self.engine is not None
        stats = await self.engine.stats()
        reads = stats["adapters"]["quick_rereads"]
        prompt = stats["prefix_cache"]["prompt_tokens_computed"]
        now = time.monotonic()
        since, reads_before, prompt_before, output_before = self._autoscale_mark
        self._autoscale_mark = (now, reads, prompt, self.output_tokens)
        held = self.sync.requests if self.sync else {}
        asked, self._asked = self._asked | {a for a, n in held.items() if n > 0}, set()
        tiers = tier_bytes(self.host_bytes, stats["adapters"]["held_bytes"])
        reads_at, sketch = self.demand.report(tiers, now) if tiers else (None, None)
        return autoscaling_stats(
            requests=self.in_flight,
            slots=self.max_concurrency,
            reads=reads,
            reads_before=reads_before,
            elapsed_s=now - since,
            read_s=(self.sync.mean_read_s if self.sync else None) or 0.0,
            prefill_tokens=stats["queued_prefill_tokens"],
            token_s=measured_token_s(stats),
            utilisation=token_utilisation(
                stats,
                prompt_tokens=prompt - prompt_before,
                output_tokens=self.output_tokens - output_before,
                elapsed_s=now - since,
                slots=self.max_concurrency,
                adapters=sum(1 for n in held.values() if n > 0),
            ),
            adapter_queue=held,
            set_bytes=sum(self._adapter_bytes(a) for a in asked),
            tier_bytes=tiers,
            reads_at=reads_at,
            sketch=sketch,
        )

    def _adapter_bytes(self, adapter: str) -> int:
        """The registry's size of an adapter version's weights (0 once it has left, or for
        a name that is no version id: its request was refused as not found)."""
        assert self.watcher is not None
        try:
            version = self.watcher.version(*parse_adapter_id(adapter))
        except ValueError:
            return 0
        return 0 if version is None else version.size_bytes

    def _tiers(self, stats: dict[str, Any]) -> dict[str, list[str]]:
        return published_tiers(stats["adapters"], self.sync.loading if self.sync else ())

    async def check_health(self) -> None:
        assert self.engine is not None
        failure = self.engine.failure()
        if failure is not None:
            raise RuntimeError(f"the engine stopped: {failure}")

    async def shutdown(self) -> None:
        if self.sync is not None:
            await self.sync.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    def __del__(self) -> None:
        # Ray Serve calls this on graceful shutdown, and the garbage collector may call it
        # again: stop the engine thread (idempotent); the watch ends with the process.
        if self.engine is not None:
            self.engine.shutdown()


def deployment(
    *,
    routing_stats_period_s: float,
    routing_stats_timeout_s: float,
    num_replicas: int | str | None = 1,
    ray_actor_options: dict[str, Any] | None = None,
    router_kwargs: dict[str, Any] | None = None,
    max_ongoing_requests: int = 64,
    name: str = DEPLOYMENT_NAME,
    **options: Any,
):
    """`ReplicaDeployment` as a Serve deployment routed by AffinityRequestRouter.

    router_kwargs         AffinityConfig fields (passed to the router's
                          `initialize_state`)
    routing_stats_*       how often replicas publish their routing stats, and the
                          deadline of one call (router/settings.py RouterSettings)
    max_ongoing_requests  Serve's per-replica cap on requests in flight; keep it above
                          the engine's max_num_seqs (Serve's default, 5, would starve
                          the batch), the engine queues the rest
    options               any other `serve.deployment` option (autoscaling_config,
                          health_check_period_s, ...); pass num_replicas=None or
                          "auto" with autoscaling_config
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    router = RequestRouterConfig(
        request_router_class=AFFINITY_ROUTER,
        request_router_kwargs=router_kwargs or {},
        request_routing_stats_period_s=routing_stats_period_s,
        request_routing_stats_timeout_s=routing_stats_timeout_s,
    )
    if num_replicas is not None:
        options["num_replicas"] = num_replicas
    return serve.deployment(
        ReplicaDeployment,
        name=name,
        ray_actor_options=ray_actor_options or {},
        request_router_config=router,
        max_ongoing_requests=max_ongoing_requests,
        **options,
    )
