"""The reads a smaller tier would make (replica/demand.py), against an oracle: an LRU tier of
bytes simulated request by request; and the `lora` policy reading the projection before it
removes a replica (router/autoscaling.py)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from loraplex.replica.demand import (
    READ_FRACTIONS,
    SKETCH_K,
    AdapterDemand,
    adapter_hash,
    che_reads,
    distinct_adapters,
    fraction_for,
    fraction_key,
)
from loraplex.router.autoscaling import (
    LoraAutoscaling,
    ReplicaReport,
    demand_overlap,
    step_down_busy,
    wanted,
)

MiB = 1 << 20


def lru_reads_per_s(
    rates: np.ndarray, sizes: np.ndarray, capacity: float, seconds: float, seed: int
) -> float:
    """The oracle: Poisson requests at `rates` into an LRU tier of `capacity` bytes that drops
    its least recently used items until the new one fits; the reads per second after a
    warm-up of a fifth of the time."""
    rng = np.random.default_rng(seed)
    total = rates.sum()
    n = rng.poisson(total * seconds)
    items = rng.choice(len(rates), size=n, p=rates / total)
    tier: OrderedDict[int, None] = OrderedDict()
    held, reads, warm = 0.0, 0, n // 5
    for k, item in enumerate(items):
        if item in tier:
            tier.move_to_end(item)
            continue
        reads += k >= warm
        tier[item] = None
        held += sizes[item]
        while held > capacity:
            dropped, _ = tier.popitem(last=False)
            held -= sizes[dropped]
    return reads / (seconds * (n - warm) / n)


@pytest.mark.parametrize(("zipf_a", "share"), [(0.5, 0.4), (1.0, 0.25), (0.8, 0.7)])
def test_che_matches_a_simulated_lru_tier_of_bytes(zipf_a: float, share: float):
    rng = np.random.default_rng(7)
    n = 400
    rates = 20.0 / np.arange(1, n + 1) ** zipf_a
    rates *= 20.0 / rates.sum()  # 20 requests a second
    sizes = rng.choice([8, 16, 32, 64], size=n).astype(np.float64) * MiB  # ranks 8-64
    capacity = share * sizes.sum()
    projected = che_reads(rates, sizes, capacity)
    measured = lru_reads_per_s(rates, sizes, capacity, seconds=4000.0, seed=11)
    assert projected == pytest.approx(measured, rel=0.08)


def test_a_tier_that_holds_everything_reads_nothing_and_an_empty_one_reads_every_request():
    rates, sizes = np.array([1.0, 2.0]), np.array([MiB, MiB], dtype=np.float64)
    assert (che_reads(rates, sizes, 2 * MiB), che_reads(rates, sizes, 0.0)) == (0.0, 3.0)


def test_the_demand_measures_each_adapters_rate_from_its_requests():
    rng = np.random.default_rng(3)
    demand = AdapterDemand(now=0.0, tau_s=600.0)
    true = {"hot": 2.0, "warm": 0.5, "cold": 0.05}
    arrivals = sorted(
        (t, name)
        for name, rate in true.items()
        for t in np.cumsum(rng.exponential(1 / rate, size=int(rate * 4000)))
        if t < 3000
    )
    for t, name in arrivals:
        demand.asked(name, MiB, t)
    rates, sizes = demand.rates(3000.0)
    assert sorted(rates) == pytest.approx(sorted(true.values()), rel=0.2)
    assert list(sizes) == [MiB] * 3
    # young: a demand 60 s old counts its rate over 60 s, not over tau
    young = AdapterDemand(now=0.0)
    for t in np.arange(0.0, 60.0, 0.5):
        young.asked("a", MiB, float(t))
    assert young.rates(60.0)[0] == pytest.approx([2.0], rel=0.05)
    # a demand that has left is forgotten as its gap grows (last asked at 59.5 s)
    assert young.rates(120.0)[0] == pytest.approx([3 / 60.5])
    # and dropped once decayed away
    assert young.rates(60.0 + 20 * 600.0)[0].size == 0


def test_the_fraction_for_a_step_down_errs_toward_the_smaller_tier():
    assert fraction_for(1) is None
    assert fraction_for(2) == 0.5 and fraction_for(3) == pytest.approx(2 / 3)
    assert fraction_for(9) == 0.875  # 8/9 = 0.889 is not reported: the next smaller
    assert fraction_for(40) == 0.95
    assert all(fraction_for(n) in READ_FRACTIONS for n in range(2, 50))


def flat_day_reports(reads_at: float, current: int = 3) -> list[ReplicaReport]:
    """The flat-popularity day at 3 replicas, as its reports read (docs/cluster.md): tiers
    that hold the working set (no re-reads, the per-report set a sample below them) and a
    load two replicas could take under scale_down_utilisation."""
    fraction = fraction_for(current)
    assert fraction is not None
    return [held_set_report(0.3, 0.35, {fraction: reads_at}) for _ in range(current)]


def held_set_report(
    read_s: float, utilisation: float, reads_at: dict[float, float], **demand
) -> ReplicaReport:
    """A replica of 16 slots holding 4 requests, whose tiers hold the working set (no
    re-reads; the per-report set a sample below them), and its demand's projection."""
    return ReplicaReport(
        requests=4,
        slots=16,
        reads_per_s=0.0,
        read_s=read_s,
        utilisation=utilisation,
        set_bytes=2 * MiB,
        tier_bytes=8 * MiB,
        reads_at={fraction_key(f): r for f, r in reads_at.items()},
        **demand,
    )


