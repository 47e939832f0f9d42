"""The simulator section of `loraplex bench sched`: seed 004's experiment, every system on the
same arrivals, over several arrival seeds.

Per seed: every system at every load of the grid, then each system past the grid until its
P99 TTFT crosses the SLO (benchmarks/sched/sweep.py); the SLO is 5x the mean execution time
of `slora` (the paper's baseline) at the lowest load; a system's throughput at SLO is its
sustainable capacity (`_capacity`), the load at which its P99 TTFT crosses the SLO is kept
beside it. The paper's low, medium and high loads (6, 8 and 9 RPS against S-LoRA's SLO
crossing at 8.6 RPS, §5.2) are taken relative to this seed's `slora` capacity, and `slora`
and the systems compared with it run there. Keys are
computed per seed and reported as their mean, with the spread over seeds beside them.
The existing keys (`p99_ttft_reduction_high_load`, ...) are the ablation against our own
FIFO: `loraplex` (Chameleon's queues and cache on loraplex's engine) against
`fifo_nocache` at the first swept load where its P99 TTFT misses the SLO.
"""

from __future__ import annotations

import math
import multiprocessing
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from loraplex.benchmarks.report import log
from loraplex.benchmarks.sched.scenarios import Scenario, scenario_requests, shape_trace
from loraplex.benchmarks.sched.sweep import (
    EXTEND_AT,
    OPERATING_POINTS,
    extend_past_crossing,
    largest_reduction,
    loads_of,
    mean_curve,
    operating_loads,
    reduction_curve,
    with_ranks,
)
from loraplex.benchmarks.sched.systems import (
    BREAKDOWN,
    GUARDED,
    SIM_SYSTEMS,
    SLORA,
    TAIL,
    systems,
)
from loraplex.benchmarks.sim.profiles import a40_llama7b
from loraplex.benchmarks.sim.replica import System
from loraplex.benchmarks.sim.run import Result, simulate
from loraplex.benchmarks.sim.workload import Trace, paper_adapters, read_trace, replay_requests

# seed 004 §5.2: loads as multiples of the load at which S-LoRA crosses the SLO (8.6 RPS)
PAPER_LOADS = {"low": 6 / 8.6, "medium": 8 / 8.6, "high": 9 / 8.6}
# Chameleon against S-LoRA, seed 004 §5.2 (Figs. 11 and 13)
PAPER = {
    "p99_ttft_reduction_high_load": 0.807,
    "p50_ttft_reduction_high_load": 0.481,
    "throughput_at_slo_ratio": 1.5,
    "p99_ttft_reduction_medium_load": 0.246,
    "p50_ttft_reduction_medium_load": 0.209,
    "p99_ttft_reduction_low_load": 0.147,
    "p50_ttft_reduction_low_load": 0.139,
}
AGAINST_SLORA = {"vs_slora": "chameleon", "loraplex_vs_slora": "loraplex"}
# Sustainable capacity: the steady completion rate of a run CAPACITY_RUN x the shape's
# requests long that the system cannot keep up with (`_capacity`).
OVERLOAD = 2.0
CAPACITY_RUN = 4
ESTIMATE_LOAD = 2.0
KEPT_UP = 0.9
CAPACITY_TRIES = 4
# what loraplex's engine alone is worth against slora (FIFO, no cache, like S-LoRA)
ABLATION = ("fifo_nocache",)
# against slora too: Chameleon with the starvation guard, and with quotas for the P99,
# neither in the paper
REPORTED = (*AGAINST_SLORA.values(), GUARDED, TAIL, *BREAKDOWN, *ABLATION)


@dataclass(frozen=True, slots=True)
class SimShape:
    requests: int  # per load and seed
    load_factors: tuple[float, ...]  # x the trace's mean arrival rate
    scale_minutes: float  # trace minutes replayed to find the length scale
    seeds: int = 5  # arrival draws
    systems: tuple[str, ...] = SIM_SYSTEMS
    extras: bool = False  # eviction scores, the starvation guard at SLO/4, N replicas


