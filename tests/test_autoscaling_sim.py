"""The fleet simulator under Ray Serve's autoscaler (benchmarks/sim/scaling.py): replicas
start after their load time, a leaving replica is routed nothing new while its requests
finish, and the policies are Ray's own functions, wrapped as Serve wraps them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve.autoscaling_policy import _apply_autoscaling_config

from loraplex.benchmarks.fleet import autoscale
from loraplex.benchmarks.fleet import bench as fb
from loraplex.benchmarks.fleet import workloads as fw
from loraplex.benchmarks.sim.fleet import FleetSetup
from loraplex.benchmarks.sim.scaling import (
    Scaling,
    ScalingFleetSim,
    model_load_s,
)
from loraplex.benchmarks.sim.workload import Trace, read_trace
from loraplex.router.autoscaling import READS_PER_S, UTILISATION, serve_autoscaling_config

STARTUP_S = 20.0
SHORT = fw.Lengths(prompt=(64, 128), output=(150, 250))  # ~6 s a stream


@pytest.fixture(scope="module")
def fleet() -> fb.Fleet:
    return fb.calibrate(fb.QUICK, read_trace(None))


def burst(fleet: fb.Fleet, rate: float, seconds: float, start: float = 0.0, seed: int = 0):
    adapters = fw.catalog(20, fleet.profile.adapter_bytes)
    names = [a.name for a in adapters]
    reqs = fw.requests("zipf", names, round(rate * seconds), rate, SHORT, seed)
    return [dataclasses.replace(r, arrival=start + r.arrival) for r in reqs], adapters


def one_replica(fleet: fb.Fleet, adapters) -> FleetSetup:
    """The bench's fleet, starting with one replica (homes bounded by the most, 4)."""
    return dataclasses.replace(fleet.setup(4, adapters), num_replicas=1)


