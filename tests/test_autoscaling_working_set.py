"""A real replica's working-set report (replica/deployment.py `record_autoscaling_stats`):
the bytes of the distinct adapters asked for since its last report are the registry's sizes
of their weights, and its tiers hold its host budget or what its device and host tiers
hold together, the larger (the host tier keeps a copy of what the pool holds: not the two
summed). A real etcd
registry, AdapterSync and engine on the demo model; the deployment class without Ray Serve
around it."""

from __future__ import annotations

import asyncio
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
from loraplex.replica.config import CacheConfig, EngineConfig
from loraplex.replica.demand import adapter_hash
from loraplex.replica.deployment import ReplicaDeployment
from loraplex.replica.protocol import (
    AUTOSCALE_DEMAND_ADAPTERS,
    AUTOSCALE_SET_BYTES,
    AUTOSCALE_SKETCH,
    AUTOSCALE_TIER_BYTES,
    AdapterNotFound,
    GenerateRequest,
    adapter_id,
)

TENANT = "working-set-test"
NAMES = ("sql-r8", "chat-r16", "code-r32")
# a host budget below code-r32 alone: its host copy is dropped while the pool holds it
POOL_BYTES, PAGE_BYTES, HOST_BYTES = 16 << 20, 64 << 10, 128 << 10


@pytest.mark.etcd
def test_the_report_weighs_the_adapters_asked_for_against_the_replicas_tiers(
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
                pool_bytes=POOL_BYTES,
                page_bytes=PAGE_BYTES,
                cache=CacheConfig(loading="thread", host_bytes=HOST_BYTES),
            )
        )
        async with RegistryStore(settings) as store, RegistryWatcher(settings) as watcher:
            await store.create_tenant(Tenant(name=TENANT))
            ids = {}
            for name in NAMES:
                record = record_for(name, source / name, artifacts, TENANT)
                await create(store, record)
                ids[name] = adapter_id(TENANT, name, record.version)
            await until(lambda: _true(watcher.adapter(TENANT, NAMES[-1])), 5, "the watch")
            sync = AdapterSync(engine, watcher, artifacts)
            sync.start()
            replica = ReplicaDeployment.__new__(ReplicaDeployment)
            replica.replica_id, replica.engine, replica.sync = "r0", engine, sync
            replica.watcher, replica.max_concurrency = watcher, 8
            replica.host_bytes = HOST_BYTES
            replica._start_counters()
            try:
                asked = ("sql-r8", "code-r32", "sql-r8")  # two distinct, one twice
                for name in asked:
                    await _drain(replica.generate(_request(ids[name])))
                with pytest.raises(AdapterNotFound):  # not a version id: weighs nothing
                    await _drain(replica.generate(_request("no-such-adapter")))
                report = await replica.record_autoscaling_stats()
                assert report[AUTOSCALE_SET_BYTES] == sizes["sql-r8"] + sizes["code-r32"]
                adapters = (await engine.stats())["adapters"]
                by_id = {ids[n]: sizes[n] for n in NAMES}
                held = sum(by_id[a] for a in set(adapters["resident"]) | set(adapters["host"]))
                assert ids["code-r32"] in adapters["resident"]
                assert ids["code-r32"] not in adapters["host"]  # over the budget alone
                assert held > HOST_BYTES  # the pool holds what the host tier dropped
                # the weights held; the registry's sizes are the files', a header more each
                header = 8 << 10
                assert held - 2 * header <= report[AUTOSCALE_TIER_BYTES] < held
                # its demand: the two adapters asked for, and both their hashes (the policy
                # merges the replicas' into the adapters they share)
                assert report[AUTOSCALE_DEMAND_ADAPTERS] == 2
                sketch = {k for k in report if k.startswith(AUTOSCALE_SKETCH)}
                assert sketch == {AUTOSCALE_SKETCH + adapter_hash(ids[n]) for n in asked}
                again = await replica.record_autoscaling_stats()  # nothing asked since
                assert again[AUTOSCALE_SET_BYTES] == 0
            finally:
                await sync.stop()
                await store.delete_tenant(TENANT)
                engine.shutdown()

    asyncio.run(body())


def _request(adapter: str) -> GenerateRequest:
    return GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=[5, 6, 7],
        adapter=adapter,
        params={"max_tokens": 2, "temperature": 0.0},
    )


async def _drain(chunks) -> None:
    async for _ in chunks:
        pass


async def _true(value: object) -> bool:
    return bool(value)