QUICK = SimShape(
    requests=500,
    load_factors=(0.25, 0.6, 0.8, 0.9, 1.0, 1.1, 1.25, 1.45, 1.7),
    scale_minutes=3,
    seeds=2,
)
FULL = SimShape(
    requests=1200,
    load_factors=(0.25, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0, 1.1, 1.2, 1.3, 1.4, 1.55, 1.7),
    scale_minutes=10,
    extras=True,
)
# other trace shapes: the systems the new keys compare, fewer seeds
SHAPE_SYSTEMS = ("slora", "fifo_nocache", "chameleon", "loraplex")


def shape_of(shape: SimShape, quick: bool) -> SimShape:
    """The smaller sweep that checks a trace shape the systems were not tuned on."""
    if quick:
        return replace(shape, requests=300, seeds=1, systems=SHAPE_SYSTEMS, extras=False)
    return replace(shape, requests=1000, seeds=3, systems=SHAPE_SYSTEMS, extras=False)


def sim_section(
    shape: SimShape, trace_path: Path | None, scenario: Scenario, jobs: int = 1
) -> dict:
    """The section's figures; `jobs` processes run the independent simulations."""
    profile = a40_llama7b()
    trace = shape_trace(read_trace(trace_path), scenario)
    adapters = paper_adapters(100, profile.adapter_bytes)
    max_len = profile.model["max_position_embeddings"]
    rate = len(trace.timestamps) / float(trace.timestamps[-1] - trace.timestamps[0])
    tag = f"sim[{scenario.name}]"
    log(f"{tag}: trace {trace.source} ({len(trace.timestamps)} requests, {rate:.2f} req/s)")
    slot = profile.kv_bytes_per_token()
    device_slots = profile.pool_bytes // slot
    pool = scenario.slora_pool or device_slots
    scale = memory_scale(trace, replace(profile, pool_bytes=pool * slot), adapters, shape, max_len)
    slora_cfg = replace(SLORA, max_total_token_num=scenario.slora_pool)
    # Chameleon on S-LoRA: the same token pool, its adapter cache in the rest of the device
    cham_cfg = replace(slora_cfg, pool_size_lora=device_slots - pool)
    log(f"{tag}: S-LoRA's token pool {pool} slots (the device's: {device_slots})")
    log(f"{tag}: lengths x {scale:.3f} (peak memory of the trace replay = the pool)")
    seeds = list(range(shape.seeds))

    def run(
        system: System,
        load_rps: float,
        seed: int,
        n: int = 0,
        replicas: int = 1,
        cost=None,
        arrivals: Scenario = scenario,
    ) -> Result:
        reqs = scenario_requests(
            arrivals, trace, adapters, load_rps, n or shape.requests, scale, max_len, seed
        )
        return simulate(reqs, cost or profile, system, adapters, max_len, replicas=replicas)

    loads = [f"{f * rate:.2f}" for f in shape.load_factors]
    # the SLO: 5x the mean execution time of slora at the lowest load, Poisson arrivals
    # (a low-load system, whatever the scenario's burstiness)
    base = systems(1.0, slora=slora_cfg)["slora"]
    poisson = replace(scenario, cv=1.0)
    lowest = {seed: run(base, float(loads[0]), seed, arrivals=poisson) for seed in seeds}
    slo = 5.0 * float(np.mean(np.concatenate([r.e2e for r in lowest.values()])))
    log(f"{tag}: SLO = 5 x mean slora execution at {loads[0]} req/s = {slo:.2f} s")
    by_system = systems(slo, slora=slora_cfg, run_requests=shape.requests, chameleon_slora=cham_cfg)
    _CONTEXT.update(run=run, by_system=by_system, profile=profile)
    curves: dict[str, dict[int, dict[str, dict]]] = {
        n: {s: {} for s in seeds} for n in shape.systems
    }
    sweep = [(n, float(load), seed) for seed in seeds for load in loads for n in shape.systems]
    if scenario.cv == 1.0:  # the SLO's runs are the sweep's lowest slora points
        sweep = [t for t in sweep if not (t[0] == "slora" and t[1] == float(loads[0]))]
        for seed in seeds:
            curves["slora"][seed][loads[0]] = with_ranks(lowest[seed])
    for (name, load, seed), summary in _run_all(sweep, jobs).items():
        curves[name][seed][f"{load:.2f}"] = summary
    for seed in seeds:
        for load in loads:
            log(
                f"{tag}: seed {seed} {load} req/s  p99 TTFT "
                + "  ".join(f"{n} {curves[n][seed][load]['p99_ttft_s']:.2f}" for n in shape.systems)
            )
    capacity = _capacity(shape, rate, seeds, jobs)
    mean_capacity = {n: float(np.mean([capacity[s][n] for s in seeds])) for n in shape.systems}
    log(
        f"{tag}: sustainable capacity (runs of {CAPACITY_RUN * shape.requests} requests it "
        "cannot keep up with; mean over seeds): "
        + "  ".join(f"{n} {mean_capacity[n]:.2f}" for n in shape.systems)
    )
    extended = extend_past_crossing(curves, slo, mean_capacity, lambda tasks: _run_all(tasks, jobs))
    for name, added in extended.items():
        if added:
            log(
                f"{tag}: {name} past the grid (x its capacity {EXTEND_AT}): p99 TTFT "
                + "  ".join(
                    f"{x:.2f} req/s {np.mean([curves[name][s][f'{x:.2f}']['p99_ttft_s'] for s in seeds]):.2f}"
                    for x in added
                )
            )
    rows = {seed: {n: curves[n][seed] for n in shape.systems} for seed in seeds}
    at_loads = {seed: _paper_loads(capacity[seed]) for seed in seeds}
    others = [n for n in ("slora", *REPORTED) if n in shape.systems]
    tasks = [(n, load, seed) for seed in seeds for load in at_loads[seed].values() for n in others]
    tasks += [
        (n, load, seed)
        for seed in seeds
        for name in AGAINST_SLORA.values()
        if name in shape.systems
        for load in operating_loads(capacity[seed], name).values()
        for n in ("slora", name)
    ]
    paper_runs = _run_all(list(dict.fromkeys(tasks)), jobs)
    per_seed = [
        _seed_keys(
            rows[seed],
            loads,
            slo,
            lambda name, load, s=seed: paper_runs[(name, load, s)],
            capacity[seed],
        )
        for seed in seeds
    ]
    out = {
        "scenario": scenario.name,
        "scenario_description": scenario.description,
        "profile": profile.name,
        "profile_source": profile.source,
        "trace": trace.source,
        "length_scale": scale,
        "slora_pool_slots": pool,
        "device_pool_slots": device_slots,
        "adapters": len(adapters),
        "requests_per_load": shape.requests,
        "seeds": len(seeds),
        "slo_s": slo,
        "loads_rps": [float(k) for k in loads],
        "extend_at_capacity": list(EXTEND_AT),
        "extended_loads_rps": extended,
        "systems": _mean_curves(curves),
        **_combine(per_seed),
    }
    if shape.extras:
        out["extras"] = _extras(run, by_system, slo, loads, out["high_load_rps"], shape.requests)
        out["extras"]["slower_link"] = _slower_link(
            profile, out["paper_loads_rps"]["high"], seeds, jobs
        )
    return out


