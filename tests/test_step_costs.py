"""The replica's own step-cost estimate (replica/step_costs.py) and what it publishes to
the router (replica/routing_report.py `measured_costs`)."""

from __future__ import annotations

import random

import pytest
from test_engine import greedy, make_engine

from loraplex.replica.routing_report import measured_costs
from loraplex.replica.step_costs import StepCostEstimator


def test_the_fit_recovers_a_linear_step_cost():
    rng = random.Random(0)
    est = StepCostEstimator(window=256, min_samples=32)
    for i in range(300):
        tokens, adapters = rng.randint(1, 64), rng.randint(0, 12)
        noise = rng.uniform(-1e-5, 1e-5)
        est.record_step(tokens, adapters, 0.002 + 1e-4 * tokens + 5e-4 * adapters + noise)
        if i == 30:
            assert est.estimate() is None  # 31 steps: not enough yet
    costs = est.estimate()
    assert costs is not None and costs.samples == 256  # the window keeps the latest
    assert costs.base_s == pytest.approx(0.002, rel=0.05)
    assert costs.per_token_s == pytest.approx(1e-4, rel=0.02)
    assert costs.per_adapter_s == pytest.approx(5e-4, rel=0.02)


def test_costs_never_come_out_negative_and_an_unvaried_column_costs_nothing():
    est = StepCostEstimator(min_samples=3)
    # step time falls as tokens grow (noise on a shared machine): no negative token cost
    for tokens, seconds in ((1, 0.010), (8, 0.009), (16, 0.008), (32, 0.007)):
        est.record_step(tokens, 1, seconds)  # one adapter throughout: its cost is unknown
    costs = est.estimate()
    assert costs.per_token_s == 0.0 and costs.per_adapter_s == 0.0
    assert costs.base_s == pytest.approx(0.0085)


def test_mean_output_length_follows_the_workload():
    est = StepCostEstimator(min_samples=3, output_decay=0.5)
    for n in (10, 10, 30):
        est.record_finished(n)
    for _ in range(3):
        est.record_step(4, 1, 0.01)
    assert est.estimate().mean_output_tokens == 20.0  # 10, 10, then halfway to 30


def test_the_engine_measures_its_steps_and_the_replica_publishes_router_costs(assets):
    eng = make_engine(assets, *assets.adapter_names[:3])
    assert eng.stats()["step_costs"] is None and measured_costs(eng.stats()) == {}
    prompts = ["The quick brown fox", "def add(a, b):", "The morning train"]
    for i in range(9):
        adapter = [None, *assets.adapter_names[:3]][i % 4]
        eng.generate([prompts[i % 3]], [greedy(6, ignore_eos=True)], [adapter])
    stats = eng.stats()
    costs = stats["step_costs"]
    assert costs["samples"] >= 32 and costs["mean_output_tokens"] == pytest.approx(6.0)
    assert min(costs["base_s"], costs["per_token_s"], costs["per_adapter_s"]) >= 0
    published = measured_costs(stats)
    assert published["busy_cost_s"] == pytest.approx(2 * costs["per_token_s"])
    mean_load = stats["adapters"]["load_seconds"] / stats["adapters"]["loads"]
    assert published["host_load_cost_s"] == pytest.approx(mean_load + 6.0 * costs["per_adapter_s"])