def scaling(**config) -> Scaling:
    base = {"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 0, "downscale_delay_s": 30}
    return Scaling(serve_autoscaling_config({**base, **config}), STARTUP_S)


def test_a_replica_serves_only_after_its_load_time_and_a_leaving_one_loses_nothing(fleet):
    # 60 s at twice one replica's capacity, then 2 minutes of one request in 10 s
    reqs, adapters = burst(fleet, 2 * fleet.capacity_per_replica, 60)
    tail, _ = burst(fleet, 0.1, 120, start=60, seed=1)
    reqs += [dataclasses.replace(r, rid=len(reqs) + r.rid) for r in tail]
    catalog = {a.name: a for a in adapters}
    sim = ScalingFleetSim(
        "affinity", reqs, catalog, one_replica(fleet, adapters), scaling(target_ongoing_requests=16)
    )
    run = sim.run()
    record = sim.finish(run)
    assert len(run.ttft) == len(reqs)  # nothing lost (FleetSim asserts it too)
    held = [n for _, n in record.timeline]
    assert max(held) > 1 and held[-1] == 1, record.timeline  # up, then back to one
    asked = record.timeline[1][0]  # the first scale-up
    first_elsewhere = min(
        a for a, where in zip(run.arrival, run.replica, strict=True) if where != "replica-0"
    )
    # the arrival a new replica first served came after its start-up
    assert first_elsewhere >= asked + STARTUP_S - 1e-9
    # every replica that left stopped after its last request: routed nothing after it left
    for replica in sim.dead:
        assert not replica.in_flight
    assert run.streams_resumed == record.stopped_with_requests == 0


def test_the_policy_decides_as_serves_own_wrapper_decides(fleet):
    # with no delays, time.time() in Serve's wrapper cannot matter: the two agree exactly.
    # 3 x a replica's capacity: 1.5 x held ~30 requests of 64 slots, under lora's load count
    # (only the first reads of its 20 adapters, no longer counted as store reads, asked for more)
    reqs, adapters = burst(fleet, 3 * fleet.capacity_per_replica, 40)
    catalog = {a.name: a for a in adapters}
    for policy in ("requests", "lora"):
        s = scaling(policy=policy, target_ongoing_requests=8, downscale_delay_s=0)
        sim = ScalingFleetSim("affinity", reqs, catalog, one_replica(fleet, adapters), s)
        serve = _apply_autoscaling_config(_resolve_policy_callable(s.config().policy))
        seen = []
        decide = sim._decide

        def both(ctx, decide=decide, serve=serve, seen=seen):
            ours = decide(ctx)
            theirs = serve(ctx)
            seen.append((ours[0], theirs[0]))
            return ours

        sim._decide = both
        sim.run()
        assert seen and all(a == b for a, b in seen), policy
        assert any(a > 1 for a, _ in seen), policy  # the load did ask for more


def test_first_reads_are_not_reported_as_store_reads(fleet):
    """A replica reads each of its 20 adapters once (its host tier keeps them all): first
    reads say nothing of what its tiers can keep, and counted as store reads they asked the
    lora policy for replicas that, new, read every adapter routed to them again."""
    reqs, adapters = burst(fleet, 0.5 * fleet.capacity_per_replica, 40)
    catalog = {a.name: a for a in adapters}
    sim = ScalingFleetSim(
        "affinity", reqs, catalog, one_replica(fleet, adapters), scaling(policy="lora")
    )
    reported = []
    sample = sim._on_sample

    def keep(event, sample=sample):
        sample(event)
        reported.extend(r[READS_PER_S] for r in sim.samples[-1][2].values())

    sim._on_sample = keep
    sim.run()
    assert reported and not any(reported)
    (replica,) = sim.replicas.values()  # and so no second replica
    assert replica.reads == len({r.adapter for r in reqs})  # each read once, first
    assert replica.sim.cache.stats.disk_reads == 0  # none read again


def test_replicas_count_quick_rereads_over_the_policys_demand_window(fleet):
    """A re-read counts for the working set when it comes within the lora policy's demand
    window of the adapter's previous load on that replica (adapter_cache.py
    `quick_rereads`): the simulator's replicas take the window from the policy's settings,
    as the deployment does."""
    reqs, adapters = burst(fleet, 0.2 * fleet.capacity_per_replica, 10)
    catalog = {a.name: a for a in adapters}
    config = scaling(policy="lora", lora={"demand_window_s": 45.0})
    sim = ScalingFleetSim("affinity", reqs, catalog, one_replica(fleet, adapters), config)
    sim.run()
    assert [r.sim.cache.reread_window_s for r in sim.replicas.values()] == [45.0]


def test_a_stopping_replica_past_the_graceful_timeout_resumes_its_streams(fleet):
    # 2,000-token streams (~50 s) outlive Serve's 20 s graceful shutdown: 3 replicas, and
    # 30 s after the first report Serve wants 1 (the load is far under the target)
    long = fw.Lengths(prompt=(64, 64), output=(2000, 2000), max_tokens=2000)
    adapters = fw.catalog(4, fleet.profile.adapter_bytes)
    reqs = fw.requests("zipf", [a.name for a in adapters], 200, 8.0, long, 0)
    catalog = {a.name: a for a in adapters}
    config = {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 3}
    config |= {"upscale_delay_s": 0, "downscale_delay_s": 30, "target_ongoing_requests": 400}
    setup = dataclasses.replace(fleet.setup(4, adapters), num_replicas=3)
    sim = ScalingFleetSim(
        "affinity", reqs, catalog, setup, Scaling(serve_autoscaling_config(config), STARTUP_S)
    )
    run = sim.run()
    record = sim.finish(run)
    assert [n for _, n in record.timeline][-1] == 1
    assert len(run.ttft) == len(reqs)
    assert record.stopped_with_requests == 2 and run.streams_resumed > 0
    # each change of the target count is timed: the steady run counts those past its warm-up
    assert len(record.event_times) == record.scale_events >= 1
    assert record.event_times == sorted(record.event_times)
    summary = autoscale.summarize(run, record, slo=1.0, day_s=run.arrival.max(), warmup_s=0.0)
    assert summary["scale_events_per_hour_after_warmup"] == summary["scale_events_per_hour"]
    last = record.event_times[-1]
    late = autoscale.summarize(run, record, slo=1.0, day_s=2 * last, warmup_s=last + 1e-6)
    assert late["scale_events_per_hour_after_warmup"] == 0.0


def test_the_day_swings_five_to_one_around_the_trace_arrivals():
    rng = np.random.default_rng(0)
    trace = Trace("test", np.cumsum(rng.exponential(1.0, 5000)), np.ones(5000), np.ones(5000))
    day, peak = 3600.0, 20.0
    at = autoscale.diurnal_arrivals(trace, day, peak, seed=0)
    # the rate's integral: (trough + peak) / 2 x day
    assert len(at) == pytest.approx((peak / 5 + peak) / 2 * day, rel=0.03)
    edge = np.sum(at < 180) + np.sum(at > day - 180)
    middle = np.sum(np.abs(at - day / 2) < 180)

    def mean_rate(x0: float, x1: float) -> float:  # the stated curve's mean over [x0, x1]
        t = np.linspace(x0, x1, 10_001)
        return float(np.mean(peak / 5 + (peak - peak / 5) * (1 - np.cos(2 * np.pi * t / day)) / 2))

    assert middle / edge == pytest.approx(
        mean_rate(day / 2 - 180, day / 2 + 180) / mean_rate(0, 180), rel=0.1
    )


def test_the_steady_load_keeps_the_trace_arrivals_at_one_rate():
    """The steady run (the day's mean rate all through) has the trace's own gaps, scaled to
    the rate: as many requests in the first half-hour as in the second."""
    rng = np.random.default_rng(0)
    trace = Trace("test", np.cumsum(rng.exponential(1.0, 5000)), np.ones(5000), np.ones(5000))
    at = autoscale.steady_arrivals(trace, 3600.0, 6.0, seed=0)
    assert len(at) == pytest.approx(6.0 * 3600, rel=0.03)
    assert at.min() >= 0 and at.max() < 3600.0 and np.all(np.diff(at) >= 0)
    assert np.sum(at < 1800) / np.sum(at >= 1800) == pytest.approx(1.0, rel=0.05)
    # the first gaps are the trace's own, at the rate
    gaps = np.diff(trace.timestamps)
    assert np.diff(at[:50]) == pytest.approx(gaps[1:50] / gaps.mean() / 6.0)


def test_model_load_is_the_weights_read_and_the_engine_start(fleet):
    assert model_load_s(fleet.profile) == pytest.approx(13.48e9 / 2e9 + 15.0)


@pytest.mark.parametrize("load", [0.3, 0.8])
def test_a_replicas_utilisation_is_the_share_of_its_capacity_asked_for(fleet, load):
    """One replica (min = max = 1) under a steady `load` x its measured capacity (the bench's
    calibration: requests per second under overload, of the trace's lengths) reports that
    share as its utilisation, lightly loaded or near full. Its output tokens are priced by
    its decode rows' measured cost; with one cost per token of either kind the fit followed
    the prompt tokens (~27 µs on this profile, against ~0.25 ms a decode row) when the
    window held long prefills, and the decode rows when it did not, so a replica's report
    depended on how full its batches ran."""
    lengths = fw.Lengths(trace=fleet.trace, max_tokens=fb.MAX_TOKENS)
    rate, seconds = load * fleet.capacity_per_replica, 180.0
    adapters = fw.catalog(1, fleet.profile.adapter_bytes)
    reqs = fw.requests("zipf", [adapters[0].name], round(rate * seconds), rate, lengths, 3)
    sim = ScalingFleetSim(
        "affinity",
        reqs,
        {adapters[0].name: adapters[0]},
        one_replica(fleet, adapters),
        scaling(policy="lora", min_replicas=1, max_replicas=1),
    )
    reported = []
    sample = sim._on_sample

    def keep(event, sample=sample):
        sample(event)
        if 20.0 < sim.now <= seconds:  # past the ramp, while requests arrive
            reported.extend(r[UTILISATION] for r in sim.samples[-1][2].values())

    sim._on_sample = keep
    sim.run()
    assert len(reported) >= 20
    assert np.mean(reported) == pytest.approx(load, rel=0.15)


def test_the_day_is_drawn_as_replicas_and_p99_ttft_per_policy(tmp_path):
    """`bench fleet --section autoscale --plot DIR` draws what the results hold: a PNG of
    each policy's replicas over the day and its windows' P99 TTFT against the SLO."""
    pytest.importorskip("matplotlib", reason="the figure needs the bench extra (matplotlib)")

    def policy(hours: float, timeline: list[list[float]]) -> dict:
        windows = [{"t_s": t, "p99_ttft_s": 0.5 + t / 3600} for t in (0.0, 300.0, 600.0)]
        windows.append({"t_s": 900.0, "p99_ttft_s": None})  # a window with no request
        return {
            "replica_hours": hours,
            "slo_attainment": 0.999,
            "replicas_timeline": timeline,
            "p99_ttft_windows": windows,
        }

    results = {
        "day_s": 1200.0,
        "slo_s": 1.7,
        "requests": 1000,
        "peak_rps": 3.0,
        "adapters": 20,
        "profile": "h100-7b",
        "ray_default_target_ongoing_requests": 16.0,
        "ray_default_downscale_delay_s": 30.0,
        "policies": {
            "ray_default": policy(1.0, [[0.0, 1], [300.0, 3], [900.0, 2]]),
            "lora": policy(0.8, [[0.0, 1], [400.0, 2]]),
            "static": policy(1.3, [[0.0, 4]]),
        },
    }
    png = autoscale.plot_day(results, tmp_path / "figures" / "autoscale_day.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("peak_replicas", [1, 4, 12])
def test_a_clairvoyant_fleet_of_whole_replicas_needs_more_than_the_days_mean(peak_replicas):
    """The bound beside `replica_hours_ratio_vs_static`: at each moment the fewest whole
    replicas that keep each at or below the static fleet's peak load. Checked against the
    curve's crossings worked out by hand: the rate is at most k replicas' worth for the
    share arccos(1 - 2 (k / P - 1 / 5) / (4 / 5)) / pi of the day, and the mean of a whole
    count is the sum over k of the share of the day it exceeds k."""
    day_s, p = 3600.0, peak_replicas

    def share_at_most(k: int) -> float:
        if k <= p / autoscale.PEAK_TO_TROUGH:
            return 0.0
        return float(np.arccos(1 - 2 * (k / p - 1 / 5) / (4 / 5)) / np.pi)

    mean_replicas = sum(1 - share_at_most(k) for k in range(p))
    hours = autoscale.clairvoyant_replica_hours(p, day_s)
    assert hours == pytest.approx(mean_replicas * day_s / 3600, rel=1e-4)
    assert hours / p == pytest.approx({1: 1.0, 4: 0.6993, 12: 0.6377}[p], abs=1e-3)
    assert hours / p > (1 + 1 / autoscale.PEAK_TO_TROUGH) / 2  # the day's mean over its peak
