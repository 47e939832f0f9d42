"""`loraplex bench sched`: adapter caching and scheduling — Chameleon's experiment (seed 004
§5) reproduced against S-LoRA as S-LoRA's code does it, and what loraplex adds on top.

Simulator section (benchmarks/sched/sim.py): the systems of benchmarks/sched/systems.py on
the same arrivals, swept over loads and arrival seeds, in a scenario of
benchmarks/sched/scenarios.py (`--scenario`, default `paper`: seed 004 §5.1's setup), then
the same keys on the other trace shapes. Any Azure-format trace can drive it (`--trace`).

Engine section (benchmarks/sched/engine.py): the real engine on this CPU, the same systems
at one high load, open-loop arrivals in engine time.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from loraplex.benchmarks.engine.bench import DEFAULT_TRACE
from loraplex.benchmarks.report import log, write_json
from loraplex.benchmarks.sched import engine as sched_engine
from loraplex.benchmarks.sched import sim as sim_sim
from loraplex.benchmarks.sched.engine import EngineShape
from loraplex.benchmarks.sched.scenarios import SCENARIOS, Scenario
from loraplex.benchmarks.sched.sim import AGAINST_SLORA as AGAINST
from loraplex.benchmarks.sched.sim import PAPER, SimShape, shape_of, sim_section
from loraplex.benchmarks.sched.sweep import OPERATING_POINTS

TARGETS = {
    "vs_slora.p99_ttft_reduction_high_load": "within 25% of 0.807",
    "vs_slora.p50_ttft_reduction_high_load": "within 25% of 0.481",
    "vs_slora.throughput_at_slo_ratio": "within 25% of 1.5",
    "loraplex_vs_slora.p99_ttft_reduction_high_load": ">= 0.8",
    "loraplex_vs_slora.p50_ttft_reduction_high_load": "",
    "loraplex_vs_slora.throughput_at_slo_ratio": ">= 1.5",
    "p99_ttft_reduction_high_load": ">= 0.8 (loraplex vs fifo_nocache)",
    "p50_ttft_reduction_high_load": ">= 0.48 (loraplex vs fifo_nocache)",
    "throughput_at_slo_ratio": ">= 1.5 (loraplex vs fifo_nocache)",
}
NEW_KEYS = (
    "p99_ttft_reduction_high_load",
    "p50_ttft_reduction_high_load",
    "throughput_at_slo_ratio",
)
# beside the headline in each group against slora: the high load's operating point, and
# the reductions at the OPERATING_POINTS loads with theirs
OPERATING_KEYS = tuple(
    key
    for at in ("high", *OPERATING_POINTS)
    for key in (
        *(f"{q}_ttft_reduction_{at}_load" for q in ("p99", "p50") if at != "high"),
        f"{at}_load_rps",
        f"{at}_load_over_capacity",
        f"{at}_load_over_slora_capacity",
    )
)


@dataclass(frozen=True, slots=True)
class BenchShape:
    sim: SimShape  # the main scenario
    shapes: SimShape  # each other trace shape
    engine: EngineShape


QUICK_BENCH = BenchShape(sim_sim.QUICK, shape_of(sim_sim.QUICK, True), sched_engine.QUICK)
FULL_BENCH = BenchShape(sim_sim.FULL, shape_of(sim_sim.FULL, False), sched_engine.FULL)


def run_bench(args: argparse.Namespace) -> int:
    # one intra-op thread: the engine section's model is small, and the machine is shared
    torch.set_num_threads(1)
    start = time.perf_counter()
    bench = QUICK_BENCH if args.quick else FULL_BENCH
    if args.seeds is not None:
        bench = with_seeds(bench, args.seeds)
    scenario = SCENARIOS[args.scenario]
    results = {"quick": bool(args.quick)}
    if args.section == "engine":
        results |= engine_keys(sched_engine.engine_section(bench.engine))
        show = print_engine
    else:
        trace = args.trace or DEFAULT_TRACE
        results |= collect(bench, trace, scenario, not args.sim_only, args.plot, args.jobs)
        show = print_table
    results["seconds"] = time.perf_counter() - start
    show(results)
    write_json(args.json, results)
    return 0


def engine_keys(section: dict) -> dict:
    """The engine section's part of the bench's figures."""
    return {
        "engine": section,
        "engine_p99_ttft_reduction": section["p99_ttft_reduction"],
        "engine_p99_ttft_reduction_guard": section["guard"]["p99_ttft_reduction"],
    }


def with_seeds(bench: BenchShape, seeds: int) -> BenchShape:
    """`bench` with `seeds` arrival draws in the main scenario, at most as many in the
    trace shapes (a run cut to fit the time it has: the JSON's command says so)."""
    if seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {seeds}")
    return replace(
        bench,
        sim=replace(bench.sim, seeds=seeds),
        shapes=replace(bench.shapes, seeds=min(seeds, bench.shapes.seeds)),
    )


def collect(
    bench: BenchShape,
    trace: Path | None,
    scenario: Scenario,
    engine: bool,
    plot: Path | None,
    jobs: int = 1,
) -> dict:
    results: dict = {}
    results["sim"] = sim = sim_section(bench.sim, trace, scenario, jobs)
    for key in NEW_KEYS:
        results[key] = sim[key]
    for group in AGAINST:
        results[group] = {k: sim[group][k] for k in (*NEW_KEYS, *OPERATING_KEYS)}
    results["shapes"] = {}
    for name, other in SCENARIOS.items():
        if name == scenario.name:
            continue
        section = sim_section(bench.shapes, trace, other, jobs)
        results["shapes"][name] = {g: {k: section[g][k] for k in NEW_KEYS} for g in AGAINST}
        results["shapes"][name]["section"] = section
    if engine:
        results |= engine_keys(sched_engine.engine_section(bench.engine))
    if plot is not None:
        from loraplex.benchmarks.sched.plot import plot_p99_ttft

        results["plot"] = str(plot_p99_ttft(sim, plot))
        log(f"plot: {results['plot']}")
    return results


def _get(r: dict, dotted: str) -> float:
    for part in dotted.split("."):
        r = r[part]
    return r


def print_table(r: dict) -> None:
    sim = r["sim"]
    print(
        f"simulator [{sim['scenario']}]: {sim['profile']}, {sim['adapters']} adapters, lengths x "
        f"{sim['length_scale']:.3f}, S-LoRA's pool {sim['slora_pool_slots']} slots, SLO "
        f"{sim['slo_s']:.2f} s, {sim['seeds']} arrival seeds x "
        f"{sim['requests_per_load']} requests; mean over seeds"
    )
    cols = ("p50_ttft_s", "p99_ttft_s", "p99_tbt_s", "throughput_rps", "hit_rate")
    print(f"{'system':18} {'req/s':>6} " + " ".join(f"{c:>14}" for c in cols))
    for name, rows in sim["systems"].items():
        for load, row in rows.items():
            print(f"{name:18} {load:>6} " + " ".join(f"{row[c]:14.3f}" for c in cols))
    print(
        "throughput at SLO = sustainable capacity (steady completion rate under overload, "
        "req/s of the run's mix): "
        + ", ".join(f"{n} {v:.2f}" for n, v in sim["throughput_at_slo_rps"].items())
    )
    print(
        f"P99 TTFT crossing the SLO in runs of {sim['requests_per_load']} (req/s; moves with "
        "run length): " + ", ".join(f"{n} {v:.2f}" for n, v in sim["crossing_rps"].items())
    )
    print(
        "crossing / capacity: "
        + ", ".join(f"{n} {v:.2f}" for n, v in sim["crossing_over_capacity"].items())
    )
    if sim["slo_not_crossed"]:
        print(
            "within the SLO at the top load, past the cap (crossing a lower bound): "
            + ", ".join(sim["slo_not_crossed"])
        )
    for name, curve in sim["reduction_curves"].items():
        print(
            f"{name} vs slora on the grid (req/s: load / {name}'s capacity, / slora's: P99 "
            "TTFT reduction): "
            + "  ".join(
                f"{p['load_rps']:.2f}: {p['load_over_capacity']:.2f}, "
                f"{p['load_over_slora_capacity']:.2f}: {p['p99_ttft_reduction']:.2f}"
                for p in curve
            )
        )
    print(
        "paper loads (x slora's capacity 6/8.6, 8/8.6, 9/8.6): "
        + ", ".join(f"{k} {v:.2f} req/s" for k, v in sim["paper_loads_rps"].items())
    )
    for level, row in sim["paper_loads_over_capacity"].items():
        print(
            f"  {level} load / each system's capacity: "
            + ", ".join(f"{n} {v:.2f}" for n, v in row.items())
        )
    print(f"{'metric':48} {'mean':>8} {'std':>7} {'min':>7} {'max':>7}  paper / target")
    for key, target in TARGETS.items():
        value = _get(r, key)
        s = sim["spread"][key]
        paper = PAPER.get(key.split(".")[-1]) if key.startswith("vs_slora") else None
        note = f"{paper} / {target}" if paper is not None else target
        print(f"{key:48} {value:8.3f} {s['std']:7.3f} {s['min']:7.3f} {s['max']:7.3f}  {note}")
    print(
        "operating points (load / the compared system's capacity, / slora's: P99 / P50 TTFT "
        "reduction against slora):"
    )
    for group in AGAINST:
        g = sim[group]
        print(
            f"  {group:18} "
            + "  ".join(
                f"{at} {g[f'{at}_load_over_capacity']:.2f}, "
                f"{g[f'{at}_load_over_slora_capacity']:.2f}: "
                f"{g[f'p99_ttft_reduction_{at}_load']:.2f} / {g[f'p50_ttft_reduction_{at}_load']:.2f}"
                for at in ("high", *OPERATING_POINTS)
            )
        )
    for group in AGAINST:
        for key in ("p99_ttft_reduction_max", "p99_ttft_reduction_max_at_load_over_capacity"):
            print(f"{group + '.' + key:48} {sim[group][key]:8.3f}")
        for level in ("low", "medium"):
            for q in ("p99", "p50"):
                key = f"{q}_ttft_reduction_{level}_load"
                paper = PAPER[key] if group == "vs_slora" else ""
                print(f"{group + '.' + key:48} {sim[group][key]:8.3f}  {paper}")
    print(
        "against slora at the paper's loads (p99 / p50 TTFT reduction: low, medium, high; throughput at SLO):"
    )
    for name, row in sim["against_slora"].items():
        cells = "  ".join(
            f"{row[f'p99_ttft_reduction_{lv}_load']:.2f}/{row[f'p50_ttft_reduction_{lv}_load']:.2f}"
            for lv in ("low", "medium", "high")
        )
        print(f"  {name:18} {cells}  x{row['throughput_at_slo_ratio']:.2f}")
    high = sim["at_paper_loads"]["high"]
    for name in ("slora", "chameleon"):
        ranks = {k.split("_rank")[1]: v for k, v in high.get(name, {}).items() if "_rank" in k}
        print(
            f"P99 TTFT by adapter rank at the high load, {name}: "
            + ", ".join(f"r{r} {v:.2f} s" for r, v in ranks.items())
        )
    print(
        "host link busy at the high load: "
        + ", ".join(f"{n} {row['link_busy']:.3f}" for n, row in high.items())
    )
    print(
        "critical-path loads / mean wait (ms) at the high load (S-LoRA's engine): "
        + ", ".join(
            f"{n} {row['critical_loads']:.0f} / {row['critical_wait_ms']:.1f}"
            for n, row in high.items()
            if row["critical_loads"] == row["critical_loads"]  # not NaN
        )
    )
    for name, shape in r["shapes"].items():
        print(
            f"shape {name}: "
            + "  ".join(
                f"{g}.{k} {shape[g][k]:.3f}"
                for g in ("vs_slora", "loraplex_vs_slora")
                for k in NEW_KEYS
            )
        )
    if "engine" in r:
        print_engine(r)


def print_engine(r: dict) -> None:
    eng = r["engine"]
    print(
        f"engine (CPU, {eng['adapters']} adapters, {eng['requests']} requests x "
        f"{eng['arrival_draws']} arrival draws at {eng['rate_rps']:.2f} req/s):"
    )
    for name, row in eng["systems"].items():
        print(
            f"  {name:18} p50 TTFT {row['p50_ttft_s']:.3f} s  p99 TTFT {row['p99_ttft_s']:.3f} s"
            f"  hit rate {row['hit_rate']:.2f}"
        )
    print(
        f"  against slora at {eng['against_slora_rate_rps']:.2f} req/s (9/8.6 x its SLO "
        f"crossing), {eng['against_slora_draws']} arrival draws:"
    )
    for name, row in eng["against_slora_systems"].items():
        print(f"  {name:18} p50 TTFT {row['p50_ttft_s']:.3f} s  p99 TTFT {row['p99_ttft_s']:.3f} s")
    for key, e in (("", eng), ("_guard", eng["guard"])):
        draws = ", ".join(f"{d:.2f}" for d in e["p99_ttft_reduction_per_draw"])
        print(
            f"engine_p99_ttft_reduction{key} {e['p99_ttft_reduction']:.3f} (> 0 in every draw, "
            f"loraplex{key} vs fifo_nocache; the draws' {draws})"
        )
    for group in AGAINST:
        e = eng[group]
        draws = ", ".join(f"{d:.2f}" for d in e["p99_ttft_reduction_per_draw"])
        print(
            f"engine.{group}.p99_ttft_reduction {e['p99_ttft_reduction']:.3f} (>= 0.5; mean "
            f"of the draws' {draws}; pooled {e['p99_ttft_reduction_pooled']:.3f}; sign "
            f"settled: {e['sign_settled']})"
        )
