"""The table `loraplex bench fleet` prints, and its figure's title."""

from __future__ import annotations

from loraplex.benchmarks.goodput import held_at_top_note


def title(fleet: dict) -> str:
    return (
        f"fleet simulator: {fleet['replicas']} x {fleet['profile']}, {fleet['adapters']} "
        f"adapters, store {fleet['store']['bytes_per_s'] / 2**20:.0f} MiB/s + "
        f"{fleet['store']['latency_s'] * 1e3:.0f} ms"
    )


def print_table(results: dict) -> None:
    f = results["fleet"]
    print(
        f"{title(f)}; capacity {f['capacity_rps']:.0f} req/s; window {f['window_s']:.0f} s; "
        f"medians of {f['repeats']} seeds, ratios with their 90% bootstrap interval"
    )
    print(
        f"{'workload':9} {'router':9} {'goodput':>8} {'p99@ref':>8} {'loads':>6} {'reads':>6} {'load s':>7}"
    )
    for name, w in f["workloads"].items():
        for router, r in w["routers"].items():
            ref = r["at_reference"]
            print(
                f"{name:9} {router:9} {r['goodput_at_slo_rps']:8.1f} {ref['p99_ttft_s']:8.3f} "
                f"{ref['device_loads']:6.0f} {ref['store_reads']:6.0f} {ref['load_seconds']:7.1f}"
            )
        print(
            f"{name:9} SLO {w['slo_s']:.3f} s  goodput ratio "
            f"{_ci(w, 'goodput_ratio_vs_best_ray_router')} (target >= 1.5){held_at_top_note(w)}  "
            f"load-seconds ratio "
            f"{_ci(w, 'load_seconds_ratio_vs_best_ray_router')}"
            + ("" if name != "zipf" else " (target <= 0.5)")
        )
        if "replicas_needed" in w:
            print(
                f"{name:9} replicas needed at {w['replicas_needed_rate_rps']:.0f} req/s "
                f"{w['replicas_needed']}: ratio "
                f"{_ci(w, 'replicas_needed_ratio_vs_best_ray_router')} (target <= 0.7)"
            )
    fail = f["workloads"]["failover"]
    print(
        f"failover: recovery {fail['recovery_s']}  streams failed {fail['streams_failed']}, "
        f"resumed {fail['streams_resumed']}"
    )
    for p in f["scale"]["points"]:
        print(
            f"scale {p['replicas']:3d} replicas {p['adapters']:6d} adapters: p99 best Ray / affinity "
            f"{_fmt(p['p99_ratio_best_ray_over_affinity'])}, load-seconds ratio "
            f"{_fmt(p['load_seconds_ratio_vs_best_ray_router'])}"
        )
    if "eviction" in f:
        e = f["eviction"]
        for router, r in e["routers"].items():
            print(
                f"eviction {e['adapters']} adapters {router:9}: p99 {_fmt(r['p99_ttft_s'])} s, "
                f"{r['evictions']} evictions, {r['host_hits']} host hits, "
                f"{r['store_reads']} reads"
            )
        print(f"eviction reads ratio vs multiplex {_ci(e, 'reads_ratio_vs_multiplex')}")
    if "validation" in f:
        print_validation(f["validation"])


def print_validation(v: dict) -> None:
    print(
        f"validation: p99_ttft_error {_fmt(v['p99_ttft_error'])} (target <= 0.25), "
        f"loads_error {_fmt(v['loads_error'])} (target <= 0.10)"
        + (
            f" on the means of {v['repetitions']} repetitions (each: p99 "
            + ", ".join(_fmt(e) for e in v["p99_ttft_error_by_repetition"])
            + "; loads "
            + ", ".join(_fmt(e) for e in v["loads_error_by_repetition"])
            + ")"
            if v.get("repetitions")
            else ""
        )
        + (
            f"; the real engines' steps took {_fmt(v['step_seconds_ratio'])} x the simulated "
            f"ones' (p99_ttft_error at their speed {_fmt(v.get('p99_ttft_error_at_real_step_speed'))}); "
            f"{_fmt(v.get('step_seconds_ratio_with_stream'))} x the simulated steps with the "
            f"streamed tokens' charge (p99_ttft_error with those slowed to the real steps' "
            f"seconds {_fmt(v.get('p99_ttft_error_at_real_busy_time'))})"
            if v.get("step_seconds_ratio") is not None
            else ""
        )
        + (
            f"; the path under load drawn from a calibration stream at the same rate (with the "
            f"lone requests' path p99_ttft_error {_fmt(v['p99_ttft_error_lone_path'])}, with "
            f"the path added by rank {_fmt(v.get('p99_ttft_error_ranked_path'))})"
            if v.get("p99_ttft_error_lone_path") is not None
            else ""
        )
        + (f"; {v['skipped']}" if v.get("skipped") else "")
    )


def _ci(figures: dict, key: str) -> str:
    """A ratio as its median over the repetitions and its 90% bootstrap interval."""
    low, high = figures.get(f"{key}_ci_low"), figures.get(f"{key}_ci_high")
    return f"{_fmt(figures[key])} [{_fmt(low)}, {_fmt(high)}]"


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
