"""`loraplex bench fleet`: the affinity router against Ray Serve's routers at fleet scale, in
the fleet simulator (benchmarks/sim/fleet.py), and the simulator checked against a real run.

Fleet (stated values, FULL / QUICK):
    profile      H100 SXM5 80GB + Llama-2-7B fp16 (benchmarks/sim/profiles.py `gpu_profile`)
    replicas     16 / 8; adapters 2,000 / 500, ranks 8-128 in equal shares, on q/k/v/o
    engine       max_num_seqs 64, 4,096 batched tokens, 32 adapters per batch, FIFO,
                 Chameleon eviction, copies beside the compute
    host tier    64 GiB per replica (LRU beyond it, read again from the store); multiplex
                 max_num_models_per_replica = what 64 GiB holds of mean-size adapters
    store        artifact reads at 1 GiB/s after 20 ms (a network store per replica)
    Serve        max_ongoing_requests 128 (2 x the batch) for all routers; routing stats
                 every 1 s; model ids pushed every 0.1 s, at the router 0.05 s later
    affinity     its costs from the profile and store, as replicas would measure them: a
                 cold load is a mean adapter's read and copy, a host load the copy;
                 busy_cost_s 2 x what one more decode row adds to a step of 32 at the
                 trace's mean context; request_time_s = max_num_seqs / one replica's
                 throughput (how long a request holds a slot of a full batch);
                 max_homes_per_adapter = replicas
    requests     the Azure conversation trace's lengths (output capped at 1,024) and
                 arrivals (its timestamps scaled to each offered rate; Poisson without it)

Capacity: one replica's throughput under overload (base-model requests of the same lengths)
times the replicas; offered rates are fractions of it. Each run starts from a warm fleet:
first a warm-up stream of the workload's adapter picks (8 / 6 per adapter, 16-token
prompts, 1 output token) at the same rate through the same router, then the measured
window (60 s / 20 s); only the window's requests and loads are reported.

SLO = 5 x the unloaded TTFT: the mean, over the measured requests, of the TTFT each would
have alone on an idle replica that reads its adapter from the store (its prefill, the read
and the copy; `unloaded_ttft_s`). In this regime any router may have to read an adapter;
the SLO admits one read without queueing, so what it measures is queueing and repeated
reads. (Without the read, p99 TTFT sits on the ~1-5% of requests that read an adapter at
every rate and for every router, and no rate meets it.) Goodput at the SLO: the highest offered rate whose p99 TTFT stays
within it (benchmarks/goodput.py). Per workload (benchmarks/fleet/workloads.py):
    goodput_ratio_vs_best_ray_router       affinity's goodput / the better Ray router's
    load_seconds_ratio_vs_best_ray_router  at the reference rate: replica-seconds spent
                                           loading adapters (store reads and device
                                           copies), affinity / the lower Ray router's
    loads_vs_floor                         device loads / distinct adapters requested
    at the reference rate, per router: reads (store reads), host_hits (device loads from a
    host copy held before the request came, not one read for it), placement_miss_rate (of the placements whose router's view had the adapter
    on that replica's device or host tier, the share that waited for a store read; None
    for power of two, which has no view), distinct_adapters_held (on the devices and host
    tiers at the end of the run)
    failover: recovery_s (the kill until p99 TTFT of every later 5 s window is within the
    SLO), streams_failed (0: begun streams resume elsewhere), streams_resumed, requests_lost
    (0: requests without a first token are retried)
Scale sweep: zipf at the reference rate for 8..64 replicas and 500..10,000 adapters.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.benchmarks.engine.bench import DEFAULT_TRACE
from loraplex.benchmarks.fleet import workloads as fw
from loraplex.benchmarks.fleet.report import print_table, print_validation, title
from loraplex.benchmarks.goodput import (
    SLO_FACTOR,
    comparison,
    goodput,
    plot_goodput,
    ratio_vs_best_ray,
    recovery_s,
    within_slo_rps,
)
from loraplex.benchmarks.report import log, write_json
from loraplex.benchmarks.sim.fleet import ROUTERS, FleetRun, FleetSetup, simulate_fleet
from loraplex.benchmarks.sim.fleet_replica import StoreModel
from loraplex.benchmarks.sim.profiles import GiB, StepLoad, gpu_profile
from loraplex.benchmarks.sim.replica import System
from loraplex.benchmarks.sim.run import simulate
from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest, Trace, read_trace
from loraplex.replica.memory.adapter_cache import CacheConfig
from loraplex.replica.scheduling.scheduler import SchedulerConfig
from loraplex.router.policy import AffinityConfig

SCHED = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, max_loras_per_batch=32)
HOST_BYTES = 64 * GiB
STORE = StoreModel(bytes_per_s=float(GiB), latency_s=0.02)
MAX_TOKENS = 1024
RECOVERY_WINDOW_S = 5.0
KILL_REPLACE_S = 30.0  # Serve starts the replacement; a 7B replica loads in about that


@dataclass(frozen=True, slots=True)
class FleetShape:
    replicas: int
    adapters: int
    window_s: float  # the measured window, simulated seconds
    warmup_per_adapter: float
    rate_factors: tuple[float, ...]  # x the fleet's capacity
    reference_factor: float  # one of rate_factors: loads, load seconds and failover
    scale_points: tuple[tuple[int, int], ...]  # (replicas, adapters)
    scale_window_s: float
    profile: tuple[str, str] = ("h100", "llama2-7b")


FULL = FleetShape(
    replicas=16,
    adapters=2000,
    window_s=60.0,
    warmup_per_adapter=8,
    rate_factors=(0.3, 0.5, 0.65, 0.8, 0.9, 1.0),
    reference_factor=0.65,
    scale_points=((8, 500), (16, 2000), (32, 5000), (64, 10000)),
    scale_window_s=30.0,
)
QUICK = FleetShape(
    replicas=8,
    adapters=500,
    window_s=15.0,
    warmup_per_adapter=6,
    rate_factors=(0.3, 0.6, 0.9, 1.05),
    reference_factor=0.6,
    scale_points=((8, 500), (16, 1000)),
    scale_window_s=10.0,
)


@dataclass(frozen=True, slots=True)
class Fleet:
    """What every run of one bench shares."""

    profile: Any
    trace: Trace
    capacity_per_replica: float  # requests/s
    busy_cost_s: float  # TTFT one more running request adds
    shape: FleetShape

    @property
    def request_time_s(self) -> float:
        """How long a request holds a batch slot when the batch is full."""
        return SCHED.max_num_seqs / self.capacity_per_replica

    def setup(self, replicas: int, adapters: list[AdapterSpec], **extra) -> FleetSetup:
        mean = sum(a.nbytes for a in adapters) / len(adapters)
        copy = mean / self.profile.link_bytes_per_s + self.profile.load_setup_s
        affinity = AffinityConfig(
            load_cost_s=STORE.read_s(int(mean)) + copy,
            host_load_cost_s=copy,
            request_time_s=self.request_time_s,
            busy_cost_s=self.busy_cost_s,
            max_homes_per_adapter=replicas,
            use_measured_costs=False,
        )
        return FleetSetup(
            profile=self.profile,
            num_replicas=replicas,
            system=System("fifo", SCHED, CacheConfig(loading="thread", host_bytes=HOST_BYTES)),
            store=STORE,
            affinity=affinity,
            max_ongoing_requests=2 * SCHED.max_num_seqs,
            models_per_replica=max(1, int(HOST_BYTES // mean)),
            replace_after_s=KILL_REPLACE_S,
            max_len=self.profile.model["max_position_embeddings"],
            **extra,
        )

    def requests(
        self, workload: str, adapters: list[AdapterSpec], rate: float, window_s: float, seed: int
    ) -> tuple[list[SimRequest], int]:
        """The warm-up stream then the measured window; the first measured rid."""
        names = [a.name for a in adapters]
        warm_n = int(self.shape.warmup_per_adapter * len(adapters))
        popularity = "zipf" if workload in ("shift", "failover") else workload
        warm = fw.requests(
            popularity, names, warm_n, rate, fw.Lengths(prompt=(16, 16), output=(1, 1)), seed + 1
        )
        start = warm[-1].arrival + 1.0
        n = max(1, round(rate * window_s))
        trace = self.trace if n <= len(self.trace.timestamps) else None
        lengths = fw.Lengths(trace=self.trace, max_tokens=MAX_TOKENS)
        measured = fw.requests(workload, names, n, rate, lengths, seed, arrivals_trace=trace)
        measured = [
            dataclasses.replace(r, rid=warm_n + r.rid, arrival=start + r.arrival) for r in measured
        ]
        return warm + measured, warm_n


def run_bench(args: argparse.Namespace) -> int:
    shape = QUICK if args.quick else FULL
    started = time.perf_counter()
    if getattr(args, "validation_only", False):
        results: dict[str, Any] = {
            "quick": bool(args.quick),
            "fleet": {"validation": validation(bool(args.quick))},
        }
        results["seconds"] = time.perf_counter() - started
        print_validation(results["fleet"]["validation"])
        write_json(args.json, results)
        return 0
    results = {"quick": bool(args.quick), "fleet": measure(shape, args.trace)}
    if getattr(args, "sim_only", False):
        reason = "not run: --sim-only (run `bench fleet --validation-only` for it)"
        results["fleet"]["validation"] = {
            "p99_ttft_error": None,
            "loads_error": None,
            "skipped": reason,
        }
    else:
        results["fleet"]["validation"] = validation(bool(args.quick))
    if getattr(args, "plot", None):
        path = plot_goodput(
            results["fleet"]["workloads"],
            Path(args.plot) / "fleet_goodput.png",
            title(results["fleet"]),
        )
        log(f"figure: {path}")
    results["seconds"] = time.perf_counter() - started
    print_table(results)
    write_json(args.json, results)
    return 0


def validation(quick: bool) -> dict[str, Any]:
    """The simulator against a real local run (benchmarks/fleet/validation.py); without an
    etcd server binary the keys are None and the reason is given."""
    from loraplex.registry.etcd_process import INSTALL_HINT, find_etcd_binary

    if find_etcd_binary() is None:
        reason = f"no etcd server binary for the real run; install one: {INSTALL_HINT}"
        log(f"validation skipped: {reason}")
        return {"p99_ttft_error": None, "loads_error": None, "skipped": reason}
    from loraplex.benchmarks.fleet.validation import validate

    return validate(quick)


def measure(shape: FleetShape, trace_path: Path | None = None) -> dict[str, Any]:
    fleet = calibrate(shape, read_trace(trace_path or DEFAULT_TRACE))
    adapters = fw.catalog(shape.adapters, fleet.profile.adapter_bytes)
    log(
        f"fleet: {fleet.profile.name}, {shape.replicas} replicas x "
        f"{fleet.capacity_per_replica:.2f} req/s, slot time {fleet.request_time_s:.2f} s, busy "
        f"cost {fleet.busy_cost_s * 1e3:.2f} ms; "
        f"trace {fleet.trace.source}"
    )
    workloads: dict[str, Any] = {}
    for workload in fw.WORKLOADS:
        slo = workloads["zipf"]["slo_s"] if workload == "failover" else None
        workloads[workload] = sweep(fleet, workload, adapters, slo)
    return {
        "profile": fleet.profile.name,
        "profile_source": fleet.profile.source,
        "replicas": shape.replicas,
        "adapters": shape.adapters,
        "capacity_rps": fleet.capacity_per_replica * shape.replicas,
        "request_time_s": fleet.request_time_s,
        "busy_cost_s": fleet.busy_cost_s,
        "store": dataclasses.asdict(STORE),
        "host_bytes_per_replica": HOST_BYTES,
        "window_s": shape.window_s,
        "trace": fleet.trace.source,
        "workloads": workloads,
        "scale": scale_sweep(fleet),
    }


def calibrate(shape: FleetShape, trace: Trace) -> Fleet:
    """One replica's throughput under overload, on base-model requests of the workload's
    lengths, and the busy cost its step-time fit would give."""
    profile = gpu_profile(*shape.profile)
    lengths = fw.Lengths(trace=trace, max_tokens=MAX_TOKENS)
    system = System("fifo", SCHED, CacheConfig(loading="thread"))
    max_len = profile.model["max_position_embeddings"]

    def serve(rate: float, n: int):
        reqs = [
            dataclasses.replace(r, adapter=None)
            for r in fw.requests("zipf", ["-"], n, rate, lengths, 7)
        ]
        return simulate(reqs, profile, system, [], max_len)

    capacity = serve(1e3, 400).summary()["throughput_rps"]
    context = int(np.mean(trace.context) + np.mean(np.minimum(trace.generated, MAX_TOKENS)) / 2)

    def decode_step(rows: int) -> float:
        return profile.step_time(StepLoad(rows, rows * context, 0, 0))

    busy = 2 * (decode_step(32) - decode_step(31))
    return Fleet(profile, trace, capacity, busy, shape)


def sweep(
    fleet: Fleet, workload: str, adapters: list[AdapterSpec], slo: float | None
) -> dict[str, Any]:
    shape = fleet.shape
    catalog = {a.name: a for a in adapters}
    capacity = fleet.capacity_per_replica * shape.replicas
    rates = [f * capacity for f in shape.rate_factors]
    runs: dict[str, list[FleetRun]] = {r: [] for r in ROUTERS}
    kills: list[float | None] = []
    for i, rate in enumerate(rates):
        reqs, first = fleet.requests(workload, adapters, rate, shape.window_s, seed=100 * i)
        if i == 0:
            unloaded = unloaded_ttft_s(fleet.profile, reqs[first:], catalog)
        kill = fw.kill_at(reqs[first:]) if workload == "failover" else None
        kills.append(kill)
        setup = fleet.setup(shape.replicas, adapters, kill_at_s=kill, seed=i)
        for router in ROUTERS:
            t0 = time.perf_counter()
            run = simulate_fleet(router, reqs, catalog, setup, measured_from=first)
            runs[router].append(run)
            s = run.summary()
            log(
                f"fleet {workload} {rate:7.1f} req/s {router:9}: p50 {s['p50_ttft_s']:.3f} "
                f"p99 {s['p99_ttft_s']:.3f} s, {s['device_loads']} loads, {s['store_reads']} "
                f"reads ({time.perf_counter() - t0:.0f} s, load avg {os.getloadavg()[0]:.1f})"
            )
    slo = SLO_FACTOR * unloaded if slo is None else slo
    ref = shape.rate_factors.index(shape.reference_factor)
    routers: dict[str, Any] = {}
    for router, rs in runs.items():
        p99 = [_pct(r.ttft, 99) for r in rs]
        routers[router] = {
            "p50_ttft_s": [_pct(r.ttft, 50) for r in rs],
            "p99_ttft_s": p99,
            "within_slo_rps": [
                within_slo_rps(r.ttft, r.requests, rate, slo)
                for r, rate in zip(rs, rates, strict=True)
            ],
            "goodput_at_slo_rps": goodput(rates, p99, slo),
            "at_reference": rs[ref].summary(),
        }
        if workload == "failover":
            routers[router]["recovery_s"] = [
                recovery_s(r.arrival, r.ttft, k, slo, RECOVERY_WINDOW_S)
                for r, k in zip(rs, kills, strict=True)
            ]
    out = {"unloaded_ttft_s": unloaded, **_keys(routers, rates, slo, ref)}
    for key in ("placement_miss_rate", "host_hits", "distinct_adapters_held"):
        out[key] = {r: f["at_reference"][key] for r, f in routers.items()}
    if workload == "failover":
        out["recovery_s"] = {r: f["recovery_s"][ref] for r, f in routers.items()}
        out["streams_failed"] = {r: f["at_reference"]["streams_failed"] for r, f in routers.items()}
        out["streams_resumed"] = {
            r: f["at_reference"]["streams_resumed"] for r, f in routers.items()
        }
        out["requests_lost"] = 0  # simulate_fleet asserts it
    return out


def unloaded_ttft_s(profile, reqs: list[SimRequest], catalog: dict[str, AdapterSpec]) -> float:
    """Mean TTFT of `reqs`, each alone on an idle replica that reads its adapter from the
    store first: the read, the copy over the host link, then the prefill in chunks of the
    scheduler's token budget."""
    total = 0.0
    for r in reqs:
        nbytes = catalog[r.adapter].nbytes
        rank = catalog[r.adapter].rank
        t = STORE.read_s(nbytes) + nbytes / profile.link_bytes_per_s + profile.load_setup_s
        done = 0
        while done < r.prompt:
            n = min(SCHED.max_num_batched_tokens, r.prompt - done)
            t += profile.step_time(StepLoad(n, done + n, n * rank, nbytes))
            done += n
        total += t
    return total / len(reqs)