_CONTEXT: dict = {}  # what forked workers run with: `run` and `by_system`


def _work(task: tuple[str, float, int]) -> tuple[tuple[str, float, int], dict]:
    name, load, seed = task
    return task, with_ranks(_CONTEXT["run"](_CONTEXT["by_system"][name], load, seed))


def _capacity(shape: SimShape, rate: float, seeds: list[int], jobs: int) -> dict:
    """seed -> system -> sustainable capacity: the steady completion rate (in requests of
    the run's mix) of a run of CAPACITY_RUN x the shape's requests that the system cannot
    keep up with. The first run is at ESTIMATE_LOAD x the trace's rate; a run that completes
    more than KEPT_UP of its arrival rate was not overloaded, and is run again at OVERLOAD x
    its rate (at most CAPACITY_TRIES times; the last run's rate is kept)."""
    n_long = CAPACITY_RUN * shape.requests
    load = {(n, seed): ESTIMATE_LOAD * rate for seed in seeds for n in shape.systems}
    out: dict = {seed: {} for seed in seeds}
    for _ in range(CAPACITY_TRIES):
        runs = _run_all([(n, x, seed, n_long) for (n, seed), x in load.items()], jobs, _work_n)
        again = {}
        for (n, seed), x in load.items():
            out[seed][n] = steady = _steady(runs[(n, x, seed, n_long)])
            if steady > KEPT_UP * x:
                again[(n, seed)] = OVERLOAD * x
        if not again:
            break
        load = again
    return out


