"""`loraplex bench fleet`: the affinity router against Ray Serve's routers at fleet scale, in
the fleet simulator (benchmarks/sim/fleet.py), and the simulator checked against a real run.

Fleet (stated values, FULL / QUICK):
    profile      H100 SXM5 80GB + Llama-2-7B fp16 (benchmarks/sim/profiles.py `gpu_profile`)
    replicas     16 / 8; adapters 2,000 / 1,500 (194 / 145 GiB: more than one replica's
                 host tier holds, less than the fleet's), ranks 8-128 in equal shares, on
                 q/k/v/o
    engine       max_num_seqs 64, 4,096 batched tokens, 32 adapters per batch, FIFO,
                 Chameleon eviction, copies beside the compute
    host tier    64 GiB per replica (LRU beyond it, read again from the store); multiplex
                 max_num_models_per_replica = what 64 GiB holds of mean-size adapters
    store        artifact reads at 400 MiB/s after 50 ms (an object store per replica: a
                 mean adapter in 0.3 s)
    Serve        max_ongoing_requests 1e9 for all routers, as Ray Serve LLM deploys its
                 engines (benchmarks/peers/ray_routers.py SERVE_LLM_MAX_ONGOING_REQUESTS:
                 the engine queues, Serve only forwards; runs before 2026-12-03 held 128,
                 2 x the batch); routing stats every 1 s; model ids pushed every 0.1 s, at
                 the router 0.05 s later
    affinity     its costs from the profile and store, as replicas would measure them: a
                 cold load is a mean adapter's read and copy, a host load the copy;
                 busy_cost_s 2 x what one more decode row adds to a step of 32 at the
                 trace's mean context; prefill_token_cost_s a full prefill step's time
                 per token (what a replica's queued prompt tokens cost); request_time_s = max_num_seqs / one replica's
                 throughput (how long a request holds a slot of a full batch);
                 max_homes_per_adapter = replicas
    requests     the Azure conversation trace's lengths (output capped at 1,024) and
                 arrivals (its timestamps scaled to each offered rate; Poisson without it)

Capacity: one replica's throughput under overload (base-model requests of the same lengths)
times the replicas; offered rates are fractions of it. Each run starts from a warm fleet:
first a warm-up stream of the workload's adapter picks (8 / 4 per adapter, 16-token
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
    zipf and shift: replicas_needed_ratio_vs_best_ray_router, the fewest replicas whose p99
    TTFT holds the SLO at the reference rate (an offered load of reference_factor x the
    fleet's capacity, `replicas_needed_rate_rps`), found by doubling then bisecting on the
    reference run's stream, affinity's / the better Ray router's (`replicas_needed` per
    router; None: not even 4 x the fleet)
    failover: recovery_s (the kill until p99 TTFT of every later 5 s window is within the
    SLO), streams_failed (0: begun streams resume elsewhere), streams_resumed, requests_lost
    (0: requests without a first token are retried)
Scale sweep: zipf at the reference rate for 8..64 replicas and 500..10,000 adapters.
Eviction (`evicting`): zipf at the reference rate where device pools evict: each host tier
256 GiB (a DGX H100 node's 2 TiB over its 8 GPUs) and the catalog 4 x as large (8,000 /
6,000 adapters); per router evictions, host_hits and store reads, and
reads_ratio_vs_multiplex.

Repetitions (3 / 2): the whole bench again on other seeds (arrivals, lengths, adapter picks
and the popularity order; the simulator is deterministic per seed). Every figure is the
median over them, every ratio also its 90% bootstrap interval (`<key>_ci_low`,
`<key>_ci_high`, benchmarks/report.py `over_repetitions`); `repetitions` holds each one's.
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
    fewest_replicas,
    goodput,
    plot_goodput,
    ratio_vs_best_ray,
    recovery_s,
    repeated,
    within_slo_rps,
)
from loraplex.benchmarks.peers.ray_routers import SERVE_LLM_MAX_ONGOING_REQUESTS
from loraplex.benchmarks.report import log, over_repetitions, write_json
from loraplex.benchmarks.sim.fleet import ROUTERS, FleetRun, FleetSetup, simulate_fleet
from loraplex.benchmarks.sim.fleet_replica import StoreModel
from loraplex.benchmarks.sim.profiles import GiB, MiB, StepLoad, gpu_profile
from loraplex.benchmarks.sim.replica import System
from loraplex.benchmarks.sim.run import simulate
from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest, Trace, read_trace
from loraplex.replica.memory.adapter_cache import CacheConfig
from loraplex.replica.scheduling.scheduler import SchedulerConfig
from loraplex.router.policy import AffinityConfig

SCHED = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, max_loras_per_batch=32)
HOST_BYTES = 64 * GiB
# The eviction section's host tier: what a DGX H100 node (2 TiB of memory, 8 GPUs) gives one
# GPU's replica, 4 x HOST_BYTES; its catalog grows by the same factor
NODE_HOST_BYTES = 256 * GiB
# an object store read per replica: a mean adapter (99 MiB) in 0.3 s, rank 8 in 0.09 s,
# rank 128 in 0.69 s (the regime: reads of 200-500 ms)
STORE = StoreModel(bytes_per_s=400.0 * MiB, latency_s=0.05)
MAX_TOKENS = 1024
RECOVERY_WINDOW_S = 5.0
REPLICAS_NEEDED_WORKLOADS = ("zipf", "shift")
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
    repeats: int  # each a different seed (the simulator is deterministic per seed)
    profile: tuple[str, str] = ("h100", "llama2-7b")
    host_bytes: int = HOST_BYTES  # per replica


FULL = FleetShape(
    replicas=16,
    adapters=2000,
    window_s=60.0,
    warmup_per_adapter=8,
    rate_factors=(0.3, 0.5, 0.65, 0.8, 0.9, 1.0),
    reference_factor=0.65,
    scale_points=((8, 500), (16, 2000), (32, 5000), (64, 10000)),
    scale_window_s=30.0,
    repeats=3,
)
QUICK = FleetShape(
    replicas=8,
    adapters=1500,  # 145 GiB: 2.3 x one replica's host tier, 0.28 x the fleet's
    window_s=15.0,
    warmup_per_adapter=4,
    rate_factors=(0.3, 0.6, 0.9, 1.05),
    reference_factor=0.6,
    scale_points=((8, 1500), (16, 3000)),
    scale_window_s=10.0,
    repeats=2,
)


@dataclass(frozen=True, slots=True)
class Fleet:
    """What every run of one bench shares."""

    profile: Any
    trace: Trace
    capacity_per_replica: float  # requests/s
    busy_cost_s: float  # TTFT one more running request adds
    prefill_token_cost_s: float  # a full prefill step's time per token
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
            prefill_token_cost_s=self.prefill_token_cost_s,
            max_homes_per_adapter=replicas,
            use_measured_costs=False,
        )
        return FleetSetup(
            profile=self.profile,
            num_replicas=replicas,
            system=System(
                "fifo", SCHED, CacheConfig(loading="thread", host_bytes=self.shape.host_bytes)
            ),
            store=STORE,
            affinity=affinity,
            max_ongoing_requests=SERVE_LLM_MAX_ONGOING_REQUESTS,
            models_per_replica=max(1, int(self.shape.host_bytes // mean)),
            replace_after_s=KILL_REPLACE_S,
            max_len=self.profile.model["max_position_embeddings"],
            **extra,
        )

    def requests(
        self,
        workload: str,
        adapters: list[AdapterSpec],
        rate: float,
        window_s: float,
        seed: int,
        repetition: int = 0,
    ) -> tuple[list[SimRequest], int]:
        """The warm-up stream then the measured window; the first measured rid. Each
        repetition draws its own popularity order (which adapters, of which sizes, are hot)."""
        names = [a.name for a in adapters]
        warm_n = int(self.shape.warmup_per_adapter * len(adapters))
        popularity = "zipf" if workload in ("shift", "failover") else workload
        order = {"popularity_seed": repetition}
        warm_lengths = fw.Lengths(prompt=(16, 16), output=(1, 1))
        warm = fw.requests(popularity, names, warm_n, rate, warm_lengths, seed + 1, **order)
        start = warm[-1].arrival + 1.0
        n = max(1, round(rate * window_s))
        trace = self.trace if n <= len(self.trace.timestamps) else None
        lengths = fw.Lengths(trace=self.trace, max_tokens=MAX_TOKENS)
        measured = fw.requests(
            workload, names, n, rate, lengths, seed, arrivals_trace=trace, **order
        )
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
            "fleet": {
                "validation": validation(
                    bool(args.quick),
                    save_run=getattr(args, "save_run", None),
                    from_run=getattr(args, "from_run", None),
                )
            },
        }
        results["seconds"] = time.perf_counter() - started
        print_validation(results["fleet"]["validation"])
        write_json(args.json, results)
        return 0
    results = {"quick": bool(args.quick), "fleet": measure(shape, args.trace)}
    if getattr(args, "sim_only", False):
        reason = "not run: --sim-only (`bench fleet --validation-only` writes it)"
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


def validation(
    quick: bool, save_run: Path | None = None, from_run: Path | None = None
) -> dict[str, Any]:
    """The simulator against a real local run (benchmarks/fleet/validation.py), or against
    one saved by an earlier `save_run`; without an etcd server binary for a real run the
    keys are None and the reason is given."""
    from loraplex.registry.etcd_process import INSTALL_HINT, find_etcd_binary

    if from_run is None and find_etcd_binary() is None:
        reason = f"no etcd server binary for the real run; install one: {INSTALL_HINT}"
        log(f"validation skipped: {reason}")
        return {"p99_ttft_error": None, "loads_error": None, "skipped": reason}
    from loraplex.benchmarks.fleet.validation import validate

    return validate(quick, save_run=save_run, from_run=from_run)


def measure(shape: FleetShape, trace_path: Path | None = None) -> dict[str, Any]:
    fleet = calibrate(shape, read_trace(trace_path or DEFAULT_TRACE))
    adapters = fw.catalog(shape.adapters, fleet.profile.adapter_bytes)
    log(
        f"fleet: {fleet.profile.name}, {shape.replicas} replicas x "
        f"{fleet.capacity_per_replica:.2f} req/s, slot time {fleet.request_time_s:.2f} s, busy "
        f"cost {fleet.busy_cost_s * 1e3:.2f} ms; "
        f"trace {fleet.trace.source}"
    )
    reps: list[dict[str, Any]] = []
    for rep in range(shape.repeats):
        workloads: dict[str, Any] = {}
        for workload in fw.WORKLOADS:
            slo = workloads["zipf"]["slo_s"] if workload == "failover" else None
            workloads[workload] = sweep(fleet, workload, adapters, slo, rep)
        reps.append(workloads)
    return {
        "profile": fleet.profile.name,
        "profile_source": fleet.profile.source,
        "replicas": shape.replicas,
        "adapters": shape.adapters,
        "capacity_rps": fleet.capacity_per_replica * shape.replicas,
        "request_time_s": fleet.request_time_s,
        "busy_cost_s": fleet.busy_cost_s,
        "prefill_token_cost_s": fleet.prefill_token_cost_s,
        "max_ongoing_requests": SERVE_LLM_MAX_ONGOING_REQUESTS,
        "store": dataclasses.asdict(STORE),
        "host_bytes_per_replica": shape.host_bytes,
        "window_s": shape.window_s,
        "trace": fleet.trace.source,
        "repeats": shape.repeats,
        "workloads": {w: repeated([rep[w] for rep in reps]) for w in fw.WORKLOADS},
        "scale": over_repetitions([scale_sweep(fleet, rep) for rep in range(shape.repeats)]),
        "eviction": over_repetitions(
            [eviction_run(evicting(fleet), rep) for rep in range(shape.repeats)]
        ),
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
    chunk = SCHED.max_num_batched_tokens
    per_token = profile.step_time(StepLoad(chunk, chunk, 0, 0)) / chunk
    return Fleet(profile, trace, capacity, busy, per_token, shape)


def sweep(
    fleet: Fleet,
    workload: str,
    adapters: list[AdapterSpec],
    slo: float | None,
    repetition: int = 0,
) -> dict[str, Any]:
    """Every rate through every router, on repetition `repetition`'s seeds. The routers
    run one after another on the same stream; in the simulator their order changes
    nothing (each run is its own fleet)."""
    shape = fleet.shape
    catalog = {a.name: a for a in adapters}
    capacity = fleet.capacity_per_replica * shape.replicas
    rates = [f * capacity for f in shape.rate_factors]
    runs: dict[str, list[FleetRun]] = {r: [] for r in ROUTERS}
    kills: list[float | None] = []
    streams = []
    for i, rate in enumerate(rates):
        seed = 100 * i + 10_000 * repetition
        reqs, first = fleet.requests(workload, adapters, rate, shape.window_s, seed, repetition)
        streams.append((reqs, first))
        if i == 0:
            unloaded = unloaded_ttft_s(fleet.profile, reqs[first:], catalog)
        kill = fw.kill_at(reqs[first:]) if workload == "failover" else None
        kills.append(kill)
        setup = fleet.setup(shape.replicas, adapters, kill_at_s=kill, seed=i + 100 * repetition)
        label = f"{workload} {rate:7.1f} req/s"
        for router, run in through_routers(label, reqs, first, catalog, setup).items():
            runs[router].append(run)
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
    if workload in REPLICAS_NEEDED_WORKLOADS:
        p99s = {r: f["p99_ttft_s"][ref] for r, f in routers.items()}
        holds = {r: p99 is not None and p99 <= slo for r, p99 in p99s.items()}
        reqs, first = streams[ref]
        out.update(replicas_needed(fleet, reqs, first, catalog, slo, holds, ref, repetition))
        out["replicas_needed_rate_rps"] = rates[ref]
    return out


def replicas_needed(
    fleet: Fleet,
    reqs: list[SimRequest],
    first: int,
    catalog: dict[str, AdapterSpec],
    slo: float,
    holds_at_shape: dict[str, bool],
    ref: int,
    repetition: int,
) -> dict[str, Any]:
    """The cost a user pays: per router, the fewest replicas whose p99 TTFT on the reference
    run's stream stays within the SLO (`goodput.fewest_replicas`, up to 4 x the fleet; None
    beyond), and affinity's over the best Ray router's. `holds_at_shape`: the reference
    runs' verdicts, at the fleet's own size."""
    shape, adapters = fleet.shape, list(catalog.values())
    needed: dict[str, int | None] = {}
    for router in ROUTERS:

        def holds(n: int, router: str = router) -> bool:
            if n == shape.replicas:
                return holds_at_shape[router]
            setup = fleet.setup(n, adapters, seed=ref + 100 * repetition)
            run = simulate_fleet(router, reqs, catalog, setup, measured_from=first)
            p99 = _pct(run.ttft, 99)
            log(f"fleet replicas needed {router:9}: {n:3d} replicas, p99 {p99:.3f} s")
            return p99 is not None and p99 <= slo

        needed[router] = fewest_replicas(holds, shape.replicas, 4 * shape.replicas)
    return {
        "replicas_needed": needed,
        "replicas_needed_ratio_vs_best_ray_router": ratio_vs_best_ray(needed, False),
    }


def through_routers(
    label: str,
    reqs: list[SimRequest],
    first: int,
    catalog: dict[str, AdapterSpec],
    setup: FleetSetup,
) -> dict[str, FleetRun]:
    """One stream through every router, each on a fleet of its own (in the simulator their
    order changes nothing), measured from rid `first`; a log line per router."""
    runs = {}
    for router in ROUTERS:
        started = time.perf_counter()
        runs[router] = simulate_fleet(router, reqs, catalog, setup, measured_from=first)
        s = runs[router].summary()
        log(
            f"fleet {label} {router:9}: p50 {_fmt(s['p50_ttft_s'])} p99 {_fmt(s['p99_ttft_s'])} "
            f"s, {s['device_loads']} loads, {s['store_reads']} reads, {s['host_hits']} host "
            f"hits, {s['evictions']} evictions ({time.perf_counter() - started:.0f} s, load "
            f"avg {os.getloadavg()[0]:.1f})"
        )
    return runs


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
        **comparison(routers, rates[-1], loads="device_loads", reads="store_reads"),
        "routers": routers,
    }


def scale_sweep(fleet: Fleet, repetition: int = 0) -> dict[str, Any]:
    shape = fleet.shape
    points = []
    for replicas, n in shape.scale_points:
        adapters = fw.catalog(n, fleet.profile.adapter_bytes)
        catalog = {a.name: a for a in adapters}
        rate = shape.reference_factor * fleet.capacity_per_replica * replicas
        seed = 7 + 10_000 * repetition
        reqs, first = fleet.requests("zipf", adapters, rate, shape.scale_window_s, seed, repetition)
        setup = fleet.setup(replicas, adapters, seed=100 * repetition)
        runs = through_routers(f"scale {replicas} x {n}", reqs, first, catalog, setup)
        per_router = {router: run.summary() for router, run in runs.items()}
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


def evicting(fleet: Fleet) -> Fleet:
    """The fleet on the shape whose device pools evict: each replica's host tier what a
    DGX H100 node gives one GPU (NODE_HOST_BYTES, 4 x the main shape's) and the catalog 4 x
    as large, so it keeps its ratio to one host tier and to the fleet's, while a replica's
    share of it (quick: 6,000 adapters / 8 x 99 MiB = 73 GiB) outgrows its device pool
    (63 GiB, shared with the KV cache). At the main shape a replica's share (18 GiB) fits
    its device pool, nothing is evicted in the window, and no load comes from a host copy."""
    factor = NODE_HOST_BYTES // HOST_BYTES
    shape = fleet.shape
    bigger = dataclasses.replace(
        shape, adapters=factor * shape.adapters, host_bytes=factor * shape.host_bytes
    )
    return dataclasses.replace(fleet, shape=bigger)


def eviction_run(fleet: Fleet, repetition: int = 0) -> dict[str, Any]:
    """zipf at the reference rate through every router on `fleet` (`evicting`), with the
    main sweep's warm-up rule, window and seeds: per router the device evictions, the
    loads from a host copy (host_hits) and the store reads, and affinity's reads over
    multiplexing's."""
    shape = fleet.shape
    adapters = fw.catalog(shape.adapters, fleet.profile.adapter_bytes)
    catalog = {a.name: a for a in adapters}
    ref = shape.rate_factors.index(shape.reference_factor)
    rate = shape.reference_factor * fleet.capacity_per_replica * shape.replicas
    seed = 100 * ref + 10_000 * repetition
    reqs, first = fleet.requests("zipf", adapters, rate, shape.window_s, seed, repetition)
    slo = SLO_FACTOR * unloaded_ttft_s(fleet.profile, reqs[first:], catalog)
    setup = fleet.setup(shape.replicas, adapters, seed=ref + 100 * repetition)
    keys = ("p99_ttft_s", "device_loads", "store_reads", "host_hits", "evictions")
    runs = through_routers(f"eviction {shape.adapters} adapters", reqs, first, catalog, setup)
    routers = {}
    for router, run in runs.items():
        s = run.summary()
        routers[router] = {
            k: s[k] for k in (*keys, "placement_miss_rate", "distinct_adapters_held")
        }
    reads = {r: f["store_reads"] for r, f in routers.items()}
    return {
        "workload": "zipf",
        "replicas": shape.replicas,
        "adapters": shape.adapters,
        "host_bytes_per_replica": shape.host_bytes,
        "rate_rps": rate,
        "slo_s": slo,
        "routers": routers,
        "reads_ratio_vs_multiplex": (
            reads["affinity"] / reads["multiplex"] if reads["multiplex"] else None
        ),
    }


def _inverse(x: float | None) -> float | None:
    return None if x is None else (math.inf if x == 0 else 1.0 / x)


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _fmt(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.3f}"
