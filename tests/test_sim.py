"""The simulator drives the real scheduler and cache: every request finishes, the numbers
obey what the cost model implies, N replicas share the work (`bench sched`'s keys are
checked in tests/test_bench_smoke.py; its figures come from `loraplex bench sched`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from loraplex.benchmarks.sched import sim as sched_sim
from loraplex.benchmarks.sched import systems as sched_systems
from loraplex.benchmarks.sim.profiles import StepLoad, a40_llama7b, fit_linear
from loraplex.benchmarks.sim.run import simulate
from loraplex.benchmarks.sim.workload import (
    AdapterSpec,
    SimRequest,
    paper_adapters,
    pick_adapters,
    poisson_requests,
    read_trace,
    replay_requests,
)
from loraplex.replica.memory.adapter_cache import CacheConfig
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.scheduling.policy import Admit

PROFILE = a40_llama7b()


def test_a40_profile_matches_the_papers_adapter_size_and_a_decode_step_floor():
    assert PROFILE.adapter_bytes(32) == 64 << 20  # "a rank 32 adapter for Llama-7B is 64 MB"
    # one decode row: reading 13.5 GB of weights at 557 GB/s, about 24 ms, plus overhead
    t = PROFILE.step_time(StepLoad(tokens=1, context=1, token_rank=0, adapter_bytes=0))
    assert 0.02 < t < 0.03
    assert PROFILE.step_time(StepLoad(4096, 4096, 0, 0)) > 0.5  # a full prefill chunk: compute


def test_paper_adapters_and_popularity():
    adapters = paper_adapters(100, PROFILE.adapter_bytes)
    assert [sum(a.rank == r for a in adapters) for r in (8, 16, 32, 64, 128)] == [20] * 5
    picks = pick_adapters(adapters, 20_000, np.random.default_rng(0))
    ranks = np.array([int(p.split("-")[0][1:]) for p in picks])
    assert all(abs((ranks == r).mean() - 0.2) < 0.02 for r in (8, 16, 32, 64, 128))
    r8 = [p for p in picks if p.startswith("r8-")]
    top = r8.count("r8-000") / len(r8)
    assert 0.2 < top < 0.35  # Zipf(1) over 20: 1 / H(20) = 0.28
    with pytest.raises(ValueError, match="multiple of 5"):
        paper_adapters(12, PROFILE.adapter_bytes)


def test_trace_reading_and_time_scaling(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        "2023-11-16 18:15:46.6805900,1000,100\r\n"
        "2023-11-16 18:15:48.6805900,200,10\r\n"
    )
    trace = read_trace(path)
    assert trace.timestamps.tolist() == pytest.approx([0.0, 2.0])
    adapters = [AdapterSpec("a", 8, 1000)]
    reqs = replay_requests(trace, adapters, 2, time_scale=2.0, length_scale=0.5, max_tokens=30)
    assert [(r.arrival, r.prompt, r.output) for r in reqs] == [(0.0, 500, 30), (1.0, 100, 5)]
    assert "synthetic" in read_trace(tmp_path / "missing.csv").source


def _requests(n: int, rate: float) -> tuple[list[SimRequest], list[AdapterSpec]]:
    adapters = paper_adapters(20, PROFILE.adapter_bytes)
    trace = read_trace(None)  # the stated synthetic stand-in: no file needed
    return poisson_requests(trace, adapters, rate, n, 0.25, 1024, seed=1), adapters


@pytest.mark.parametrize("name", list(sched_systems.systems(5.0)))
def test_every_request_finishes_under_every_system(name):
    reqs, adapters = _requests(150, 8.0)
    result = simulate(reqs, PROFILE, sched_systems.systems(5.0)[name], adapters, 4096)
    assert len(result.ttft) == 150 and (result.ttft > 0).all()
    assert (result.e2e >= result.ttft).all()
    assert result.output_tokens == sum(r.output for r in reqs)
    # a request's first token cannot come before its own prefill could run alone
    alone = np.array([PROFILE.step_time(StepLoad(r.prompt, r.prompt, 0, 0)) for r in reqs])
    assert (result.ttft >= 0.5 * alone).all()


def test_the_cache_cuts_loads_and_the_simulation_is_deterministic():
    reqs, adapters = _requests(200, 6.0)
    systems = sched_systems.systems(5.0)
    nocache = simulate(reqs, PROFILE, systems["fifo_nocache"], adapters, 4096)
    cache = simulate(reqs, PROFILE, systems["fifo_cache"], adapters, 4096)
    assert cache.cache["loads"] < nocache.cache["loads"]
    assert cache.cache["bytes_loaded"] < nocache.cache["bytes_loaded"]
    again = simulate(reqs, PROFILE, systems["fifo_cache"], adapters, 4096)
    assert np.array_equal(again.ttft, cache.ttft)


def test_four_replicas_serve_four_times_the_load_about_as_fast_as_one():
    reqs, adapters = _requests(120, 3.0)
    one = simulate(reqs, PROFILE, sched_systems.systems(5.0)["loraplex"], adapters, 4096)
    many, _ = _requests(480, 12.0)
    four = simulate(many, PROFILE, sched_systems.systems(5.0)["loraplex"], adapters, 4096, 4)
    assert np.percentile(four.ttft, 50) < 2 * np.percentile(one.ttft, 50)


def test_linear_fit_recovers_known_coefficients_and_ignores_a_slow_outlier():
    """Every term apart, the LoRA ones and a decode row's included: steps whose LoRA tokens
    are not all their tokens (base-model rows), and prefill steps of many prompt tokens."""
    rng = np.random.default_rng(0)
    truth = (0.002, 1e-5, 2e-7, 3e-7, 5e-4, 4e-5)
    samples = []
    for _ in range(300):
        rows = int(rng.integers(1, 17))
        tokens = rows + int(rng.integers(0, 500))
        adapters = int(rng.integers(0, rows + 1))
        load = StepLoad(
            tokens,
            int(rng.integers(tokens, 5000)),
            int(rng.integers(0, tokens * 64)),
            0,
            adapters=adapters,
            rows=rows,
        )
        x = (1, load.tokens, load.context, load.token_rank, load.adapters, load.rows)
        samples.append((load, float(np.dot(truth, x))))
    samples.append((StepLoad(10, 10, 0, 0, rows=1), 5.0))  # descheduled by another process
    coef, r2 = fit_linear(samples)
    assert coef == pytest.approx(truth, rel=1e-3) and r2 > 0.999


def test_throughput_at_slo_interpolates_the_crossing():
    rows = {"1": {"p99_ttft_s": 1.0}, "2": {"p99_ttft_s": 3.0}, "3": {"p99_ttft_s": 9.0}}
    assert sched_sim.throughput_at_slo(["1", "2", "3"], rows, 5.0) == pytest.approx(2 + 2 / 6)
    assert sched_sim.throughput_at_slo(["1", "2", "3"], rows, 10.0) == 3.0
    assert sched_sim.throughput_at_slo(["1", "2", "3"], rows, 0.5) == 0.0


def test_cache_config_rejects_inverted_watermarks():
    with pytest.raises(ValueError, match="watermarks"):
        CacheConfig(low_watermark=0.3, high_watermark=0.1)
    assert dataclasses.replace(CacheConfig(), prefetch=2).prefetch == 2


def test_chameleons_warm_up_is_a_share_of_the_run_and_its_queues_form_there():
    """The bench clusters after a twentieth of a run's arrivals and at least 4 per queue
    Chameleon may form (k_max 4): 16 in the engine section's 80 and 200-request runs, 60 in
    the simulator's 1200 (a fixed 64 left an 80-request run one FIFO queue until its last
    16). Two request sizes far apart form two queues at that arrival, not before."""
    from loraplex.replica.scheduling.chameleon import Chameleon
    from loraplex.replica.scheduling.queue_math import OutputPredictor
    from loraplex.replica.sequence import Sequence

    warmup = sched_systems.warmup_arrivals
    assert (warmup(80), warmup(200), warmup(500), warmup(1200)) == (16, 16, 25, 60)
    by_system = sched_systems.systems(5.0, run_requests=80)
    for name in ("chameleon", "chameleon_nocache", "loraplex"):
        assert by_system[name].scheduler.chameleon.min_samples == 16
    ch = Chameleon(
        by_system["loraplex"].scheduler.chameleon,
        OutputPredictor(),
        max_len=1000,
        capacity=lambda: 100_000,
        adapter_bytes=lambda name: {"r8": 8, "r64": 64}[name],
        adapter_tokens=lambda name: 0,
        max_adapter_bytes=lambda: 64,
    )

    def arrive(i: int) -> None:
        small = i % 2 == 0
        prompt, out, adapter = (20, 20, "r8") if small else (800, 150, "r64")
        params = SamplingParams(max_tokens=out)
        ch.add(Sequence(str(i), [1] * prompt, params, adapter, 0.0, None), i * 0.1)

    for i in range(15):
        arrive(i)
    ch.admit(1.5, lambda s: Admit.FULL)
    assert ch.cutoffs == [] and len(ch.queues) == 1  # 15 arrivals: still one FIFO queue
    arrive(15)
    ch.admit(1.6, lambda s: Admit.FULL)
    assert len(ch.cutoffs) == 1
    assert [{s.adapter for s in q} for q in ch.queues] == [{"r8"}, {"r64"}]