def _steady(summary: dict) -> float:
    """A run's steady completion rate; its mean rate if the run is too short to have one."""
    steady = summary["steady_mix_rps"]
    return steady if math.isfinite(steady) and steady > 0 else summary["throughput_rps"]


def _work_n(task: tuple[str, float, int, int]) -> tuple[tuple[str, float, int, int], dict]:
    """`_work` with `n` arrivals."""
    name, load, seed, n = task
    return task, _CONTEXT["run"](_CONTEXT["by_system"][name], load, seed, n=n).summary()


def _work_link(task: tuple[str, float, int, int]) -> tuple[tuple[str, float, int, int], dict]:
    """`_work` with the host link `factor` times slower than the profile's."""
    name, load, seed, factor = task
    profile = _CONTEXT["profile"]
    cost = replace(profile, link_bytes_per_s=profile.link_bytes_per_s / factor)
    return task, _CONTEXT["run"](_CONTEXT["by_system"][name], load, seed, cost=cost).summary()


def _run_all(tasks: list, jobs: int, work=_work) -> dict:
    """task -> summary (a task: (system, load, seed), as `work` takes it); in `jobs` forked
    processes when jobs > 1."""
    if jobs <= 1 or len(tasks) < 2:
        return dict(work(t) for t in tasks)
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return dict(pool.imap_unordered(work, tasks))


def _paper_loads(capacity: dict[str, float]) -> dict:
    """Seed 004 §5.2's loads relative to slora's throughput at SLO (8.6 RPS in the paper),
    taken as its sustainable capacity."""
    return {level: f * capacity["slora"] for level, f in PAPER_LOADS.items()}


def _seed_keys(
    rows: dict[str, dict[str, dict]], loads: list[str], slo: float, run, capacity: dict
) -> dict:
    """One seed's keys from its curves (each system's: the grid `loads` and its points past
    it); `run(name, load_rps)` runs a system at a load; `capacity` is each system's
    sustainable capacity (the steady completion rate under overload, in requests of the
    run's mix): its throughput at SLO. The load at which a run's P99 TTFT crosses the SLO
    (`crossing_rps`) moves with the run's length above capacity — a backlog grows with the
    run — and is kept for reference, with its ratio to capacity."""
    keys: dict = {}
    own = {name: loads_of(rows[name]) for name in rows}
    crossing = {name: throughput_at_slo(own[name], rows[name], slo) for name in rows}
    keys["crossing_rps"] = crossing
    tput = {name: capacity[name] for name in rows}
    keys["throughput_at_slo_rps"] = tput
    keys["crossing_over_capacity"] = {name: _ratio(crossing[name], tput[name]) for name in rows}
    # a system still within the SLO at its top load, past the cap: its crossing is a lower
    # bound
    keys["slo_not_crossed"] = [n for n in rows if rows[n][own[n][-1]]["p99_ttft_s"] <= slo]
    if "fifo_nocache" in rows and "loraplex" in rows:
        # the ablation against our own FIFO: Chameleon's mechanisms on loraplex's engine
        base_p99 = [rows["fifo_nocache"][k]["p99_ttft_s"] for k in loads]
        high = next((k for k, p in zip(loads, base_p99, strict=True) if p > slo), loads[-1])
        base, ours = rows["fifo_nocache"][high], rows["loraplex"][high]
        keys["high_load_rps"] = float(high)
        keys["p99_ttft_reduction_high_load"] = 1 - ours["p99_ttft_s"] / base["p99_ttft_s"]
        keys["p50_ttft_reduction_high_load"] = 1 - ours["p50_ttft_s"] / base["p50_ttft_s"]
        keys["throughput_at_slo_ratio"] = _ratio(tput["loraplex"], tput["fifo_nocache"])
    paper_loads = _paper_loads(capacity)
    keys["paper_loads_rps"] = paper_loads
    keys["paper_loads_over_capacity"] = {
        level: {name: load / tput[name] for name in rows} for level, load in paper_loads.items()
    }
    others = [n for n in REPORTED if n in rows]
    at = {
        level: {name: run(name, load) for name in ("slora", *others)}
        for level, load in paper_loads.items()
    }
    keys["at_paper_loads"] = at
    against = {}
    curves = {}
    for name in others:
        # on the grid and at the paper's loads, where both ran on the same arrivals
        points = [("grid", float(k), rows["slora"][k], rows[name][k]) for k in loads]
        points += [(lv, x, at[lv]["slora"], at[lv][name]) for lv, x in paper_loads.items()]
        if name in AGAINST_SLORA.values():
            own = operating_loads(capacity, name)
            points += [(lb, x, run("slora", x), run(name, x)) for lb, x in own.items()]
        curves[name] = reduction_curve(points, name, capacity)
        against[name] = {
            "throughput_at_slo_ratio": _ratio(tput[name], tput["slora"]),
            "crossing_ratio": _ratio(crossing[name], crossing["slora"]),
            **largest_reduction(curves[name]),
        }
        for point in curves[name]:
            if point["at"] in (*PAPER_LOADS, *OPERATING_POINTS):
                against[name] |= _at_point(point)
    for key, name in AGAINST_SLORA.items():
        keys[key] = against[name]
    keys["against_slora"] = against
    keys["reduction_curves"] = curves
    return keys


