"""What a replica publishes to its routers (the contract is router/routing_stats.py), computed
from its engine's stats. The deployment (replica/deployment.py `record_routing_stats`) and
the fleet simulator's replicas (benchmarks/sim/fleet_replica.py) both call `routing_stats`,
so the simulated router is told exactly what a real one is.

The tiers are the engine's own: the adapter cache's device, loading and host sets, plus the
versions being read from the store for their first use outside the engine (AdapterSync). A
host copy the host budget dropped is not published as held, and a load that reads the
adapter from the store again inside the engine is published as loading without a host copy:
a store read, which is what the router prices.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any


def published_tiers(adapters: Mapping[str, Any], reading: Collection[str]) -> dict[str, list[str]]:
    """`adapters`: the engine's `stats()["adapters"]` (its cache's `resident`, `loading` and
    `host` sets); `reading`: versions being read for their first use, not yet in the engine.

        device   on the device, ready
        host     with a host copy, not on the device (a load from there is a copy)
        loading  being loaded towards the device or read from the store
    """
    device = set(adapters["resident"])
    return {
        "device": sorted(device),
        "host": sorted(set(adapters["host"]) - device),
        "loading": sorted((set(adapters["loading"]) | set(reading)) - device),
    }


def store_reads(tiers: Mapping[str, list[str]], read_s: float | None) -> dict[str, Any]:
    """The replica's store reads in flight (loading without a host copy) and, once it has
    measured a read (`read_s`, the mean), when they are expected to be done: one after
    another (one stream to the store, replica/memory/store_reads.py), an upper estimate
    since each read's latency overlaps the others'."""
    queued = len(set(tiers["loading"]) - set(tiers["host"]))
    out: dict[str, Any] = {"store_reads_queued": queued}
    if read_s is not None:
        out["store_read_s"] = read_s
        out["read_queue_s"] = queued * read_s
    return out


def measured_costs(stats: Mapping[str, Any]) -> dict[str, float]:
    """The router's cost inputs as this replica measured them (empty until it has enough
    steps; the router then uses its configured costs):

        busy_cost_s       2 x the step's cost per decode row: a request already running
                          adds one decode row to the step a new request waits out and to its
                          own prefill step
        host_load_cost_s  mean host -> pool load time, plus one more adapter segment in every
                          step of a request's life (per-adapter cost x mean output tokens)
        prefill_token_cost_s  the step's cost per prompt token: what a prompt token found in
                          the prefix cache saves
    """
    costs = stats.get("step_costs")
    if costs is None:
        return {}
    adapters = stats["adapters"]
    load_s = adapters["load_seconds"] / adapters["loads"] if adapters["loads"] else 0.0
    return {
        "busy_cost_s": 2 * costs["per_decode_row_s"],
        "host_load_cost_s": load_s + costs["per_adapter_s"] * costs["mean_output_tokens"],
        "prefill_token_cost_s": costs["per_prompt_token_s"],
    }


def prefix_routing(stats: Mapping[str, Any]) -> dict[str, Any]:
    """What a router needs to key a prompt's blocks as this replica's prefix cache does:
    its block size and whether base-model blocks are shared across tenants. Nothing when
    the engine keeps no prefix cache (its stats have no enabled `prefix_cache`)."""
    prefix = stats.get("prefix_cache")
    if not prefix or not prefix["enabled"]:
        return {}
    return {
        "prefix_block_size": stats["kv_block_size"],
        "prefix_share_base": bool(prefix["share_base"]),
    }


def routing_stats(
    stats: Mapping[str, Any],
    *,
    reading: Collection[str],
    read_s: float | None,
    in_flight: int,
    adapter_queue: Mapping[str, int],
    max_concurrency: int,
    recorded_at: float,
) -> dict[str, Any]:
    """The published dict. `stats`: the engine's `stats()`; `in_flight`: requests the replica
    holds (waiting for a read, queued, running: what the router's own count tracks);
    `adapter_queue`: those per adapter version."""
    tiers = published_tiers(stats["adapters"], reading)
    return {
        "device_adapters": tiers["device"],
        "host_adapters": tiers["host"],
        "loading_adapters": tiers["loading"],
        "queue_len": in_flight,
        "queued_prefill_tokens": stats["queued_prefill_tokens"],
        "running": stats["running"],
        "waiting_for_pages": stats["waiting_for_pages"],
        "step_token_budget": stats["step_token_budget"],
        "batch_adapters": stats["batch_adapters"],
        "max_loras_per_batch": stats["max_loras_per_batch"],
        "max_concurrency": max_concurrency,
        "free_pages": stats["pool"]["free_pages"],
        "num_pages": stats["pool"]["num_pages"],
        "recorded_at": recorded_at,
        "adapter_queue": {a: n for a, n in adapter_queue.items() if n > 0},
        **store_reads(tiers, read_s),
        **measured_costs(stats),
        **prefix_routing(stats),
    }
