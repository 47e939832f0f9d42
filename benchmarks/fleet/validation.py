"""The fleet simulator against a real run (`loraplex bench fleet`'s validation keys).

`loraplex bench router`'s repetitions of the zipf workload at one rate, the three routers on
a real local Ray (benchmarks/router/bench.py), each replayed in the simulator configured like
it: the same warm-up and requests (arrivals, adapters, lengths), the same adapters (rank,
bytes), pool,
host tier, read model, Serve settings and router costs, and a CPU profile fitted on this
machine: the step timings `bench router` recorded on one engine (least squares,
sim_profiles.fit_linear), slowed by each replica's share of the cores (replicas ÷ cores),
plus what a request costs outside the engine's steps (Serve's handling of its call and of
each streamed chunk, in the replica and the driver), charged to each step row: the
difference between the real replicas' time per request on the saturating base-model burst
and their steps' on the same burst, over its output tokens. It was one factor on every
step (12 x in a replay of 2026-12-02, once the fit priced LoRA): a request's prefill then
cost 12 steps' time and the simulated p99 TTFT at the lowest rate was 2.2 x the real one;
charged to a request's first step instead, it put ~55 ms before every first token where
the real p50 TTFT was 28 ms. And what the path adds to a first token without the
replicas' CPU (Ray's handle and actor hops): a draw per request from the lone requests'
TTFTs through the real app less the simulated one (`path_latency`).

    p99_ttft_error = mean over routers of |simulated p99 TTFT - real| / real
    loads_error    = mean over routers of |simulated device loads - real| / real
    (each figure the mean over the repetitions)

`replay_bench` (python -m loraplex.benchmarks.fleet.validation ROUTER_JSON) needs no real
run: the simulator configured like a published `bench router` run from its JSON (capacity,
SLO, router costs; the engine's step timings measured here), every rate of its sweep
replayed per repetition with its seeds, affinity's TTFT estimate per request set beside
what the request waited, and the LoRA workload's own burst capacity per router beside the
rates' basis (`rate_basis_rps`: the best router's LoRA capacity; the base-model burst's in
runs before it was published).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.benchmarks.fleet import workloads as fw
from loraplex.benchmarks.report import log, usable_cpus
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

# The calibration stream's length in runs of the reference rate (bench.py `_loaded_path`):
# with one run's 320 requests, its drawn path's tail (real - simulated above the p99) rested
# on 3 requests, and the four runs of 2026-12-04 put p99_ttft_error at 0.20-0.49
LOADED_PATH_RUNS = 3


class SavedRunError(ValueError):
    """`--from-run`'s file is not a run `--save-run` wrote, or not of this mode."""


def validation_workload(quick: bool) -> bench_router.Workload:
    """`bench router`'s workload at its reference rate alone, its repetitions on other seeds
    at that one rate: no rate past the grid (a sweep goes on past its grid while a router
    holds the SLO, and with every router holding it at the reference rate the run of
    2026-12-02 went on to 1.7 x the basis, then failed on the runs it could not replay)."""
    base = bench_router.QUICK if quick else bench_router.FULL
    return replace(
        base,
        rate_factors=(base.reference_factor,),
        extra_rate_factors=(),
        loaded_path_runs=LOADED_PATH_RUNS,
    )