def _at_point(point: dict) -> dict[str, float]:
    """A labelled point of a reduction curve as keys: its P99 and P50 TTFT reductions and
    its operating point (the load, and the load / each system's capacity)."""
    at = point["at"]
    return {
        f"p99_ttft_reduction_{at}_load": point["p99_ttft_reduction"],
        f"p50_ttft_reduction_{at}_load": point["p50_ttft_reduction"],
        f"{at}_load_rps": point["load_rps"],
        f"{at}_load_over_capacity": point["load_over_capacity"],
        f"{at}_load_over_slora_capacity": point["load_over_slora_capacity"],
    }


def _combine(per_seed: list[dict]) -> dict:
    """Means over seeds, with each key's spread (std, min, max, every seed's value)."""
    out: dict = {}
    spread: dict = {}
    scalar = [k for k, v in per_seed[0].items() if isinstance(v, float)]
    for key in scalar:
        values = [s[key] for s in per_seed]
        out[key] = float(np.mean(values))
        spread[key] = _spread(values)
    for key in AGAINST_SLORA:
        out[key] = {}
        for sub in per_seed[0][key]:
            values = [s[key][sub] for s in per_seed]
            out[key][sub] = float(np.mean(values))
            spread[f"{key}.{sub}"] = _spread(values)
    out["against_slora"] = {
        name: {
            sub: float(np.mean([s["against_slora"][name][sub] for s in per_seed])) for sub in subs
        }
        for name, subs in per_seed[0]["against_slora"].items()
    }
    names = per_seed[0]["throughput_at_slo_rps"]
    out["slo_not_crossed"] = sorted({n for s in per_seed for n in s["slo_not_crossed"]})
    out["throughput_at_slo_rps"] = {
        n: float(np.mean([s["throughput_at_slo_rps"][n] for s in per_seed])) for n in names
    }
    for key in ("crossing_rps", "crossing_over_capacity"):
        out[key] = {n: float(np.mean([s[key][n] for s in per_seed])) for n in names}
        for n in names:
            spread[f"{key}.{n}"] = _spread([s[key][n] for s in per_seed])
    out["reduction_curves"] = {
        name: mean_curve([s["reduction_curves"][name] for s in per_seed])
        for name in per_seed[0]["reduction_curves"]
    }
    for n in names:
        spread[f"throughput_at_slo_rps.{n}"] = _spread(
            [s["throughput_at_slo_rps"][n] for s in per_seed]
        )
    out["paper_loads_over_capacity"] = {
        level: {
            n: float(np.mean([s["paper_loads_over_capacity"][level][n] for s in per_seed]))
            for n in names
        }
        for level in PAPER_LOADS
    }
    out["paper_loads_rps"] = {
        level: float(np.mean([s["paper_loads_rps"][level] for s in per_seed]))
        for level in PAPER_LOADS
    }
    out["at_paper_loads"] = {
        level: {
            name: {
                f: float(np.mean([s["at_paper_loads"][level][name][f] for s in per_seed]))
                for f in (
                    "p50_ttft_s",
                    "p99_ttft_s",
                    "throughput_rps",
                    "hit_rate",
                    "gb_loaded",
                    "link_busy",
                    "p99_tbt_s",
                    "critical_loads",
                    "critical_wait_ms",
                    "mean_load_ms",
                    *(k for k in per_seed[0]["at_paper_loads"][level][name] if "_rank" in k),
                )
            }
            for name in per_seed[0]["at_paper_loads"][level]
        }
        for level in PAPER_LOADS
    }
    out["spread"] = spread
    out["paper"] = PAPER
    return out


