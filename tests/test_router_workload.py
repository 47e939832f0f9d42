"""`bench router`'s shape is in the regime the router exists for (the issue's definition): a
catalog larger than one replica's host tier and no larger than the fleet's. Outside it there
is no store read for routing to avoid (all fit in one tier) or none it can avoid (the tail is
held nowhere)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loraplex.benchmarks.router.bench import FULL, QUICK, host_tier


@pytest.mark.parametrize("w", [QUICK, FULL], ids=["quick", "full"])
def test_the_bench_catalog_outgrows_one_host_tier_and_fits_the_fleet_less_one(w):
    one = w.host_adapters_per_replica
    assert one < w.num_adapters <= (w.num_replicas - 1) * one


@pytest.mark.parametrize(
    ("adapters", "replicas", "host"),
    [(120, 3, 24), (120, 3, 120), (10, 2, 4)],
    ids=["tail-held-nowhere", "one-tier-holds-all", "small-tail-held-nowhere"],
)
def test_a_shape_outside_the_regime_is_refused(adapters, replicas, host):
    w = replace(QUICK, num_adapters=adapters, num_replicas=replicas, host_adapters_per_replica=host)
    with pytest.raises(ValueError, match="larger than one replica's host tier"):
        w.check_routing_regime()


def test_the_prefix_section_builds_its_workload_over_the_same_replicas():
    """Its 16 tenants' adapters fit one host tier: the regime is the comparison's, not its
    (the first run with the check in Workload itself failed there, after the comparison)."""
    from loraplex.benchmarks.router import prefix

    for base, quick in ((QUICK, True), (FULL, False)):
        w = prefix.workload(base, quick)
        assert w.base.num_adapters == prefix.TENANTS <= w.base.host_adapters_per_replica


def test_host_tier_is_the_catalog_over_all_replicas_but_one():
    assert [host_tier(120, n) for n in (2, 3, 4, 5)] == [120, 60, 40, 30]


def test_rates_past_the_grid_must_ascend_from_its_top():
    with pytest.raises(ValueError, match="must ascend"):
        replace(QUICK, extra_rate_factors=(1.2, 1.7))  # QUICK's grid tops at 1.3
    assert replace(QUICK, extra_rate_factors=(1.7,)).all_rate_factors[-2:] == (1.3, 1.7)


def test_each_router_takes_each_place_once_a_rotation_and_bursts_must_be_positive():
    """The repetitions and the LoRA capacity bursts rotate the routers' order: over three
    rounds each router runs first, second and last once."""
    routers = ("affinity", "pow2", "multiplex")
    orders = [QUICK.rotated(routers, k) for k in range(3)]
    assert orders[0] == routers and orders[1] == ("pow2", "multiplex", "affinity")
    for place in range(3):
        assert sorted(order[place] for order in orders) == sorted(routers)
    assert QUICK.rotated(routers, 3) == routers
    assert QUICK.capacity_bursts == 3
    with pytest.raises(ValueError, match="capacity_bursts must be > 0"):
        replace(QUICK, capacity_bursts=0)
