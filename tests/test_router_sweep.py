"""`bench router`'s sweep goes past its grid while a router still holds the SLO at the top
rate run, and the figures of repetitions that went to different rates merge rate by rate.
The runs are fakes here (p99 as a function of the rate): what is tested is the sweep's
decision and the merge, not Ray; tests/test_bench_router.py runs the real thing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loraplex.benchmarks.router import bench
from loraplex.benchmarks.router.figures import summary

UNLOADED_S = 0.1  # SLO 0.5 s
BASIS = 10.0
W = replace(
    bench.QUICK,
    rate_factors=(0.5, 1.0),
    reference_factor=0.5,
    extra_rate_factors=(1.5, 2.0, 3.0),
    failover_factors=(0.5,),
    min_requests=0,
)


def _sweep(monkeypatch, workload: str, slo_rps: dict[str, float]) -> dict:
    """A sweep whose router `r` holds the SLO (p99 0.4 s) up to `slo_rps[r]` and misses
    it past (p99 0.9 s)."""

    async def no_warm_up(*args, **kwargs):
        return [], 0.0

    def run(router, app, reqs, w, workload, rate, kill_at):
        p99 = 0.4 if rate <= slo_rps[router] else 0.9
        figures = _figures(p99)
        if router == "affinity":  # bench.placements_since's
            figures["placements"] = {"device/device": round(rate), "cold/store": 1}
        return figures

    monkeypatch.setattr(bench, "drive", no_warm_up)
    monkeypatch.setattr(bench, "_run", run)
    names = [f"a{i}" for i in range(W.num_adapters)]
    calibration = {"rate_basis_rps": BASIS, "unloaded_ttft_s": UNLOADED_S}
    apps = {r: bench.App(f"bench-{r}", None) for r in bench.ROUTERS}
    return bench._sweep(workload, 0, 0, names, W, apps, calibration)


def _figures(p99: float | None) -> dict:
    return {
        "p50_ttft_s": p99,
        "p99_ttft_s": p99,
        "requests": 2,
        "raw": {"at_s": [0.0, 0.1], "ttft_s": [p99, p99], "ok": [True, True]},
        "load_avg_1m": [0.5, 0.6],
        "loads": 1.0,
        "reads": 1.0,
        "load_seconds": 0.1,
        "busy_s_by_replica": [2.0, 1.0],
    }


@pytest.mark.parametrize(
    ("held_to", "rates"),
    [
        (15.0, [5.0, 10.0, 15.0, 20.0]),  # one router held at 1.5: 2.0 runs, where all miss
        (9.0, [5.0, 10.0]),  # every router missed at the grid's top: it ends there
        (99.0, [5.0, 10.0, 15.0, 20.0, 30.0]),  # held to the end of the extra rates
    ],
    ids=["past-the-grid", "grid-enough", "extra-rates-end"],
)
def test_the_sweep_runs_past_its_grid_while_a_router_still_holds_the_slo(
    monkeypatch, held_to, rates
):
    """In the quick run of 2026-11-28 every router held the SLO at the grid's top on hot, so
    each goodput was that rate and the ratio 1 by construction; the sweep stopped there."""
    sweep = _sweep(monkeypatch, "hot", {"affinity": held_to, "pow2": 6.0, "multiplex": 9.0})
    assert sweep["rates_rps"] == pytest.approx(rates)
    assert all(len(runs) == len(rates) for runs in sweep["per_router"].values())
    assert len(sweep["requests"]["runs"]) == len(rates)


def test_failover_keeps_its_one_rate(monkeypatch):
    sweep = _sweep(monkeypatch, "failover", dict.fromkeys(bench.ROUTERS, 99.0))
    assert sweep["rates_rps"] == pytest.approx([5.0])


def test_repetitions_that_ran_different_rates_merge_rate_by_rate(monkeypatch):
    """One repetition stopped at the grid, one went one rate past it: each rate's figures
    are the medians of those that ran it, and the goodputs each repetition's own."""
    short = _sweep(monkeypatch, "hot", {"affinity": 10.0, "pow2": 6.0, "multiplex": 9.0})
    long = _sweep(monkeypatch, "hot", {"affinity": 15.0, "pow2": 6.0, "multiplex": 9.0})
    assert (len(short["rates_rps"]), len(long["rates_rps"])) == (3, 4)
    calibration = {
        "rate_basis_rps": BASIS,
        "unloaded_ttft_s": UNLOADED_S,
        "capacity_rps": 20.0,
        "lora_capacity_rps": {"affinity": BASIS},
    }
    reps = [{"hot": short}, {"hot": long}]
    hot = summary(W, {"pool_bytes": 1 << 20}, {}, calibration, reps)["workloads"]["hot"]
    assert hot["rates_rps"] == pytest.approx([5.0, 10.0, 15.0, 20.0])
    assert hot["repetitions_per_rate"] == [2, 2, 2, 1]
    assert hot["routers"]["affinity"]["p99_ttft_s"] == pytest.approx([0.4, 0.4, 0.65, 0.9])
    assert hot["routers"]["pow2"]["load_avg_1m"][3] == pytest.approx([0.5, 0.6])
    assert [len(r["rates_rps"]) for r in hot["repetitions"]] == [3, 4]
    # where the affinity router sent each rate's requests, per repetition and rate by rate
    assert [len(r["placements_by_rate"]["affinity"]) for r in hot["repetitions"]] == [3, 4]
    assert set(hot["repetitions"][0]["placements_by_rate"]) == {"affinity"}
    assert [p["device/device"] for p in hot["routers"]["affinity"]["placements"]] == [5, 10, 15, 20]
    assert hot["routers"]["pow2"]["busy_s_by_replica"][0] == [2.0, 1.0]  # each replica's
    # each repetition's goodput, where its p99 crosses the SLO (linear between rates): 11
    # (0.4 at 10, 0.9 at 15), then 16; their median
    assert hot["goodput_rps"]["affinity"] == pytest.approx(13.5)


def test_the_warm_up_asks_for_every_adapter_of_the_catalog_once(monkeypatch):
    """Before a run every adapter has been read once, so the reference run's p99 is not its
    first reads: a warm-up of `len(names)` draws from the zipf popularity left 37-47 of 120
    adapters to the reference run (the quick run of 2026-12-02). Every later run's floor of
    store reads (`new_adapters`) is then 0."""
    sweep = _sweep(monkeypatch, "zipf", dict.fromkeys(bench.ROUTERS, 99.0))
    warm = sweep["requests"]["warm-up"]
    names = [f"a{i}" for i in range(W.num_adapters)]
    assert sorted(r.adapter for r in warm) == sorted(names)
    assert [r.adapter for r in warm] != names  # in a drawn order, not the catalog's
    assert all(r.output == 1 for r in warm)
    assert sweep["new_adapters"] == [0] * len(sweep["rates_rps"])