def _spread(values: list[float]) -> dict:
    return {
        "std": float(np.std(values)),
        "min": float(np.min(values)),
        "max": float(np.max(values)),
        "per_seed": [float(v) for v in values],
    }


def _mean_curves(curves: dict) -> dict:
    """Per system and load (its own: the grid and its points past it): each summary
    figure's mean over seeds, and the P99's range."""
    out: dict = {}
    for name, by_seed in curves.items():
        out[name] = {}
        for load in loads_of(next(iter(by_seed.values()))):
            rows = [by_seed[s][load] for s in by_seed]
            mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
            p99 = [r["p99_ttft_s"] for r in rows]
            mean["p99_ttft_s_min"], mean["p99_ttft_s_max"] = float(min(p99)), float(max(p99))
            out[name][load] = mean
    return out


def _extras(run, by_system, slo, loads, high, requests) -> dict:
    """Beyond the paper's main figure, on seed 0 and loraplex's engine: eviction scores under
    the Chameleon scheduler at the load before the high one (the cache matters most while memory is not
    yet all KV); the starvation guard at SLO/4 instead of the SLO, at that load and the
    high one; and N = 4 replicas with adapter-affinity dispatch at 4x the high load."""
    high_key = f"{high:.2f}" if f"{high:.2f}" in loads else loads[-1]
    i = loads.index(high_key)
    medium = loads[max(0, i - 1)]
    eviction = {}
    for policy in ("chameleon", "lru", "gdsf", "equal"):
        base = by_system["loraplex"]
        system = replace(base, name=policy, cache=replace(base.cache, eviction=policy))
        eviction[policy] = run(system, float(medium), 0).summary()
    log(
        f"sim: eviction at {medium} req/s: "
        + "  ".join(
            f"{k} p99 {v['p99_ttft_s']:.2f} hit {v['hit_rate']:.2f}" for k, v in eviction.items()
        )
    )
    base = by_system["loraplex"]
    quarter = replace(base.scheduler.chameleon, starve_s=slo / 4)
    early = replace(
        base, name="chameleon_starve_slo4", scheduler=replace(base.scheduler, chameleon=quarter)
    )
    starve = {k: run(early, float(k), 0).summary() for k in (medium, high_key)}
    log(
        "sim: starvation guard at SLO/4: "
        + "  ".join(
            f"{k} req/s p50 {v['p50_ttft_s']:.2f} p99 {v['p99_ttft_s']:.2f}"
            for k, v in starve.items()
        )
    )
    rate = 4 * float(high_key)
    replicas = {
        name: run(by_system[name], rate, 0, n=4 * requests, replicas=4).summary()
        for name in ("fifo_nocache", "loraplex")
    }
    log(
        f"sim: 4 replicas at {rate:.2f} req/s: "
        + "  ".join(f"{k} p99 {v['p99_ttft_s']:.2f}" for k, v in replicas.items())
    )
    return {
        "eviction_at_rps": float(medium),
        "eviction": eviction,
        "chameleon_starve_slo4": starve,
        "replicas_4_at_rps": rate,
        "replicas_4": replicas,
    }


