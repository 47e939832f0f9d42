"""`loraplex bench router`'s assets: a tiny model, a catalog of adapters, the engine
configuration every app shares, and the adapters registered in etcd and the artifact store;
`bench_cluster` sets all of it up, with a lean local Ray, for each of the bench's sections."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.benchmarks.engine.bench import SERVING_TARGETS
from loraplex.benchmarks.fleet import workloads as fw
from loraplex.benchmarks.report import log
from loraplex.benchmarks.router.costs import measure_router_costs
from loraplex.benchmarks.router.figures import PAGE_BYTES
from loraplex.demo.lean_ray import lean_ray_serve
from loraplex.demo.synthetic import AdapterSpec, write_adapter, write_checkpoint
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.etcd_client import EtcdSettings
from loraplex.registry.etcd_process import EtcdProcess
from loraplex.registry.models import AdapterRecord, AdapterVersion, Tenant
from loraplex.registry.store import RegistryStore
from loraplex.replica.memory.adapters import load_adapter, plan_layout
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.protocol import adapter_id

if TYPE_CHECKING:
    from loraplex.benchmarks.router.workload import Workload

TENANT = "bench"


@dataclass(frozen=True, slots=True)
class BenchCluster:
    """What every app of a bench section shares (`router_apps.build_app`'s inputs)."""

    engine_config: dict[str, Any]
    sizes: dict[str, tuple[int, int]]  # adapter version id -> (rank, weight bytes)
    costs: dict[str, float]  # the router's cost figures, measured here
    calibration: dict[str, Any]
    settings: EtcdSettings
    artifacts: ArtifactStore
    paths: dict[str, str]  # adapter version id -> artifact folder, in catalog order


@contextlib.contextmanager
def bench_cluster(w: Workload, name: str) -> Iterator[BenchCluster]:
    """The assets written to a temporary folder, the router costs measured on one engine,
    an etcd server with every adapter registered, and a lean local Ray with Serve; all of
    it stopped and removed on exit."""
    with tempfile.TemporaryDirectory(prefix=f"loraplex-bench-{name}-") as tmp:
        root = Path(tmp)
        model_dir, sources = write_assets(root, w)
        engine_config, sizes = replica_engine_config(model_dir, sources, w)
        costs, calibration = measure_router_costs(engine_config, sources, w)
        log(
            "measured here: "
            + ", ".join(f"{k}={v * 1e3:.1f}ms" for k, v in costs.items())
            + f", unloaded TTFT {calibration['unloaded_ttft_s'] * 1e3:.0f} ms"
        )
        etcd = EtcdProcess(root / "etcd")
        etcd.start()
        try:
            settings = EtcdSettings(endpoints=[etcd.endpoint])
            artifacts = ArtifactStore(root / "artifacts")
            paths = asyncio.run(register(settings, artifacts, sources))
            versions = dict(zip(sources, paths, strict=True))
            with lean_ray_serve():
                yield BenchCluster(
                    engine_config,
                    {versions[n]: size for n, size in sizes.items()},
                    costs,
                    calibration,
                    settings,
                    artifacts,
                    paths,
                )
        finally:
            etcd.stop(kill=True)


def write_assets(root: Path, w: Workload) -> tuple[Path, dict[str, Path]]:
    """The model, and `num_adapters` adapters of ranks 8-128 in turn, SERVING_TARGETS in turn."""
    model_dir = root / "model"
    write_checkpoint(model_dir, w.model, seed=w.seed, with_tokenizer=False)
    sources = {}
    for i, spec in enumerate(fw.catalog(w.num_adapters, lambda rank: 0)):
        adapter = AdapterSpec(
            spec.name, spec.rank, 2.0 * spec.rank, SERVING_TARGETS[i % 4], 1000 + i
        )
        write_adapter(root / "src" / spec.name, w.model, adapter)
        sources[spec.name] = root / "src" / spec.name
    return model_dir, sources


def replica_engine_config(
    model_dir: Path, sources: dict[str, Path], w: Workload
) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """A pool of a full batch's KV blocks plus `adapters_per_replica` adapters of mean size
    (at least two of the largest);
    a host tier of `host_adapters_per_replica`; reads paced by the read model. And each
    adapter's (rank, weight bytes)."""
    model = ModelConfig.from_pretrained(model_dir)
    page_elems = PAGE_BYTES // 4  # float32 checkpoint
    loaded = [load_adapter(p, n, model, 128) for n, p in sources.items()]
    pages = [plan_layout(a, page_elems, model.num_layers)[0].num_pages for a in loaded]
    mean_bytes = sum(a.nbytes for a in loaded) / len(loaded)
    block_tokens = page_elems // model.kv_elems_per_token()
    kv_pages = w.max_num_seqs * math.ceil((w.prompt_tokens[1] + w.output_tokens[1]) / block_tokens)
    # ... and at least twice the largest, which the engine requires of every adapter
    adapter_pages = max(math.ceil(w.adapters_per_replica * sum(pages) / len(pages)), 2 * max(pages))
    config = {
        "model": str(model_dir),
        "page_bytes": PAGE_BYTES,
        "pool_bytes": (kv_pages + adapter_pages) * PAGE_BYTES,
        "scheduler": {"max_num_seqs": w.max_num_seqs},
        "cache": {"loading": "thread", "host_bytes": int(w.host_adapters_per_replica * mean_bytes)},
        "artifacts": {
            "read_bandwidth_mib_s": w.read_bandwidth_mib_s,
            "read_latency_ms": w.read_latency_ms,
        },
    }
    return config, {a.name: (a.rank, a.nbytes) for a in loaded}


async def register(
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
            version = AdapterVersion(
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
                version=stored.digest,
            )
            await store.create_adapter(AdapterRecord.naming(version), version)
            paths[adapter_id(TENANT, name, stored.digest)] = str(artifacts.path_of(stored.path))
    return paths
