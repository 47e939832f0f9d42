"""`loraplex bench router`: the router comparison (router.py), then its fairness section
(router_fairness.py) and its prefix section (router_prefix.py), one JSON of all three;
`--plot DIR` draws the comparison's goodput against offered rate per workload."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from loraplex.benchmarks.goodput import plot_goodput
from loraplex.benchmarks.report import log, write_json
from loraplex.benchmarks.router import bench as router
from loraplex.benchmarks.router import fairness as router_fairness
from loraplex.benchmarks.router import figures as router_figures
from loraplex.benchmarks.router import prefix as router_prefix
from loraplex.registry.etcd_process import INSTALL_HINT, find_etcd_binary


def run_bench(args: argparse.Namespace) -> int:
    if find_etcd_binary() is None:
        log(f"no etcd server binary; install one: {INSTALL_HINT}")
        return 2
    workload = router.QUICK if args.quick else router.FULL
    started = time.perf_counter()
    results = {"quick": bool(args.quick), **router.measure(workload)}
    results["seconds"] = time.perf_counter() - started
    if getattr(args, "plot", None):
        path = plot_goodput(
            results["workloads"], Path(args.plot) / "router_goodput.png", _title(results)
        )
        log(f"figure: {path}")
    router_figures.print_table(results)
    write_json(args.json, results)  # after each section: a later one's failure loses none
    fairness = router_fairness.QUICK if args.quick else router_fairness.FULL
    results["fairness"] = router_fairness.measure_fairness(fairness)
    router_fairness.print_fairness(results["fairness"])
    write_json(args.json, results)
    results["prefix"] = router_prefix.measure(router_prefix.workload(workload, args.quick))
    router_prefix.print_table(results["prefix"])
    write_json(args.json, results)
    return 0


def _title(results: dict) -> str:
    w = results["workload"]
    return (
        f"real Ray: {w['num_replicas']} replicas on this CPU, {w['num_adapters']} adapters, "
        f"reads {w['read_bandwidth_mib_s']:g} MiB/s + {w['read_latency_ms']:g} ms"
    )