# the cache's worth with the link as the bottleneck: S-LoRA, and Chameleon on it; FIFO on
# loraplex's engine without and with the cache (the cache alone), and loraplex
SLOWER_LINK_SYSTEMS = ("slora", "chameleon", "fifo_nocache", "fifo_cache", "loraplex")
SLOWER_LINK_FIELDS = (
    "p50_ttft_s",
    "p99_ttft_s",
    "throughput_rps",
    "gb_loaded",
    "link_busy",
    "hit_rate",
    "mean_load_ms",
)


def _slower_link(profile, high: float, seeds: list[int], jobs: int) -> dict:
    """The ablation of the cache's worth: the paper's high load (the mean over seeds) with
    the host link 1x, 4x and 16x slower than the profile's, where loads take a larger share
    of the critical path; each figure the mean over the arrival seeds, the P99's range
    beside it."""
    factors = (1, 4, 16)
    tasks = [(n, high, s, f) for f in factors for n in SLOWER_LINK_SYSTEMS for s in seeds]
    runs = _run_all(tasks, jobs, _work_link)
    out: dict = {"at_rps": high, "seeds": len(seeds)}
    for factor in factors:
        rows = {}
        for name in SLOWER_LINK_SYSTEMS:
            per_seed = [runs[(name, high, s, factor)] for s in seeds]
            row = {k: float(np.mean([r[k] for r in per_seed])) for k in SLOWER_LINK_FIELDS}
            p99 = [r["p99_ttft_s"] for r in per_seed]
            row["p99_ttft_s_min"], row["p99_ttft_s_max"] = float(min(p99)), float(max(p99))
            rows[name] = row
        out[f"link_div_{factor}"] = rows
        log(
            f"sim: link / {factor} at {high:.2f} req/s: "
            + "  ".join(
                f"{n} p99 {r['p99_ttft_s']:.2f} link {r['link_busy']:.3f}" for n, r in rows.items()
            )
        )
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def throughput_at_slo(loads: list[str], rows: dict[str, dict], slo: float) -> float:
    """The load at which P99 TTFT crosses the SLO, linear between the swept loads around
    the first crossing; the highest load if it never does (a lower bound: the section
    lists such systems in `slo_not_crossed`), 0 if even the lowest misses."""
    xs = [float(k) for k in loads]
    ys = [rows[k]["p99_ttft_s"] for k in loads]
    if ys[0] > slo:
        return 0.0
    for i in range(1, len(xs)):
        if ys[i] > slo:
            return xs[i - 1] + (slo - ys[i - 1]) / (ys[i] - ys[i - 1]) * (xs[i] - xs[i - 1])
    return xs[-1]


def memory_scale(trace: Trace, profile, adapters, shape: SimShape, max_len: int) -> float:
    """The paper's length scaling (seed 004 §3.2, §5.1): the constant factor for which the
    trace, replayed at its own timestamps on FIFO without a cache, peaks at the pool's
    capacity: the smallest factor (bisection, 1% steps) whose peak memory in use (KV +
    pinned adapters) reaches 95%, at most the factor at which the longest request alone
    takes 90% of the pool."""
    n = int((trace.timestamps < shape.scale_minutes * 60).sum())
    base = systems(1.0)["fifo_nocache"]

    def peak(scale: float) -> float:
        reqs = replay_requests(trace, adapters, n, 1.0, scale, 4096)
        return simulate(reqs, profile, base, adapters, max_len).peak_memory_fraction

    # no larger than the scale at which the longest request alone fills 90% of the pool
    # (a request the pool cannot hold would never run)
    longest = max(r.prompt + r.output for r in replay_requests(trace, adapters, n, 1.0, 1.0, 4096))
    lo, hi = 0.0, min(1.0, 0.9 * (profile.pool_bytes // profile.kv_bytes_per_token()) / longest)
    if peak(hi) < 0.95:
        return hi
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        if peak(mid) >= 0.95:
            hi = mid
        else:
            lo = mid
    return hi
