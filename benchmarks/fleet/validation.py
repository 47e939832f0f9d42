"""The fleet simulator against a real run (`loraplex bench fleet`'s validation keys).

One `loraplex bench router` run of the zipf workload at one rate, the three routers on a
real local Ray (benchmarks/router/bench.py), then the simulator configured like it: the same
warm-up and requests (arrivals, adapters, lengths), the same adapters (rank, bytes), pool,
host tier, read model, Serve settings and router costs, and a CPU profile fitted on this
machine: the step timings `bench router` recorded on one engine (least squares,
sim_profiles.fit_linear), scaled by how much slower the replicas ran together than alone
(the capacity they showed on the saturating burst over the capacity the fitted profile
predicts for them on the same burst: they share the machine's cores).

    p99_ttft_error = mean over routers of |simulated p99 TTFT - real| / real
    loads_error    = mean over routers of |simulated device loads - real| / real
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

import numpy as np

from loraplex.benchmarks.report import log
from loraplex.benchmarks.router import bench as bench_router
from loraplex.benchmarks.router.figures import PAGE_BYTES
from loraplex.benchmarks.sim.fleet import ROUTERS, FleetSetup, simulate_fleet
from loraplex.benchmarks.sim.fleet_replica import StoreModel
from loraplex.benchmarks.sim.profiles import LinearProfile, fit_linear
from loraplex.benchmarks.sim.replica import System
from loraplex.benchmarks.sim.run import simulate
from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest
from loraplex.replica.memory.adapter_cache import CacheConfig
from loraplex.replica.scheduling.scheduler import SchedulerConfig
from loraplex.router.policy import AffinityConfig


def validate(quick: bool) -> dict[str, Any]:
    base = bench_router.QUICK if quick else bench_router.FULL
    w = replace(base, rate_factors=(base.reference_factor,), repeats=1)
    measured = bench_router.run_measured(w, workloads=("zipf",))
    real = measured.figures["workloads"]["zipf"]
    profile = cpu_profile(measured, w)
    setup = _setup(measured, w, profile)
    catalog = {
        name: AdapterSpec(name, rank, nbytes) for name, (rank, nbytes) in measured.adapters.items()
    }
    routers: dict[str, Any] = {}
    for router in ROUTERS:
        requests, first = _replay(measured.requests[0]["zipf"], router)
        run = simulate_fleet(router, requests, catalog, setup, measured_from=first)
        sim = run.summary()
        at = real["routers"][router]["at_reference"]
        routers[router] = {
            "real_p99_ttft_s": at["p99_ttft_s"],
            "sim_p99_ttft_s": sim["p99_ttft_s"],
            "real_loads": at["loads"],
            "sim_loads": sim["device_loads"],
            "real_reads": at["reads"],
            "sim_reads": sim["store_reads"],
        }
        log(f"validation {router}: {routers[router]}")
    return {
        "workload": "zipf",
        "rate_rps": real["rates_rps"][0],
        "profile": profile.source,
        "routers": routers,
        "p99_ttft_error": _error(routers, "p99_ttft_s"),
        "loads_error": _error(routers, "loads"),
        "real": {k: v for k, v in measured.figures.items() if k != "workloads"},
    }


def _error(routers: dict[str, dict], key: str) -> float | None:
    errors = [
        abs(r[f"sim_{key}"] - r[f"real_{key}"]) / r[f"real_{key}"]
        for r in routers.values()
        if r[f"real_{key}"] and r[f"sim_{key}"] is not None
    ]
    return float(np.mean(errors)) if errors else None


def cpu_profile(measured: bench_router.Measured, w: bench_router.Workload) -> LinearProfile:
    coef, r2 = fit_linear(measured.calibration["steps"])
    spec = w.model
    alone = LinearProfile(
        name="cpu-fitted",
        source="",
        model={
            "model_type": "llama",
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads,
            "max_position_embeddings": 4096,
            "torch_dtype": "float32",
        },
        pool_bytes=measured.engine_config["pool_bytes"],
        page_bytes=PAGE_BYTES,
        link_bytes_per_s=measured.calibration["copy_bytes_per_s"],
        load_setup_s=0.0,
        coef=coef,
        fit_r2=r2,
    )
    predicted = w.num_replicas * _burst_capacity(alone, w)
    slowdown = max(1.0, predicted / measured.calibration["capacity_rps"])
    return dataclasses.replace(
        alone,
        coef=tuple(c * slowdown for c in coef),
        source=(
            f"least squares over {len(measured.calibration['steps'])} engine steps on this "
            f"machine (R² {r2:.2f}), x {slowdown:.2f}: the replicas served "
            f"{measured.calibration['capacity_rps']:.1f} req/s together, alone they would "
            f"have served {predicted:.1f}"
        ),
    )


def _burst_capacity(profile: LinearProfile, w: bench_router.Workload) -> float:
    """One simulated replica's completions per second on `bench router`'s capacity burst."""
    n = 10 * w.max_num_seqs
    prompt, out = sum(w.prompt_tokens) // 2, sum(w.output_tokens) // 2
    reqs = [SimRequest(i, 0.0, prompt, out, out, None) for i in range(n)]
    system = System("fifo", SchedulerConfig(max_num_seqs=w.max_num_seqs), CacheConfig())
    return simulate(reqs, profile, system, [], 4096).summary()["throughput_rps"]


def _setup(measured: bench_router.Measured, w: bench_router.Workload, profile) -> FleetSetup:
    config = measured.engine_config
    reads = config["artifacts"]
    costs = {k: v for k, v in measured.costs.items()}
    return FleetSetup(
        profile=profile,
        num_replicas=w.num_replicas,
        system=System(
            "fifo",
            SchedulerConfig(max_num_seqs=w.max_num_seqs),
            CacheConfig(loading="thread", host_bytes=config["cache"]["host_bytes"]),
        ),
        store=StoreModel(reads["read_bandwidth_mib_s"] * (1 << 20), reads["read_latency_ms"] / 1e3),
        # the real replicas publish measured costs too; these are what the router starts from
        affinity=AffinityConfig(**costs, use_measured_costs=False),
        max_ongoing_requests=2 * w.max_num_seqs,
        models_per_replica=w.host_adapters_per_replica,
        stats_period_s=w.routing_stats_period_s,
        max_len=4096,
        seed=w.seed,
    )


def _replay(requests: dict[str, Any], router: str) -> tuple[list[SimRequest], int]:
    """The real warm-up then the real run as one simulated stream, the run starting as long
    after the warm-up's start as it did for `router` in the real bench (the other routers'
    warm-ups ran in between, and the replicas finished their reads meanwhile)."""
    warm = requests["warm-up"]
    (run,) = requests["runs"]
    (start,) = requests["offsets_s"][router]
    shifted = [
        dataclasses.replace(r, rid=len(warm) + i, arrival=start + r.arrival)
        for i, r in enumerate(run)
    ]
    return [*warm, *shifted], len(warm)
