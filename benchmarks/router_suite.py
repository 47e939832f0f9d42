"""`loraplex bench router`: the router comparison (router.py), then its fairness section
(router_fairness.py) and its prefix section (router_prefix.py), one JSON of all three."""

from __future__ import annotations

import argparse

from loraplex.benchmarks import router, router_fairness, router_figures, router_prefix
from loraplex.benchmarks.report import log, write_json
from loraplex.registry.etcd_process import INSTALL_HINT, find_etcd_binary


def run_bench(args: argparse.Namespace) -> int:
    if find_etcd_binary() is None:
        log(f"no etcd server binary; install one: {INSTALL_HINT}")
        return 2
    workload = router.QUICK if args.quick else router.FULL
    results = {"quick": bool(args.quick), **router.measure(workload)}
    router_figures.print_table(results)
    fairness = router_fairness.QUICK if args.quick else router_fairness.FULL
    results["fairness"] = router_fairness.measure_fairness(fairness)
    router_fairness.print_fairness(results["fairness"])
    results["prefix"] = router_prefix.measure(router_prefix.workload(workload, args.quick))
    router_prefix.print_table(results["prefix"])
    write_json(args.json, results)
    return 0