def _keys(routers: dict, rates: list[float], slo: float, ref: int) -> dict[str, Any]:
    return {
        "rates_rps": rates,
        "reference_rate_rps": rates[ref],
        "slo_s": slo,
        **comparison(routers, loads="device_loads", reads="store_reads"),
        "routers": routers,
    }


def scale_sweep(fleet: Fleet) -> dict[str, Any]:
    shape = fleet.shape
    points = []
    for replicas, n in shape.scale_points:
        adapters = fw.catalog(n, fleet.profile.adapter_bytes)
        catalog = {a.name: a for a in adapters}
        rate = shape.reference_factor * fleet.capacity_per_replica * replicas
        reqs, first = fleet.requests("zipf", adapters, rate, shape.scale_window_s, seed=7)
        setup = fleet.setup(replicas, adapters)
        per_router = {}
        for router in ROUTERS:
            t0 = time.perf_counter()
            per_router[router] = simulate_fleet(router, reqs, catalog, setup, first).summary()
            log(
                f"fleet scale {replicas} x {n} {router:9}: p99 "
                f"{per_router[router]['p99_ttft_s']:.3f} s ({time.perf_counter() - t0:.0f} s)"
            )
        p99 = {r: s["p99_ttft_s"] for r, s in per_router.items()}
        load_s = {r: s["load_seconds"] for r, s in per_router.items()}
        points.append(
            {
                "replicas": replicas,
                "adapters": n,
                "rate_rps": rate,
                "routers": per_router,
                "p99_ratio_best_ray_over_affinity": _inverse(ratio_vs_best_ray(p99, False)),
                "load_seconds_ratio_vs_best_ray_router": ratio_vs_best_ray(load_s, False),
            }
        )
    return {"workload": "zipf", "rate_factor": shape.reference_factor, "points": points}


def _inverse(x: float | None) -> float | None:
    return None if x is None else (math.inf if x == 0 else 1.0 / x)


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None