def validate(
    quick: bool, save_run: Path | None = None, from_run: Path | None = None
) -> dict[str, Any]:
    """The real run (or the one `from_run` holds, which an earlier `save_run` wrote: the
    simulator checked again against the same measurements in seconds, without Ray),
    replayed (`validate_measured`)."""
    w = validation_workload(quick)
    if from_run is not None:
        try:
            saved = json.loads(from_run.read_text())
            measured, cpus = bench_router.Measured.from_json(saved["measured"]), saved["cpus"]
            was_quick, date = saved["quick"], saved["date"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SavedRunError(
                f"--from-run {from_run}: not a run `--save-run` wrote ({e!r})"
            ) from None
        if was_quick != quick:
            raise SavedRunError(
                f"--from-run {from_run} holds a {'--quick' if was_quick else 'full'} run: "
                f"validate it {'with' if was_quick else 'without'} --quick"
            )
        log(f"validation: the real run of {date} from {from_run}, not run again")
    else:
        measured = bench_router.run_measured(w, workloads=("zipf",))
        cpus = usable_cpus()
        if save_run is not None:
            saved = {
                "quick": quick,
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "cpus": cpus,
                "measured": measured.to_json(),
            }
            save_run.parent.mkdir(parents=True, exist_ok=True)
            save_run.write_text(json.dumps(saved))
            log(f"validation: the real run's measurements written to {save_run}")
    out = validate_measured(measured, w, cpus)
    out["from_run"] = None if from_run is None else str(from_run)
    return out


def validate_measured(
    measured: bench_router.Measured, w: bench_router.Workload, cpus: int
) -> dict[str, Any]:
    """Each repetition of the real run replayed in the simulator, and each router's figures
    compared as the means over the repetitions (one run's p99 on 2 shared cores moved
    0.35-1.2 s at one rate from run to run on 2026-12-03), each repetition's error beside.
    `cpus`: the cores the run had."""
    real = measured.figures["workloads"]["zipf"]
    at_reference = w.rate_factors.index(w.reference_factor)
    contended, stream_s = _cpu_fit(measured, w, cpus)
    lone = _setup(measured, w, _at_speed(contended, stream_s))
    loaded = measured.calibration.get("loaded_path")
    setups = {r: replace(lone, path_s=loaded_path(loaded, r, lone)) for r in ROUTERS}
    catalog = {
        name: AdapterSpec(name, rank, nbytes) for name, (rank, nbytes) in measured.adapters.items()
    }
    per_rep: list[dict[str, dict[str, Any]]] = []
    replays: dict[str, list[tuple[list[SimRequest], int]]] = {r: [] for r in ROUTERS}
    for rep, requests in enumerate(measured.requests):
        at = real["repetitions"][rep]["at_reference"]
        routers = {}
        for router in ROUTERS:
            stream, first = _replay(requests["zipf"], router, at_reference)
            replays[router].append((stream, first))
            bare = simulate_fleet(
                router, stream, catalog, replace(lone, path_s=()), measured_from=first
            )
            run = bare.with_path(setups[router].path_s, lone.seed)
            routers[router] = _side_by_side(at[router], run.summary(), stream_s)
            # the same replay with the lone requests' path, the model before 2026-12-04, and
            # with the loaded path by rank instead of drawn (`ranked_path`)
            alone = bare.with_path(lone.path_s, lone.seed).summary()["p99_ttft_s"]
            ranked = ranked_path(bare.ttft, setups[router].path_s)
            routers[router]["sim_p99_ttft_s_lone_path"] = alone
            routers[router]["sim_p99_ttft_s_ranked_path"] = float(np.percentile(ranked, 99))
            log(f"validation {router}, repetition {rep}: {routers[router]}")
        per_rep.append(routers)
    routers = _mean_over(per_rep)
    for router, figures in routers.items():
        # the same replays with the engines as slow as the real ones were over the windows
        # on average, two ways: the fitted steps slowed and the streamed tokens' charge on
        # top (as if Serve's threads paid it outside the steps), or the whole simulated step,
        # charge included, slowed to the real steps' seconds (as if the steps paid it)
        ratio = _ratio({router: figures}, "step_seconds")
        whole = _ratio({router: figures}, "step_seconds", sim="sim_step_seconds_with_stream")
        speeds = {  # key: (the steps' factor, the charge's factor)
            "sim_p99_ttft_s_at_real_step_speed": (ratio, 1.0),
            "sim_p99_ttft_s_at_real_busy_time": (whole, whole),
        }
        for key, (factor, stream_factor) in speeds.items():
            if factor:
                profile = _at_speed(contended, stream_s, factor, stream_factor)
                slowed = replace(setups[router], profile=profile)
                figures[key] = _mean_p99(router, replays[router], catalog, slowed)
    return {
        "workload": "zipf",
        "rate_rps": real["rates_rps"][at_reference],
        "repetitions": len(per_rep),
        "profile": contended.source,
        "path_latency_s": _spread(lone.path_s),
        # the calibration stream's real TTFTs, and what the path added to the simulated ones
        "loaded_path_ttft_s": None
        if not loaded
        else {
            r: _spread(tuple(x for x in t if x is not None)) for r, t in loaded["ttft_s"].items()
        },
        "loaded_path_latency_s": {r: _spread(s.path_s) for r, s in setups.items()},
        "routers": routers,
        "p99_ttft_error": _error(routers, "p99_ttft_s"),
        "loads_error": _error(routers, "loads"),
        "p99_ttft_error_lone_path": _error(routers, "p99_ttft_s", sim="sim_p99_ttft_s_lone_path"),
        "p99_ttft_error_ranked_path": _error(
            routers, "p99_ttft_s", sim="sim_p99_ttft_s_ranked_path"
        ),
        "p99_ttft_error_by_repetition": [_error(r, "p99_ttft_s") for r in per_rep],
        "loads_error_by_repetition": [_error(r, "loads") for r in per_rep],
        "step_seconds_ratio": _ratio(routers, "step_seconds"),
        "step_seconds_ratio_with_stream": _ratio(
            routers, "step_seconds", sim="sim_step_seconds_with_stream"
        ),
        "p99_ttft_error_at_real_step_speed": _error(
            routers, "p99_ttft_s", sim="sim_p99_ttft_s_at_real_step_speed"
        ),
        "p99_ttft_error_at_real_busy_time": _error(
            routers, "p99_ttft_s", sim="sim_p99_ttft_s_at_real_busy_time"
        ),
        "real": {k: v for k, v in measured.figures.items() if k != "workloads"},
    }


def _side_by_side(real: dict[str, Any], sim: dict[str, Any], stream_s: float) -> dict[str, Any]:
    """One router's figures in one repetition, real (`bench router`'s at the reference
    rate) beside simulated (`FleetRun.summary`)."""
    return {
        "real_p99_ttft_s": real["p99_ttft_s"],
        "sim_p99_ttft_s": sim["p99_ttft_s"],
        "real_p50_ttft_s": real["p50_ttft_s"],
        "sim_p50_ttft_s": sim["p50_ttft_s"],
        "real_loads": real["loads"],
        "sim_loads": sim["device_loads"],
        "real_reads": real["reads"],
        "sim_reads": sim["store_reads"],
        # the engines' forward passes over the window, the simulated ones without and with
        # the streamed tokens' charge they carry on every row: on 2026-12-03 the real steps
        # took 1.07 x the simulated ones with it (they pay it, Serve's threads sharing their
        # process and cores) and 1.88 x without
        "real_steps": real.get("steps"),
        "sim_steps": sim["steps"],
        "real_step_seconds": real.get("step_seconds"),
        "sim_step_seconds": max(0.0, sim["step_seconds"] - stream_s * sim["step_rows"]),
        "sim_step_seconds_with_stream": sim["step_seconds"],
    }


def _mean_p99(
    router: str,
    replays: list[tuple[list[SimRequest], int]],
    catalog: dict[str, AdapterSpec],
    setup: FleetSetup,
) -> float:
    """`router`'s simulated p99 TTFT over `replays` (each repetition's requests), the mean."""
    return float(
        np.mean(
            [
                simulate_fleet(router, stream, catalog, setup, measured_from=first).summary()[
                    "p99_ttft_s"
                ]
                for stream, first in replays
            ]
        )
    )


def _mean_over(per_rep: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each router's figures as the means over the repetitions (a figure a repetition lacks,
    as runs before the engines counted their steps, leaves the mean None)."""
    out: dict[str, dict[str, Any]] = {}
    for router in per_rep[0]:
        figures: dict[str, Any] = {}
        for key in per_rep[0][router]:
            values = [r[router][key] for r in per_rep]
            figures[key] = None if None in values else float(np.mean(values))
        out[router] = figures
    return out


def _spread(samples: tuple[float, ...]) -> dict[str, float] | None:
    if not samples:
        return None
    return {f"p{q}": float(np.percentile(samples, q)) for q in (10, 50, 90, 99)}


def _ratio(routers: dict[str, dict], key: str, sim: str | None = None) -> float | None:
    """The median over routers of real / simulated: for `step_seconds`, how much longer
    the real engines' forward passes took than the profile's over the same window. The
    profile is one engine's steps measured alone, x replicas / cores; a replica on 2 shared
    cores also competes with the driver, Serve's threads and the other replicas' loops,
    and more so the higher the rate (the steps of one run of 2026-12-03 took 8.5 ms at
    3 req/s, 17.8 at 10.2 and 28.0 at 17.9 for 1.0, 1.5 and 2.7 decode rows). The
    simulated figure under `sim` when given."""
    sim = sim or f"sim_{key}"
    ratios = [
        r[f"real_{key}"] / r[sim]
        for r in routers.values()
        if r.get(f"real_{key}") is not None and r.get(sim)
    ]
    return float(np.median(ratios)) if ratios else None


def _error(routers: dict[str, dict], key: str, sim: str | None = None) -> float | None:
    """The mean over routers of |simulated - real| / real for `key` (the simulated figure
    under `sim` when given); routers without both are left out."""
    sim = sim or f"sim_{key}"
    errors = [
        abs(r[sim] - r[f"real_{key}"]) / r[f"real_{key}"]
        for r in routers.values()
        if r[f"real_{key}"] and r.get(sim) is not None
    ]
    return float(np.mean(errors)) if errors else None


def _cpu_fit(
    measured: bench_router.Measured, w: bench_router.Workload, cpus: int | None = None
) -> tuple[LinearProfile, float]:
    """The replicas of `measured`, which ran on `cpus` cores (this machine's when None: the
    validation runs both sides here; a replay takes the published run's): one engine's
    steps measured alone, fitted, each replica's share of the cores applied (the profile,
    its source said), and what Serve adds a streamed token beyond those steps (`_stream_s`:
    the real steps pay most of it, its threads sharing their process and cores)."""
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
    cpus = cpus or usable_cpus()
    shared = max(1.0, w.num_replicas / cpus)  # each replica's steps get a share of the cores
    contended = dataclasses.replace(alone, coef=tuple(c * shared for c in coef))
    steps_only = _burst_capacity(contended, w)
    stream_s = _stream_s(measured, w, steps_only)
    source = (
        f"least squares over {len(measured.calibration['steps'])} engine steps on this "
        f"machine (R² {r2:.2f}), x {shared:.2f} ({w.num_replicas} replicas on {cpus} "
        f"cores), + {stream_s * 1e3:.1f} ms a streamed token: the replicas served "
        f"{measured.calibration['capacity_rps']:.1f} req/s together, their steps alone "
        f"would have served {w.num_replicas * steps_only:.1f}"
    )
    return dataclasses.replace(contended, source=source), stream_s


def cpu_profile(
    measured: bench_router.Measured, w: bench_router.Workload, cpus: int | None = None
) -> LinearProfile:
    """The profile the simulated replicas of `measured` run on (`_cpu_fit`): the fitted
    steps plus the streamed tokens' charge."""
    return _at_speed(*_cpu_fit(measured, w, cpus))


def _at_speed(
    contended: LinearProfile, stream_s: float, factor: float = 1.0, stream_factor: float = 1.0
) -> LinearProfile:
    """`contended`'s steps `factor` x as long, plus `stream_s` x `stream_factor` a row."""
    c0, ct, cc, cl, ca, cr = (c * factor for c in contended.coef)
    return dataclasses.replace(contended, coef=(c0, ct, cc, cl, ca, cr + stream_s * stream_factor))


def _stream_s(
    measured: bench_router.Measured, w: bench_router.Workload, steps_only: float
) -> float:
    """What the steps leave out of the real replicas' time per request, per streamed token:
    Serve's handling of the call and of each streamed chunk, in the replica and the driver
    (on 2 cores at 18 req/s a replica's engine thread was 71% of its CPU; its other threads
    ~19 ms a request, the driver ~21 ms: 2026-12-02). Most of it comes with the chunks,
    after the first token (real p50 TTFT 28 ms at the lowest rate, where this is ~55 ms a
    request): the profile charges it to each step row (a decode row or a prefill chunk; a
    chunk is streamed for each at these rates). `steps_only`: one simulated replica's
    burst capacity on the contended profile (`_cpu_fit`)."""
    per_replica = measured.calibration["capacity_rps"] / w.num_replicas
    out = sum(w.output_tokens) / 2
    return max(0.0, 1.0 / per_replica - 1.0 / steps_only) / out


def path_latency(
    lone_ttft_s: list[float] | None, profile: LinearProfile, w: bench_router.Workload
) -> tuple[float, ...]:
    """What the real path adds to a first token beyond the simulated replica's own time:
    each TTFT of `bench router`'s lone base-model requests through the app on idle replicas
    (`_lone_ttfts`: Ray's handle and actor hops, the client's loop, the replica's threads)
    less the simulated TTFT of the same request alone on the profile; the simulator draws
    one per request. On 2026-12-02 the simulated p50 TTFT at the lowest rate was 14 ms
    against the real 28 ms, and the two routers that read nothing were simulated 40-55%
    low at p99. () for a run that did not measure it (before 2026-12-03)."""
    if not lone_ttft_s:
        return ()
    prompt = sum(w.prompt_tokens) // 2
    alone = simulate([SimRequest(0, 0.0, prompt, 1, 1, None)], profile, _one_replica(w), [], 4096)
    own = alone.summary()["p50_ttft_s"]
    return tuple(max(0.0, t - own) for t in lone_ttft_s)


def loaded_path(loaded: dict[str, Any] | None, router: str, setup: FleetSetup) -> tuple[float, ...]:
    """What the real path adds to a first token at the validated rate, for `router`: the
    TTFTs of `bench router`'s loaded-path calibration (`_loaded_path`: base-model requests
    at the reference rate through the router's app, before the repetitions, so no figure
    validated here is in it) less the simulated TTFTs of the same stream on `setup`,
    quantile by quantile (the i-th shortest real less the i-th shortest simulated), none
    below 0; the simulator draws one per request, as it did the lone requests' (`setup`'s
    path_s, which this replaces where the run measured it). On 2026-12-03 the lone path put
    the simulated p50 TTFT at 24-27 ms against the real 62-102: the path under load (the
    driver's client and handle, Serve's threads, every replica's loop on 2 cores) is not
    the idle path."""
    if not loaded or router not in loaded["ttft_s"]:
        return setup.path_s
    stream = [
        SimRequest(i, arrival, prompt, output, max_tokens, None)
        for i, (arrival, prompt, output, max_tokens) in enumerate(loaded["requests"])
    ]
    sim = simulate_fleet(router, stream, {}, replace(setup, path_s=())).ttft
    served = [i for i, t in enumerate(loaded["ttft_s"][router]) if t is not None]
    if not served:
        return setup.path_s
    real = np.sort([loaded["ttft_s"][router][i] for i in served])
    return tuple(float(d) for d in np.maximum(0.0, real - np.sort(sim[served])))


def ranked_path(ttft: np.ndarray, path: tuple[float, ...]) -> np.ndarray:
    """`ttft` (simulated, without a path) with the path of the same rank added: the request
    at quantile q of the simulated TTFTs gets `path`'s element at q, `loaded_path`'s
    quantile differences in order, so the longest simulated waits get the path of the
    calibration's longest real TTFTs. A variant of the draw per request, reported beside
    it (`p99_ttft_error_ranked_path`): on 2 cores a request that waits in a busy replica
    also meets a busy path (one CPU), which independent draws leave out."""
    if not path or not len(ttft):
        return ttft
    ranks = np.argsort(np.argsort(ttft, kind="stable"), kind="stable")
    at = np.rint(ranks / max(1, len(ttft) - 1) * (len(path) - 1)).astype(int)
    return ttft + np.asarray(path)[at]


def _burst_capacity(profile: LinearProfile, w: bench_router.Workload) -> float:
    """One simulated replica's completions per second on `bench router`'s capacity burst."""
    n = 10 * w.max_num_seqs
    prompt, out = sum(w.prompt_tokens) // 2, sum(w.output_tokens) // 2
    reqs = [SimRequest(i, 0.0, prompt, out, out, None) for i in range(n)]
    return simulate(reqs, profile, _one_replica(w), [], 4096).summary()["throughput_rps"]


def _one_replica(w: bench_router.Workload) -> System:
    """A replica of the bench's batch size with no adapter: the base-model requests above."""
    return System("fifo", SchedulerConfig(max_num_seqs=w.max_num_seqs), CacheConfig())


def _setup(measured: bench_router.Measured, w: bench_router.Workload, profile) -> FleetSetup:
    config = measured.engine_config
    reads = config["artifacts"]
    costs = {k: v for k, v in measured.costs.items()}
    return FleetSetup(
        path_s=path_latency(measured.calibration.get("lone_ttft_s"), profile, w),
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
        # as the real apps ran: runs before it was recorded held 2 x max_num_seqs
        max_ongoing_requests=measured.calibration.get("max_ongoing_requests") or 2 * w.max_num_seqs,
        models_per_replica=w.host_adapters_per_replica,
        stats_period_s=w.routing_stats_period_s,
        max_len=4096,
        seed=w.seed,
    )


def _replay(requests: dict[str, Any], router: str, at: int) -> tuple[list[SimRequest], int]:
    """The real warm-up then the real runs up to the `at`-th (the reference rate's; the
    validation's workload runs that one alone) as one simulated stream, and where that run
    begins in it: each run starting as long after the warm-up's start as it did for `router`
    in the real bench (the other routers' warm-ups ran in between, and the replicas
    finished their reads meanwhile)."""
    stream: list[SimRequest] = list(requests["warm-up"])
    first = len(stream)
    for run, start in zip(requests["runs"][: at + 1], requests["offsets_s"][router], strict=False):
        first = len(stream)
        stream += [
            dataclasses.replace(r, rid=first + i, arrival=start + r.arrival)
            for i, r in enumerate(run)
        ]
    return stream, first


# -- the bench's overload, replayed from its JSON


@dataclass(frozen=True, slots=True)
class BenchLike:
    """The simulator configured like a published `bench router` run, without running it:
    the run's capacity, SLO and router costs from its JSON; the assets and the CPU profile's
    step timings made and measured here (one engine, no Ray), the profile scaled to the
    run's capacity as `validate` scales it."""

    workload: bench_router.Workload
    setup: FleetSetup
    catalog: dict[str, AdapterSpec]
    names: list[str]  # adapter version ids, in catalog order (the bench's walk keys)
    capacity_rps: float  # the run's base-model burst capacity
    slo_s: float
    rate_basis_rps: float  # what its rates are fractions of (the base burst in older runs)


def published_workload(figures: dict[str, Any]) -> bench_router.Workload:
    """The workload a published `bench router` JSON ran: its shape (`--quick` or full) with
    the rate grid it recorded, so a run made before the grid changed replays its own rates
    and seeds (a run's seeds follow its rates' positions in the grid)."""
    w = bench_router.QUICK if figures["quick"] else bench_router.FULL
    ran = figures.get("workload", {})
    if "rate_factors" not in ran:
        return w
    return replace(
        w,
        rate_factors=tuple(ran["rate_factors"]),
        reference_factor=ran.get("reference_factor", w.reference_factor),
    )


def bench_like(figures: dict[str, Any]) -> BenchLike:
    from loraplex.benchmarks.router.assets import TENANT, replica_engine_config, write_assets
    from loraplex.benchmarks.router.costs import measure_router_costs
    from loraplex.registry.artifacts import ArtifactStore
    from loraplex.replica.protocol import adapter_id

    w = published_workload(figures)
    with tempfile.TemporaryDirectory(prefix="loraplex-replay-") as tmp:
        root = Path(tmp)
        model_dir, sources = write_assets(root, w)
        engine_config, sizes = replica_engine_config(model_dir, sources, w)
        _, calibration = measure_router_costs(engine_config, sources, w)
        store = ArtifactStore(root / "artifacts")
        versions = {n: adapter_id(TENANT, n, store.put_dir(p).digest) for n, p in sources.items()}
    calibration["capacity_rps"] = figures["capacity_rps"]
    calibration["lone_ttft_s"] = figures.get("lone_ttft_s")
    calibration["max_ongoing_requests"] = figures.get("max_ongoing_requests")
    adapters = {versions[n]: size for n, size in sizes.items()}
    measured = bench_router.Measured(
        {}, engine_config, figures["router_costs"], calibration, adapters, []
    )
    profile = cpu_profile(measured, w, figures.get("run", {}).get("cpus"))
    setup = _setup(measured, w, profile)
    # as the bench's affinity app: told the costs, replaced by what the replicas measure
    affinity = dataclasses.replace(setup.affinity, use_measured_costs=True)
    return BenchLike(
        w,
        dataclasses.replace(setup, affinity=affinity),
        {n: AdapterSpec(n, rank, nbytes) for n, (rank, nbytes) in adapters.items()},
        list(versions.values()),
        figures["capacity_rps"],
        figures["slo_s"],
        figures.get("rate_basis_rps", figures["capacity_rps"]),
    )


def _bench_stream(
    b: BenchLike,
    workload: str,
    rep: int,
    i: int,
    rate: float,
    basis_rps: float,
    burst: bool = False,
) -> tuple[list[SimRequest], int]:
    """`bench router`'s warm-up (`bench.sweep_warm_up`: each adapter of the catalog once, at its
    lowest rate factor x `basis_rps`) then its run `i` of repetition `rep` at `rate` (its
    own seeds: benchmarks/router/bench.py `_sweep`), the run 5 s after the warm-up's last
    arrival; with `burst` every run request arrives at once. The replay drew its own
    warm-up from the workload's popularity until 2026-12-02, after the bench had stopped
    doing so: ~40 of 120 adapters reached the replayed runs unread, so each simulated run
    paid 37-50 store reads that the real runs (0 at the reference rate) did not."""
    w, index = b.workload, fw.WORKLOADS.index(workload)
    order = 1000 * rep + index
    warm = bench_router.sweep_warm_up(b.names, w.rate_factors[0] * basis_rps, index, rep)
    n = w.burst_requests if burst else w.run_requests(rate, w.window_s)
    run = fw.requests(
        workload,
        b.names,
        n,
        rate,
        fw.Lengths(prompt=w.prompt_tokens, output=w.output_tokens),
        seed=1000 * index + i + 100_000 * rep,
        popularity_seed=order,
    )
    start = max(r.arrival for r in warm) + 5.0
    run = [
        dataclasses.replace(r, rid=len(warm) + j, arrival=start + (0.0 if burst else r.arrival))
        for j, r in enumerate(run)
    ]
    return [*warm, *run], len(warm)


def lora_capacity(b: BenchLike, router: str, workload: str = "zipf", rep: int = 0) -> float:
    """What the simulated replicas serve of the workload's own requests, through `router`:
    `bench router`'s capacity burst (`burst_requests`, all at once) made of the
    workload's adapters and lengths after its warm-up, so it pays their reads, loads and
    adapter segments, where the bench's capacity is measured on base-model requests."""
    capacity = b.capacity_rps  # the bench's LoRA burst follows a warm-up at the base burst's rate
    requests, first = _bench_stream(b, workload, rep, 0, capacity, capacity, burst=True)
    run = simulate_fleet(router, requests, b.catalog, b.setup, measured_from=first)
    finish = run.arrival + run.e2e
    return len(run.ttft) / float(finish.max() - run.arrival.min())


def replay_bench(
    figures: dict[str, Any],
    workloads: tuple[str, ...] = ("zipf", "shift"),
    rate_factors: tuple[float, ...] | None = None,
    repeats: int | None = None,
) -> dict[str, Any]:
    """Every rate of `bench router`'s sweep (or `rate_factors` x its rates' basis), each run
    after its own warm-up, through every router, per repetition (its seeds). Per rate and
    router: p50/p99 TTFT, the share within the SLO, store reads; for affinity also its
    estimate of each request's TTFT on the replica it chose against what the request then
    waited from leaving the router to its first token (`estimate_*`). And the LoRA-workload
    capacity per router beside the rates' basis."""
    b = bench_like(figures)
    w = b.workload
    factors = rate_factors or w.rate_factors
    capacity = {router: lora_capacity(b, router) for router in ROUTERS}
    out: dict[str, Any] = {
        "capacity_rps": b.capacity_rps,
        "rate_basis_rps": b.rate_basis_rps,
        "lora_capacity_rps": capacity,
        "rate_factors": list(factors),
        "rates_over_lora_capacity": {
            router: [f * b.rate_basis_rps / c for f in factors] for router, c in capacity.items()
        },
        "profile": b.setup.profile.source,
        "path_latency_s": _spread(b.setup.path_s),
        "workloads": {},
    }
    for workload in workloads:
        per: dict[str, Any] = {}
        for rep in range(repeats or w.repeats):
            for i, factor in enumerate(factors):
                rate = factor * b.rate_basis_rps
                requests, first = _bench_stream(b, workload, rep, i, rate, b.rate_basis_rps)
                setup = dataclasses.replace(b.setup, seed=w.seed + rep)
                for router in ROUTERS:
                    run = simulate_fleet(router, requests, b.catalog, setup, measured_from=first)
                    row = per.setdefault(router, {}).setdefault(str(factor), [])
                    row.append(_replayed(run, b.slo_s))
        out["workloads"][workload] = per
        for router, rates in per.items():
            for factor, rows in rates.items():
                log(f"replay {workload} {factor} x capacity {router}: {rows}")
    return out


def _replayed(run: Any, slo_s: float) -> dict[str, Any]:
    figures = {
        "p50_ttft_s": float(np.percentile(run.ttft, 50)),
        "p99_ttft_s": float(np.percentile(run.ttft, 99)),
        "within_slo": float(np.mean(run.ttft <= slo_s)),
        "reads": run.counters["store_reads"],
    }
    if not np.isnan(run.estimated_ttft).all():
        at_replica = run.ttft - (run.routed_at - run.arrival)
        figures["estimate_p50_s"] = float(np.median(run.estimated_ttft))
        figures["at_replica_p50_s"] = float(np.median(at_replica))
        figures["estimate_error_p50_s"] = float(np.median(np.abs(run.estimated_ttft - at_replica)))
    return figures


def main(argv: list[str] | None = None) -> None:
    """python -m loraplex.benchmarks.fleet.validation ROUTER_JSON [--factors 0.35,0.7,0.9]
    [--repeats N] [--json OUT]: `replay_bench` on a published `bench router` JSON."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("figures", type=Path)
    parser.add_argument("--factors", help="rates as fractions of the run's rate basis")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--workloads", default="zipf,shift")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    factors = tuple(float(f) for f in args.factors.split(",")) if args.factors else None
    out = replay_bench(
        json.loads(args.figures.read_text()),
        tuple(args.workloads.split(",")),
        factors,
        args.repeats,
    )
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
