"""The benches' figures over repetitions (benchmarks/report.py): the median, and each ratio's
90% bootstrap interval, against the exact bootstrap distribution of a median worked out
with the binomial law, and the merge of a bench's nested figures; and the search for the
fewest replicas holding the SLO (benchmarks/goodput.py) against a threshold."""

from __future__ import annotations

import math

import pytest

from loraplex.benchmarks.report import median_interval, over_repetitions


def _median_cdf(values: list[float], v: float) -> float:
    """P(median of a draw of len(values) with replacement <= v), len odd: at least half
    plus one of the draws are <= v, each with probability p."""
    n = len(values)
    p = sum(x <= v for x in values) / n
    return sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n // 2 + 1, n + 1))


def test_the_interval_is_the_exact_bootstrap_distributions_5_and_95_percent_points():
    values = [3.0, 7.0, 1.0, 5.0, 2.0, 6.0, 4.0]
    # the exact quantiles: the smallest value whose CDF reaches the level (none sits near
    # 0.05 or 0.95, so 10,000 draws find the same: CDF(1) 0.014, CDF(2) 0.10, CDF(5) 0.90,
    # CDF(6) 0.986)
    low = min(v for v in values if _median_cdf(values, v) >= 0.05)
    high = min(v for v in values if _median_cdf(values, v) >= 0.95)
    assert (low, high) == (2.0, 6.0)
    assert median_interval(values) == (4.0, low, high)


def test_two_or_three_repetitions_give_their_range_and_an_infinite_ratio_stays_infinite():
    assert median_interval([1.4, 0.9]) == (1.15, 0.9, 1.4)
    assert median_interval([1.1, 1.3, 0.8]) == (1.1, 0.8, 1.3)
    median, low, high = median_interval([math.inf, 2.0, math.inf])
    assert (median, low, high) == (math.inf, 2.0, math.inf)
    assert median_interval([1.2]) == (1.2, 1.2, 1.2)


def test_nested_figures_merge_into_medians_with_every_ratio_interval():
    reps = [
        {
            "goodput_ratio_vs_best_ray_router": 1.5,
            "goodput_rps": {"affinity": 30.0, "pow2": 20},
            "p99_ttft_s": [0.2, 0.5],
            "reads": 10,
            "recovery_s": None,
            "errors": [],
            "profile": "h100",
        },
        {
            "goodput_ratio_vs_best_ray_router": 1.1,
            "goodput_rps": {"affinity": 22.0, "pow2": 20},
            "p99_ttft_s": [0.4, 0.9],
            "reads": 13,
            "recovery_s": 4.0,
            "errors": ["TimeoutError()"],
            "profile": "h100",
        },
        {
            "goodput_ratio_vs_best_ray_router": None,  # 0 / 0: left out
            "goodput_rps": {"affinity": 0.0, "pow2": 0},
            "p99_ttft_s": [0.3, 0.6],
            "reads": 12,
            "recovery_s": 6.0,
            "errors": [],
            "profile": "h100",
        },
    ]
    out = over_repetitions(reps)
    ratio = "goodput_ratio_vs_best_ray_router"
    assert (out[ratio], out[f"{ratio}_ci_low"], out[f"{ratio}_ci_high"]) == (1.3, 1.1, 1.5)
    assert out["goodput_rps"] == {"affinity": 22.0, "pow2": 20}
    assert out["p99_ttft_s"] == [0.3, 0.6]
    assert out["reads"] == 12 and isinstance(out["reads"], int)
    assert out["recovery_s"] == 5.0  # over the repetitions that have one
    assert out["errors"] == [[], ["TimeoutError()"], []]  # they differ: each one's
    assert out["profile"] == "h100"
    assert not any(k.endswith("_ci_low") for k in out["goodput_rps"])  # not ratios


