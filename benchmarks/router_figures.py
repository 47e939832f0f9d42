"""The figures of `loraplex bench router`: per router from its outcomes and replica
counters, the comparison across routers, and the printed table."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from loraplex.benchmarks.router_workload import BenchRequest, Outcome, Workload

BASELINES = ("pow2", "multiplex")
PAGE_BYTES = 64 * 1024


def router_figures(
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


def summary(
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


def print_table(r: dict[str, Any]) -> None:
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
