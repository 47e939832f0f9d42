"""What a replica publishes to the router is its engine's truth: the adapter cache's own host
tier (a copy the host budget dropped is not published as held), a read from the store
inside the engine published as loading without a host copy, the requests it holds per
adapter, and its store reads. A real etcd registry, AdapterSync and engine; the deployment
class without Ray Serve around it (its `record_routing_stats` is what Serve calls)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from etcd_server import EtcdServer, shared_etcd_server_fixture  # noqa: F401 (fixture)
from test_serve_replica import create, record_for, until

from loraplex.demo.assets import DemoAssets
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.models import Tenant
from loraplex.registry.store import RegistryStore
from loraplex.registry.watch import RegistryWatcher
from loraplex.replica.adapter_sync import AdapterSync
from loraplex.replica.async_engine import Engine
from loraplex.replica.config import ArtifactReadConfig, CacheConfig, EngineConfig
from loraplex.replica.deployment import ReplicaDeployment
from loraplex.replica.protocol import GenerateRequest, adapter_id

TENANT = "report-test"
NAMES = ("sql-r8", "chat-r16", "code-r32")


def replica(engine: Engine, sync: AdapterSync, watcher: RegistryWatcher) -> ReplicaDeployment:
    """The deployment as Serve's constructor leaves it, over this engine, sync and watch."""
    shell = ReplicaDeployment.__new__(ReplicaDeployment)
    shell.replica_id, shell.engine, shell.sync, shell.watcher = "r0", engine, sync, watcher
    shell.max_concurrency = 8
    shell._start_counters()  # as the constructor does: every counter a report reads
    return shell


@pytest.mark.etcd
def test_published_tiers_and_reads_are_the_engines_own(
    demo_assets: DemoAssets, shared_etcd_server: EtcdServer, tmp_path: Path
):
    settings = shared_etcd_server.settings()
    artifacts = ArtifactStore(tmp_path / "artifacts")
    source = demo_assets.adapters_dir
    sizes = {n: (source / n / "adapter_model.safetensors").stat().st_size for n in NAMES}

    async def body():
        engine = Engine(
            EngineConfig(
                model=str(demo_assets.model),
                pool_bytes=64 << 20,
                cache=CacheConfig(loading="thread", host_bytes=sizes[NAMES[1]] + sizes[NAMES[2]]),
                artifacts=ArtifactReadConfig(read_latency_ms=400),
            )
        )
        async with RegistryStore(settings) as store, RegistryWatcher(settings) as watcher:
            await store.create_tenant(Tenant(name=TENANT))
            ids = []
            for name in NAMES:
                record = record_for(name, source / name, artifacts, TENANT)
                await create(store, record)
                ids.append(adapter_id(TENANT, name, record.version))
            await until(lambda: _true(watcher.adapter(TENANT, NAMES[-1])), 5, "the watch")
            sync = AdapterSync(engine, watcher, artifacts)
            sync.start()
            deployment = replica(engine, sync, watcher)
            try:
                for adapter in ids:  # read one after another: the first copy is dropped
                    await sync.ensure(adapter)
                held = set(engine.core.adapters.host)
                assert ids[0] not in held and held == set(ids[1:])
                stats = await deployment.record_routing_stats()
                assert set(stats["host_adapters"]) == held  # not every version ever read
                assert stats["loading_adapters"] == [] and stats["store_reads_queued"] == 0
                assert stats["store_read_s"] >= 0.4 and stats["queue_len"] == 0

                request = GenerateRequest(
                    request_id=uuid.uuid4().hex,
                    prompt_token_ids=[5, 6, 7],
                    adapter=ids[0],
                    params={"max_tokens": 2, "temperature": 0.0},
                )
                chunks = asyncio.create_task(_drain(deployment.generate(request)))
                reading = None
                deadline = time.monotonic() + 5
                while reading is None and time.monotonic() < deadline:
                    stats = await deployment.record_routing_stats()
                    if ids[0] in stats["loading_adapters"]:
                        reading = stats
                    await asyncio.sleep(0.02)
                assert reading is not None, "the engine's re-read was never published"
                assert ids[0] not in reading["host_adapters"]
                assert reading["store_reads_queued"] == 1
                assert reading["read_queue_s"] == pytest.approx(reading["store_read_s"])
                assert reading["adapter_queue"] == {ids[0]: 1} and reading["queue_len"] == 1
                # it waits aside in the engine's queue, its whole prompt still to prefill
                assert reading["queued_prefill_tokens"] == len(request["prompt_token_ids"])
                # held for its adapter's load, not for pages: the router keeps its slots
                assert reading["waiting_for_pages"] == 0 and reading["running"] == 0
                # what one step prefills at most: more queued is a backlog (policy batch_slots)
                budget = deployment.engine.core.scheduler.cfg.max_num_batched_tokens
                assert reading["step_token_budget"] == budget > 0
                # nothing runs yet; the cap a batch's adapters meet (policy batch_slots)
                cap = deployment.engine.core.scheduler.cfg.max_loras_per_batch
                assert reading["batch_adapters"] == [] and reading["max_loras_per_batch"] == cap
                await chunks
                stats = await deployment.record_routing_stats()
                assert ids[0] in stats["device_adapters"] and stats["queue_len"] == 0
                assert stats["queued_prefill_tokens"] == 0
                assert stats["waiting_for_pages"] == 0 and stats["running"] == 0
                assert stats["adapter_queue"] == {} and stats["store_reads_queued"] == 0
            finally:
                await sync.stop()
                await store.delete_tenant(TENANT)
                engine.shutdown()

    asyncio.run(body())


async def _drain(chunks) -> None:
    async for _ in chunks:
        pass


async def _true(value: object) -> bool:
    return bool(value)
