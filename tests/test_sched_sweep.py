"""`bench sched`'s load sweep goes past each system's capacity: a grid that stops below it
read the top load as every system's crossing (9.40 req/s for all ten systems in the 3-seed
run, S-LoRA's capacity 9.84 and loraplex's 26), so the crossings could not rank them."""

from __future__ import annotations

import pytest

from loraplex.benchmarks.sched import sim as sched_sim
from loraplex.benchmarks.sched.scenarios import SCENARIOS
from loraplex.benchmarks.sched.sweep import EXTEND_AT, extend_past_crossing, loads_of
from loraplex.benchmarks.sim.workload import RANKS


def test_the_sweep_finds_each_systems_crossing_past_a_grid_below_every_capacity():
    """The real simulator, a grid at 0.25 and 0.6 x the trace's rate (below every system's
    capacity): S-LoRA and loraplex, whose capacities (steady completion under overload)
    differ by more than 1.5x, get crossings that differ as much; the old sweep read the
    grid's top for both."""
    out = _below_every_capacity(400)
    top, slo = out["loads_rps"][-1], out["slo_s"]
    crossing, capacity = out["crossing_rps"], out["throughput_at_slo_rps"]
    assert out["slo_not_crossed"] == []
    assert all(crossing[n] > top for n in SYSTEMS)
    assert capacity["loraplex"] > 1.5 * capacity["slora"]
    assert crossing["loraplex"] > 1.5 * crossing["slora"]
    for name, curve in out["systems"].items():
        past = [k for k in loads_of(curve) if float(k) > top]
        assert [float(k) for k in past] == out["extended_loads_rps"][name]
        # raised one step at a time, stopped at the first load past the SLO
        assert [curve[k]["p99_ttft_s"] > slo for k in past] == [False] * (len(past) - 1) + [True]
        assert float(past[-1]) <= EXTEND_AT[-1] * capacity[name] + 0.01
    for name, row in out["at_paper_loads"]["high"].items():
        ranks = [row[f"p99_ttft_s_rank{r}"] for r in RANKS]
        # the whole run's P99 lies between its ranks' (a mixture's quantile does)
        assert min(ranks) - 1e-3 <= row["p99_ttft_s"] <= max(ranks) + 1e-3, name
    for name in ("chameleon", "loraplex"):
        assert out["crossing_over_capacity"][name] == crossing[name] / capacity[name]
        curve = out["reduction_curves"][name]
        best = max(p["p99_ttft_reduction"] for p in curve)
        assert out["against_slora"][name]["p99_ttft_reduction_max"] == best
        # the paper's high load is on the curve with the headline key's value
        high = next(p for p in curve if p["at"] == "high")
        assert (
            high["p99_ttft_reduction"] == out["against_slora"][name]["p99_ttft_reduction_high_load"]
        )


def test_the_comparison_is_reported_at_the_papers_fraction_of_each_systems_own_capacity():
    """Seed 004 §5.2.2 compares at 9 RPS: 9 / 8.6 of S-LoRA's capacity (the headline's
    high load here) and 9 / 12.9 of Chameleon's. Each system compared with S-LoRA is also
    compared at 9 / 12.9 of its own capacity, and at 0.5 and 0.7 of S-LoRA's, on the same
    arrivals for both, with every load's operating point stated beside its reductions."""
    out = _below_every_capacity(300)
    capacity = out["throughput_at_slo_rps"]
    for group, name in sched_sim.AGAINST_SLORA.items():
        keys = out[group]
        assert keys["high_load_over_slora_capacity"] == pytest.approx(9 / 8.6)
        assert keys["high_load_over_capacity"] == pytest.approx(
            9 / 8.6 * capacity["slora"] / capacity[name]
        )
        own, fractions = "own_capacity", {"slora_capacity_50": 0.5, "slora_capacity_70": 0.7}
        assert keys[f"{own}_load_over_capacity"] == pytest.approx(9 / 12.9)
        assert keys[f"{own}_load_rps"] == pytest.approx(9 / 12.9 * capacity[name])
        for at, fraction in fractions.items():
            assert keys[f"{at}_load_over_slora_capacity"] == pytest.approx(fraction)
            assert keys[f"{at}_load_rps"] == pytest.approx(fraction * capacity["slora"])
        for at in (own, *fractions):
            point = next(p for p in out["reduction_curves"][name] if p["at"] == at)
            for q in ("p99", "p50"):
                assert keys[f"{q}_ttft_reduction_{at}_load"] == point[f"{q}_ttft_reduction"]
                assert keys[f"{q}_ttft_reduction_{at}_load"] < 1


def _fake_summary(load: float, capacity: float) -> dict:
    # a P99 that grows without bound as the load nears capacity, like a queue's
    return {"p99_ttft_s": 0.2 / max(1e-3, 1 - load / capacity), "p50_ttft_s": 0.1}


def test_extension_raises_each_system_until_every_seed_crosses_and_stops_at_the_cap():
    capacity = {"slow": 10.0, "fast": 20.0, "never": 30.0}
    seeds = (0, 1)
    grid = ("2.00", "4.00")
    p99_at = {"slow": 10.0, "fast": 20.0, "never": 1e9}  # where P99 would grow unbounded
    curves = {
        n: {s: {k: _fake_summary(float(k), p99_at[n]) for k in grid} for s in seeds}
        for n in capacity
    }
    ran: list[tuple[str, float, int]] = []

    def run_all(tasks):
        ran.extend(tasks)
        return {(n, x, s): _fake_summary(x * (1.1 if s else 1.0), p99_at[n]) for n, x, s in tasks}

    added = extend_past_crossing(curves, 2.5, capacity, run_all)
    # slow's P99 passes 2.5 s at 9 req/s in seed 1 (its loads x 1.1), at 10 in seed 0
    assert added["slow"] == [7.0, 8.0, 9.0, 10.0]
    assert added["fast"] == [14.0, 16.0, 18.0, 20.0]
    assert added["never"] == pytest.approx([f * 30.0 for f in EXTEND_AT])  # the cap
    for by_seed in curves.values():
        assert loads_of(by_seed[0]) == loads_of(by_seed[1])  # the seeds share loads
    assert len(ran) == 2 * sum(len(v) for v in added.values())


SYSTEMS = ("slora", "chameleon", "loraplex")


def _below_every_capacity(requests: int) -> dict:
    """The real simulator on the paper's scenario, a grid at 0.25 and 0.6 x the trace's rate
    (below every system's capacity), one seed."""
    shape = sched_sim.SimShape(
        requests=requests,
        load_factors=(0.25, 0.6),
        scale_minutes=0.5,
        seeds=1,
        systems=SYSTEMS,
    )
    return sched_sim.sim_section(shape, None, SCENARIOS["paper"])