def test_the_fewest_replicas_holding_the_slo_are_found_with_few_runs():
    from loraplex.benchmarks.goodput import fewest_replicas

    for start in (1, 8, 16):
        for need in range(1, 33):
            runs: list[int] = []

            def holds(n: int, need: int = need, runs: list[int] = runs) -> bool:
                runs.append(n)
                return n >= need

            assert fewest_replicas(holds, start, 32) == need, (start, need)
            assert len(runs) <= 2 * math.ceil(math.log2(32)) + 1, (start, need, runs)
        assert fewest_replicas(lambda n: False, start, 32) is None


def test_a_ratio_undefined_in_every_repetition_still_has_its_interval_keys():
    """0 / 0 in every repetition (no router held the SLO at any rate): the median and its
    interval are None, and the keys are there for readers that expect them."""
    merged = over_repetitions([{"goodput_ratio": None}, {"goodput_ratio": None}])
    assert merged == {
        "goodput_ratio": None,
        "goodput_ratio_ci_low": None,
        "goodput_ratio_ci_high": None,
    }


def test_routers_that_held_the_slo_at_the_top_rate_are_named_and_the_ratio_called_a_bound():
    """A router whose p99 never crossed the SLO gets the grid's top rate as its goodput: two
    such routers read a ratio of 1 whatever they sustain (the router bench of 2026-11-27:
    affinity and multiplexing held at the top rate of every workload, every ratio 1.00)."""
    from loraplex.benchmarks.goodput import comparison, goodput, held_at_top_note

    rates, slo = [10.0, 20.0, 30.0], 1.0
    p99s = {"affinity": [0.2, 0.3, 0.5], "pow2": [0.2, 0.6, 3.0], "multiplex": [0.2, 0.4, 0.9]}
    routers = {
        r: {
            "goodput_at_slo_rps": goodput(rates, p, slo),
            "at_reference": {"load_seconds": 1.0, "loads": 4, "reads": 4, "distinct_adapters": 4},
        }
        for r, p in p99s.items()
    }
    keys = comparison(routers, rates[-1], loads="loads", reads="reads")
    assert keys["goodput_ratio_vs_best_ray_router"] == 1.0
    assert keys["held_slo_at_top_rate"] == {"affinity": True, "pow2": False, "multiplex": True}
    assert "affinity, multiplex" in held_at_top_note(keys)
    # over repetitions a router that held in one of two is said so
    merged = over_repetitions([keys, {**keys, "held_slo_at_top_rate": {"affinity": False}}])
    assert "affinity in 1 of 2" in held_at_top_note(merged)
    assert held_at_top_note({"held_slo_at_top_rate": {"pow2": False}}) == ""


def test_a_miss_that_the_next_rate_holds_is_a_stall_not_the_goodput():
    """One paused run at a low rate used to set a router's goodput for its repetition
    (`bench router` at 13adcf4: multiplexing crossed zipf at 28 req/s, then held at 40 and
    52; it missed shift's lowest rate by 8 ms and held the next two). A miss the next run
    holds is left out; a crossing the next run confirms, or the last rate's miss, stands."""
    from loraplex.benchmarks.goodput import goodput

    rates, slo = [14.0, 28.0, 40.0, 52.0, 68.0], 0.74
    # the zipf repetition: a stall at 28, held at 40 and 52, crossed at 68
    assert goodput(rates, [0.61, 2.25, 0.35, 0.70, 1.66], slo) == pytest.approx(
        52.0 + (0.74 - 0.70) / (1.66 - 0.70) * 16.0
    )
    # the shift repetition: the lowest rate missed by 8 ms, held after it
    assert goodput(rates[:3], [0.748, 0.43, 0.47], slo) == 40.0
    # a run with no completed request is a miss like any other, and a stall if followed
    # by a hold
    assert goodput(rates[:3], [0.5, None, 0.6], slo) == 40.0
    # confirmed crossings: the next run misses too, or nothing runs after the miss
    assert goodput(rates[:3], [0.5, 1.0, 2.0], slo) == pytest.approx(14.0 + 0.24 / 0.5 * 14.0)
    assert goodput(rates[:3], [0.5, 0.6, None], slo) == 28.0
    assert goodput(rates[:2], [0.9, 1.0], slo) == 0.0
    assert goodput(rates[:1], [0.9], slo) == 0.0