def test_a_replica_stays_while_its_demand_would_thrash_the_fewer_tiers():
    s = LoraAutoscaling()
    # 3 replicas' demand read 0.8 reads/s each from 2/3 tiers: 2.4 reads/s of 0.3 s on 2
    # replicas is 36% of their time, past read_busy 0.3
    holding = wanted(flat_day_reports(reads_at=0.8), 3, s)
    assert holding.replicas == 3 and "busy reading" in holding.why
    assert step_down_busy(flat_day_reports(reads_at=0.8), 3) == pytest.approx(0.36)
    # 0.2 reads/s each: 9% on two, a step down is fine
    assert wanted(flat_day_reports(reads_at=0.2), 3, s).replicas == 2


def test_the_sketches_merge_into_the_distinct_adapters():
    """Exact while every replica reported all its hashes; past SKETCH_K each, the merged
    K-th smallest hash estimates the distinct count (to ~9%: within 25% here, where 4
    replicas remember 1,500 of 2,000 adapters each)."""
    names = [f"t{i}/a{i}@v1" for i in range(2000)]
    small = [names[:50], names[25:100]]  # 125 remembered, 100 distinct
    exact = [(len(s), frozenset(adapter_hash(a) for a in s)) for s in small]
    assert distinct_adapters(exact) == 100
    rng = np.random.default_rng(3)
    sets = [rng.choice(names, 1500, replace=False) for _ in range(4)]
    sketches = [(len(s), frozenset(sorted(adapter_hash(a) for a in s)[:SKETCH_K])) for s in sets]
    union = len(set().union(*map(set, sets)))
    assert distinct_adapters(sketches) == pytest.approx(union, rel=0.25)
    # a replica's own sketch: how many it remembers, and its SKETCH_K smallest hashes
    demand = AdapterDemand(0.0)
    for i, a in enumerate(names[:300]):
        demand.asked(a, 1, float(i))
    _, (count, hashes) = demand.report(1 << 40, 300.0)
    assert count == 300 and hashes == sorted(adapter_hash(a) for a in names[:300])[:SKETCH_K]
    # forgotten adapters leave it
    assert demand.report(1 << 40, 300.0 + 20 * 600.0)[1] == (0, [])


def overlapping_reports(reads_at: dict[float, float], overlap: float) -> list[ReplicaReport]:
    """The flat-popularity day's evening (docs/cluster.md): four replicas each remembering
    750 adapters, the router having sent each adapter to `overlap` of them on average."""
    distinct = round(4 * 750 / overlap)
    names = [f"a{i}" for i in range(distinct)]
    sets = [[names[(750 * k + j) % distinct] for j in range(750)] for k in range(4)]
    return [
        held_set_report(
            0.8,
            0.4,
            reads_at,
            demand_adapters=750,
            sketch=frozenset(sorted(adapter_hash(a) for a in s)[:SKETCH_K]),
        )
        for s in sets
    ]


def test_adapters_the_replicas_share_are_projected_once():
    """The flat day's evening: four replicas whose demand projected 2.1 reads/s from tiers
    3/4 of their own (0.56 of three replicas' time, past read_busy 0.3), but half of what
    each remembered the others did too (3,020 remembered, 1,997 distinct), and three tiers
    held the whole catalog: four replicas read 0-0.5 a second. Each of three replicas takes
    4/3 of a share of the distinct demand: its own into a tier 3/4 x 1.5 of its own, which
    the replicas' own tiers read 0.02 a second from."""
    s = LoraAutoscaling()
    reads = {0.75: 2.1 / 4, 1.0: 0.08 / 4}
    shared = overlapping_reports(reads, overlap=1.5)
    assert demand_overlap(shared) == pytest.approx(1.5, rel=0.25)
    assert step_down_busy(shared, 4) == pytest.approx(0.08 * 0.8 / 3)
    assert wanted(shared, 4, s).replicas == 3
    # the same demand partitioned (no adapter on two replicas) keeps its fourth replica
    apart = overlapping_reports(reads, overlap=1.0)
    assert demand_overlap(apart) == pytest.approx(1.0, abs=0.01)
    assert step_down_busy(apart, 4) == pytest.approx(2.1 * 0.8 / 3)
    assert wanted(apart, 4, s).replicas == 4
    # before any replica reports a sketch, nothing is shared
    assert demand_overlap([ReplicaReport(requests=1, slots=16, reads_per_s=0, read_s=0)]) == 1.0


def test_an_overlap_reaches_past_the_tier_itself():
    assert fraction_for(4, overlap=1.5) == 1.0  # 3/4 x 1.5 = 1.125: the next smaller
    assert fraction_for(2, overlap=3.0) == 1.5
    assert fraction_for(3, overlap=0.5) == pytest.approx(2 / 3)  # never below no overlap
