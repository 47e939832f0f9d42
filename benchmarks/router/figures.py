"""The figures of `loraplex bench router`: one run's, each workload's across rates and
routers (goodput at the SLO, the ratios against the best Ray router), and the table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from loraplex.benchmarks.goodput import (
    SLO_FACTOR,
    comparison,
    goodput,
    held_at_top_note,
    recovery_s,
    repeated,
    within_slo_rps,
)
from loraplex.benchmarks.router.workload import workload_dict

if TYPE_CHECKING:
    from loraplex.benchmarks.router.runs import Outcome
    from loraplex.benchmarks.router.workload import Workload

PAGE_BYTES = 64 * 1024
RECOVERY_WINDOW_S = 5.0


def run_figures(outcomes: list[Outcome], elapsed: float, counted: dict[str, float]) -> dict:
    """One run: its requests' TTFTs (client side, from the scheduled arrival to the first
    chunk) and the replicas' counters over it."""
    done = [o for o in outcomes if o.error is None]
    ttft = np.array([o.ttft_s for o in done], dtype=float)
    stream_failed = sum(o.stream_failed for o in outcomes)
    return {
        "p50_ttft_s": _pct(ttft, 50),
        "p99_ttft_s": _pct(ttft, 99),
        "mean_ttft_s": float(ttft.mean()) if len(ttft) else None,
        "throughput_rps": len(done) / elapsed,
        "requests": len(outcomes),
        "completed": len(done),
        "streams_failed": stream_failed,
        # requests that got no answer at all: a retry should have served them
        "lost": len(outcomes) - len(done) - stream_failed,
        "errors": sorted({o.error for o in outcomes if o.error is not None})[:5],
        "duration_s": elapsed,
        **counted,
        "raw": {
            "at_s": [o.at_s for o in outcomes],
            "ttft_s": [o.ttft_s for o in outcomes],
            "ok": [o.error is None for o in outcomes],
        },
    }


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summary(
    w: Workload,
    engine_config: dict[str, Any],
    costs: dict[str, float],
    calibration: dict[str, Any],
    reps: list[dict[str, dict]],
) -> dict[str, Any]:
    """The figures of every repetition's sweeps (`reps[i][workload]`), each workload's as
    medians over the repetitions with every ratio's 90% bootstrap interval."""
    slo = SLO_FACTOR * calibration["unloaded_ttft_s"]
    per_rep = [
        {name: _workload(name, sweep, w, slo) for name, sweep in runs.items()} for runs in reps
    ]
    workloads = {name: _over_reps([rep[name] for rep in per_rep]) for name in per_rep[0]}
    return {
        "repeats": len(reps),
        "workload": workload_dict(w),
        "capacity": (
            f"{w.adapters_per_replica} adapters of mean size per replica on the device beside a "
            f"full batch's KV ({engine_config['pool_bytes'] // PAGE_BYTES} pages of "
            f"{PAGE_BYTES // 1024} KiB), {w.host_adapters_per_replica} in the host tier; "
            f"multiplex max_num_models_per_replica={w.host_adapters_per_replica}"
        ),
        "read_model": {
            "bandwidth_mib_s": w.read_bandwidth_mib_s,
            "latency_ms": w.read_latency_ms,
        },
        "router_costs": costs,
        "unloaded_ttft_s": calibration["unloaded_ttft_s"],
        "slo_s": slo,
        "capacity_rps": calibration["capacity_rps"],
        "max_ongoing_requests": calibration.get("max_ongoing_requests"),
        "lone_ttft_s": calibration.get("lone_ttft_s"),
        "lora_capacity_rps": calibration.get("lora_capacity_rps"),
        "lora_capacity_bursts_rps": calibration.get("lora_capacity_bursts_rps"),
        "rate_basis_rps": calibration["rate_basis_rps"],
        "rates_over_lora_capacity": {
            router: [f * calibration["rate_basis_rps"] / c for f in w.all_rate_factors]
            for router, c in (calibration.get("lora_capacity_rps") or {}).items()
        },
        "workloads": workloads,
    }


