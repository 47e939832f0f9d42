"""`loraplex bench router`'s assets: a tiny model, a catalog of adapters, the engine
configuration every app shares, and the adapters registered in etcd and the artifact store."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.benchmarks import fleet_workloads as fw
from loraplex.benchmarks.engine import SERVING_TARGETS
from loraplex.benchmarks.router_figures import PAGE_BYTES
from loraplex.demo.synthetic import AdapterSpec, write_adapter, write_checkpoint
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.etcd_client import EtcdSettings
from loraplex.registry.models import AdapterRecord, Tenant
from loraplex.registry.store import RegistryStore
from loraplex.replica.memory.adapters import load_adapter, plan_layout
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.protocol import adapter_id

if TYPE_CHECKING:
    from loraplex.benchmarks.router_workload import Workload

TENANT = "bench"


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
