"""The replica's own step-cost estimate (replica/step_costs.py), what it publishes to the
router (replica/routing_report.py `measured_costs`) and how it prices the autoscaling
report's tokens (replica/protocol.py `token_utilisation`)."""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest
from test_engine import greedy, make_engine

from loraplex.replica.protocol import token_utilisation
from loraplex.replica.routing_report import measured_costs
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.sequence import Sequence
from loraplex.replica.step_costs import StepCostEstimator, step_rows


def test_the_fit_recovers_a_linear_step_cost():
    rng = random.Random(0)
    est = StepCostEstimator(window=256, min_samples=32)
    for i in range(300):
        prompt, decode, adapters = (
            rng.choice((0, rng.randint(1, 512))),
            rng.randint(1, 64),
            rng.randint(0, 12),
        )
        noise = rng.uniform(-1e-5, 1e-5)
        seconds = 0.002 + 3e-5 * prompt + 2e-4 * decode + 5e-4 * adapters + noise
        est.record_step(prompt, decode, adapters, seconds)
        if i == 30:
            assert est.estimate() is None  # 31 steps: not enough yet
    costs = est.estimate()
    assert costs is not None and costs.samples == 256  # the window keeps the latest
    assert costs.base_s == pytest.approx(0.002, rel=0.05)
    assert costs.per_prompt_token_s == pytest.approx(3e-5, rel=0.02)
    assert costs.per_decode_row_s == pytest.approx(2e-4, rel=0.02)
    assert costs.per_adapter_s == pytest.approx(5e-4, rel=0.02)


# An H100 running Llama-2-7B (benchmarks/sim/profiles.py's roofline): a prompt token is
# 2 x 6.74e9 FLOPs at half of 989 TFLOP/s (~27 µs); a decode row reads its ~1,200 tokens
# of KV, 512 KiB each, at 80% of 3.35 TB/s (~0.23 ms); ~7 ms a step of weights and overhead.
H100_7B = {"base_s": 7e-3, "prompt_token_s": 27e-6, "decode_row_s": 0.23e-3}


@pytest.mark.parametrize("rows, prefill_every", [((2, 8), 4), ((40, 64), 1)])
def test_an_output_token_costs_what_it_costs_in_a_full_batch_however_full_the_steps_ran(
    rows, prefill_every
):
    """The oracle is the step cost the history was drawn from. Lightly loaded, a replica's
    steps hold a few decode rows and now and then a prompt chunk; near full, many rows and a
    chunk in most steps. Either way its report prices an output token at its decode row plus
    a 64-slot batch's share of the fixed cost, and a prompt token at its compute. One cost per
    token of either kind, fitted to these histories, followed the prompt tokens and priced an
    output token at 0.15 ms lightly loaded and 0.30 ms near full (0.34 ms here): a replica's
    utilisation followed how full its batches ran."""
    rng = random.Random(1)
    est = StepCostEstimator()
    for step in range(512):
        prompt = rng.randint(256, 2048) if step % prefill_every == 0 else 0
        decode = rng.randint(*rows)
        seconds = (
            H100_7B["base_s"]
            + H100_7B["prompt_token_s"] * prompt
            + H100_7B["decode_row_s"] * decode
        )
        est.record_step(prompt, decode, 1, seconds * rng.uniform(0.97, 1.03))
    stats = {"step_costs": asdict(est.estimate())}

    def priced(prompt_tokens: int, output_tokens: int) -> float:
        return token_utilisation(
            stats,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            elapsed_s=1.0,
            slots=64,
            adapters=1,
        )

    in_full_batch = H100_7B["decode_row_s"] + H100_7B["base_s"] / 64
    assert priced(0, 1000) / 1000 == pytest.approx(in_full_batch, rel=0.1)
    assert priced(1000, 0) / 1000 == pytest.approx(H100_7B["prompt_token_s"], rel=0.1)


def test_a_step_counts_decode_rows_apart_from_prompt_tokens():
    def seq(prompt: int, computed: int, outputs: int) -> Sequence:
        s = Sequence("r", list(range(prompt)), SamplingParams(), None, 0.0, None)
        s.output_ids, s.num_computed = list(range(outputs)), computed
        return s

    chunk = (seq(100, 40, 0), 60)  # the rest of its prompt: 60 prompt tokens
    decode = (seq(100, 103, 4), 1)  # one token past its prompt
    last_prompt_token = (seq(100, 99, 0), 1)  # its prompt's last token
    recompute = (seq(100, 0, 5), 105)  # preempted: prompt and outputs again
    assert step_rows([chunk, decode, last_prompt_token, recompute]) == (60 + 1 + 105, 1)
    assert step_rows([]) == (0, 0)


def test_costs_never_come_out_negative_and_an_unvaried_column_costs_nothing():
    est = StepCostEstimator(min_samples=3)
    # step time falls as tokens grow (noise on a shared machine): no negative token cost
    for tokens, seconds in ((1, 0.010), (8, 0.009), (16, 0.008), (32, 0.007)):
        est.record_step(tokens, 0, 1, seconds)  # one adapter and no decode row throughout
    costs = est.estimate()
    assert costs.per_prompt_token_s == 0.0
    assert costs.per_decode_row_s == 0.0 and costs.per_adapter_s == 0.0
    assert costs.base_s == pytest.approx(0.0085)


def test_mean_output_length_follows_the_workload():
    est = StepCostEstimator(min_samples=3, output_decay=0.5)
    for n in (10, 10, 30):
        est.record_finished(n)
    for _ in range(3):
        est.record_step(4, 0, 1, 0.01)
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
    fitted = ("base_s", "per_prompt_token_s", "per_decode_row_s", "per_adapter_s")
    assert min(costs[c] for c in fitted) >= 0
    published = measured_costs(stats)
    assert published["busy_cost_s"] == pytest.approx(2 * costs["per_decode_row_s"])
    assert published["prefill_token_cost_s"] == pytest.approx(costs["per_prompt_token_s"])
    mean_load = stats["adapters"]["load_seconds"] / stats["adapters"]["loads"]
    assert published["host_load_cost_s"] == pytest.approx(mean_load + 6.0 * costs["per_adapter_s"])