# each router's figures, one per rate run, and what stands for a rate a repetition did not
PER_RATE = {
    "p50_ttft_s": None,
    "p99_ttft_s": None,
    "within_slo_rps": None,
    "load_avg_1m": [None, None],
    "placements": {},
    "busy_s_by_replica": None,
}


def _over_reps(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One workload's figures over the repetitions. A sweep goes past the grid as far as
    some router holds the SLO, so repetitions may have run different numbers of rates
    (always a prefix of the same ones): the shorter lists are padded, and each rate's
    figures are the medians of the repetitions that ran it (`repetitions_per_rate`)."""
    n = max(len(r["rates_rps"]) for r in reps)
    padded = []
    for rep in reps:
        short = n - len(rep["rates_rps"])
        routers = {
            router: {k: v + [PER_RATE[k]] * short if k in PER_RATE else v for k, v in f.items()}
            for router, f in rep["routers"].items()
        }
        padded.append({**rep, "rates_rps": rep["rates_rps"] + [None] * short, "routers": routers})
    out = repeated(padded)
    # each repetition's p99 per rate, so its goodput can be worked again from the figures,
    # and its figures at the reference rate, which the fleet validation replays one by one
    out["repetitions"] = [
        {
            **{k: v for k, v in r.items() if k != "routers"},
            "p99_ttft_s_by_rate": {router: f["p99_ttft_s"] for router, f in r["routers"].items()},
            "at_reference": {router: f["at_reference"] for router, f in r["routers"].items()},
            # the affinity router's requests at each rate by where it sent them
            "placements_by_rate": {
                router: f["placements"] for router, f in r["routers"].items() if "placements" in f
            },
        }
        for r in reps
    ]
    out["repetitions_per_rate"] = [sum(len(r["rates_rps"]) > i for r in reps) for i in range(n)]
    return out


def _workload(name: str, sweep: dict, w: Workload, slo: float) -> dict[str, Any]:
    rates = sweep["rates_rps"]
    failover = name == "failover"
    factors = w.failover_factors if failover else w.rate_factors
    ref = factors.index(w.reference_factor) if w.reference_factor in factors else 0
    routers: dict[str, Any] = {}
    for router, figures in sweep["per_router"].items():
        p99 = [f["p99_ttft_s"] for f in figures]
        within = []
        for f, rate in zip(figures, rates, strict=True):
            raw = f["raw"]
            ok = [t for t, good in zip(raw["ttft_s"], raw["ok"], strict=True) if good]
            within.append(within_slo_rps(np.array(ok, dtype=float), f["requests"], rate, slo))
        routers[router] = {
            "p50_ttft_s": [f["p50_ttft_s"] for f in figures],
            "p99_ttft_s": p99,
            "within_slo_rps": within,
            "goodput_at_slo_rps": goodput(rates, p99, slo),
            "at_reference": {k: v for k, v in figures[ref].items() if k != "raw"},
            "load_avg_1m": [f["load_avg_1m"] for f in figures],
            "busy_s_by_replica": [f.get("busy_s_by_replica") for f in figures],
        }
        if "placements" in figures[0]:  # the affinity router's (`bench.placements_since`)
            routers[router]["placements"] = [f["placements"] for f in figures]
    distinct = sweep["distinct_adapters"][ref]
    at = {r: f["at_reference"] for r, f in routers.items()}
    out: dict[str, Any] = {
        "router_order": sweep["router_order"],
        "rates_rps": rates,
        "reference_rate_rps": rates[ref],
        "slo_s": slo,
        "distinct_adapters_requested": distinct,
        **comparison(
            routers,
            rates[-1],
            loads="loads",
            reads="reads",
            distinct=distinct,
            # a sweep recorded before the floor was: reads over the distinct adapters
            reads_floor=sweep["new_adapters"][ref] if "new_adapters" in sweep else None,
        ),
        "reloads": {r: a["loads"] - distinct for r, a in at.items()},
        "p50_ttft_s": {r: a["p50_ttft_s"] for r, a in at.items()},
        "p99_ttft_s": {r: a["p99_ttft_s"] for r, a in at.items()},
        "routers": routers,
    }
    if failover:
        kill = sweep["kill_at_s"][ref]
        out["recovery_s"] = {}
        for router, figures in sweep["per_router"].items():
            raw = figures[ref]["raw"]
            ok = [i for i, good in enumerate(raw["ok"]) if good]
            out["recovery_s"][router] = recovery_s(
                np.array([raw["at_s"][i] for i in ok]),
                np.array([raw["ttft_s"][i] for i in ok]),
                kill,
                slo,
                RECOVERY_WINDOW_S,
            )
        out["streams_failed"] = {r: a["streams_failed"] for r, a in at.items()}
        out["requests_lost"] = {r: a["lost"] for r, a in at.items()}
    return out


def print_table(r: dict[str, Any]) -> None:
    w = r["workload"]
    print(
        f"medians of {r['repeats']} repetitions (fresh apps, router order rotated); ratios "
        f"with their 90% bootstrap interval"
    )
    print(
        f"{w['num_replicas']} replicas, {w['num_adapters']} adapters, reads "
        f"{w['read_bandwidth_mib_s']:g} MiB/s + {w['read_latency_ms']:g} ms; SLO "
        f"{r['slo_s'] * 1e3:.0f} ms (5 x unloaded {r['unloaded_ttft_s'] * 1e3:.0f} ms); "
        f"base-model capacity {r['capacity_rps']:.1f} req/s, rates x "
        f"{r.get('rate_basis_rps', r['capacity_rps']):.1f} req/s\ncapacity: {r['capacity']}"
    )
    if r.get("lora_capacity_rps"):
        print(
            "LoRA-workload capacity (zipf bursts, median): "
            + ", ".join(
                f"{router} {c:.1f} req/s ("
                + "/".join(
                    f"{b:.1f}" for b in (r.get("lora_capacity_bursts_rps") or {}).get(router, [])
                )
                + "; rates "
                + "/".join(f"{x:.2f}" for x in r["rates_over_lora_capacity"][router])
                + " x it)"
                for router, c in r["lora_capacity_rps"].items()
            )
        )
    print(
        f"{'workload':9} {'router':9} {'goodput':>8} {'p50@ref':>8} {'p99@ref':>8} {'loads':>6} "
        f"{'reads':>6} {'load s':>7} {'loadavg':>8}"
    )
    for name, wl in r["workloads"].items():
        for router, f in wl["routers"].items():
            a = f["at_reference"]
            print(
                f"{name:9} {router:9} {f['goodput_at_slo_rps']:8.2f} {_ms(a['p50_ttft_s'])} "
                f"{_ms(a['p99_ttft_s'])} {a['loads']:6.0f} {a['reads']:6.0f} "
                f"{a['load_seconds']:7.2f} {max(max(x) for x in f['load_avg_1m']):8.1f}"
                + (
                    f"  ({a['counters_unread']:.0f} replica counter reads failed: counts low)"
                    if a.get("counters_unread")
                    else ""
                )
            )
        print(
            f"{name:9} goodput ratio {_ci(wl, 'goodput_ratio_vs_best_ray_router')} (target: "
            f"ci_low >= 1.0{', median >= 1.2' if name in ('zipf', 'shift') else ''})"
            f"{held_at_top_note(wl)}, "
            f"load-seconds ratio {_ci(wl, 'load_seconds_ratio_vs_best_ray_router')}, loads vs floor "
            + ", ".join(f"{k} {v:.2f}" for k, v in wl["loads_vs_floor"].items())
        )
        if name == "failover":
            print(
                f"failover: recovery {wl['recovery_s']} (target <= 30 s), streams failed "
                f"{wl['streams_failed']}, requests lost {wl['requests_lost']} (target 0)"
            )
    costs = ", ".join(f"{k} {v * 1e3:.1f}ms" for k, v in r["router_costs"].items())
    print(f"affinity router told (measured here): {costs}")


def _ms(value: float | None) -> str:
    return f"{'n/a':>8}" if value is None else f"{value * 1e3:6.0f}ms"


def _ci(figures: dict, key: str) -> str:
    """A ratio as its median over the repetitions and its 90% bootstrap interval."""
    low, high = figures.get(f"{key}_ci_low"), figures.get(f"{key}_ci_high")
    return f"{_fmt(figures[key])} [{_fmt(low)}, {_fmt(high)}]"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
