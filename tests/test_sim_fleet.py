"""The fleet simulator: its timings against the cost model worked out by hand, every request
finishing (a killed replica's too), determinism per seed, the multiplexed replicas' LRU, and
`bench fleet` reporting every key on a tiny shape (its figures come from the bench)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from loraplex.benchmarks.fleet import bench as bench_fleet
from loraplex.benchmarks.fleet import workloads as fw
from loraplex.benchmarks.sim.fleet import ROUTERS, FleetSetup, FleetSim, simulate_fleet
from loraplex.benchmarks.sim.fleet_replica import StoreLink, StoreModel
from loraplex.benchmarks.sim.profiles import GiB, StepLoad, gpu_profile
from loraplex.benchmarks.sim.replica import SimClock, System
from loraplex.benchmarks.sim.workload import SimRequest, read_trace
from loraplex.replica.memory.adapter_cache import CacheConfig
from loraplex.replica.scheduling.scheduler import SchedulerConfig
from loraplex.router.policy import AffinityConfig

PROFILE = gpu_profile("h100", "llama2-7b")
STORE = StoreModel(bytes_per_s=1e9, latency_s=0.02)
SCHED = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096, max_loras_per_batch=16)


def setup(replicas: int = 4, **extra) -> FleetSetup:
    values = {
        "profile": PROFILE,
        "num_replicas": replicas,
        "system": System("fifo", SCHED, CacheConfig(loading="thread", host_bytes=8 * GiB)),
        "store": STORE,
        "affinity": AffinityConfig(load_cost_s=0.2, host_load_cost_s=0.005, request_time_s=4.0),
        "max_ongoing_requests": 64,
        "models_per_replica": 8,
        **extra,
    }
    return FleetSetup(**values)


def catalog(n: int = 40):
    adapters = fw.catalog(n, PROFILE.adapter_bytes)
    return adapters, {a.name: a for a in adapters}


def stream(adapters, n: int = 300, rate: float = 30.0, workload: str = "zipf", seed: int = 1):
    lengths = fw.Lengths(prompt=(200, 600), output=(20, 80))
    return fw.requests(workload, [a.name for a in adapters], n, rate, lengths, seed=seed)


def test_store_reads_queue_one_after_another_after_their_latency():
    clock = SimClock()
    link = StoreLink(StoreModel(bytes_per_s=100.0, latency_s=1.0), clock)
    link.submit("a", 200)  # 1 s latency, 2 s of bytes: done at 3
    clock.now = 0.5
    link.submit("b", 100)  # its latency ends at 1.5, but the stream is busy until 3: done at 4
    assert link.next_done() == pytest.approx(3.0)
    clock.now = 3.0
    assert link.done() == ["a"]
    clock.now = 4.0
    assert link.done() == ["b"] and link.next_done() is None


@pytest.mark.parametrize("router", ROUTERS)
def test_a_lone_request_costs_the_read_the_copy_and_the_prefill(router):
    """On an idle fleet a request's TTFT is what the cost model gives by hand: the read from
    the store, the copy over the host link, the prefill step (one chunk)."""
    adapters, by_name = catalog(5)
    a = adapters[3]
    req = SimRequest(0, 0.0, 500, 1, 16, a.name)
    run = simulate_fleet(router, [req], by_name, setup())
    read = STORE.latency_s + a.nbytes / STORE.bytes_per_s
    copy = PROFILE.load_setup_s + a.nbytes / PROFILE.link_bytes_per_s
    prefill = PROFILE.step_time(StepLoad(500, 500, 500 * a.rank, a.nbytes))
    assert run.ttft[0] == pytest.approx(read + copy + prefill, rel=1e-6)
    assert run.counters["store_reads"] == 1 and run.counters["device_loads"] == 1
    # the engines' busy time, as a real engine counts it (one forward pass: the prefill)
    assert run.counters["steps"] == 1 and run.counters["step_rows"] == 1
    assert run.counters["step_seconds"] == pytest.approx(prefill, rel=1e-6)


@pytest.mark.parametrize("router", ROUTERS)
def test_the_paths_latency_is_added_to_each_first_token_as_a_measured_draw(router):
    """`FleetSetup.path_s`: what the real path adds to a first token without the replicas'
    CPU (fleet/validation.py `path_latency`), one draw per request from the samples; the
    replicas' own timing is unchanged, and every router gets the same draws."""
    adapters, by_name = catalog()
    reqs = stream(adapters, n=100)
    bare = simulate_fleet(router, reqs, by_name, setup())
    one = simulate_fleet(router, reqs, by_name, setup(path_s=(0.05,)))
    assert np.allclose(one.ttft, bare.ttft + 0.05) and np.allclose(one.e2e, bare.e2e + 0.05)
    two = simulate_fleet(router, reqs, by_name, setup(path_s=(0.0, 0.1)))
    added = np.round(two.ttft - bare.ttft, 9)
    assert set(added) == {0.0, 0.1} and 0.2 < np.mean(added == 0.1) < 0.8
    draws = np.random.default_rng(setup().seed).choice((0.0, 0.1), len(reqs))
    assert np.allclose(added, draws)
    with pytest.raises(ValueError, match="path_s"):
        setup(path_s=(-0.01,))


def test_the_path_latency_is_the_lone_requests_real_ttft_less_the_simulated_one():
    """Each lone base-model request's TTFT through the real app, less what the simulated
    replica gives the same request alone (one prefill step on the profile); none below 0,
    and nothing for a run that did not measure it."""
    from loraplex.benchmarks.fleet.validation import path_latency
    from loraplex.benchmarks.router import bench as bench_router

    w = bench_router.QUICK
    prompt = sum(w.prompt_tokens) // 2
    own = PROFILE.step_time(StepLoad(prompt, prompt, 0, 0))
    lone = [own + 0.010, own + 0.030, own - 0.001]
    assert path_latency(lone, PROFILE, w) == pytest.approx((0.010, 0.030, 0.0), abs=1e-9)
    assert path_latency(None, PROFILE, w) == () and path_latency([], PROFILE, w) == ()


def test_the_loaded_path_is_the_calibration_streams_real_ttft_less_the_simulated_by_quantile():
    """`loaded_path`: the calibration stream (base-model requests at the validated rate,
    before the repetitions) replayed on the setup; the i-th shortest real TTFT less the i-th
    shortest simulated one, none below 0, failed requests left out on both sides, and the
    lone requests' path kept for a router or a run that did not measure it."""
    from loraplex.benchmarks.fleet.validation import loaded_path

    base = [dataclasses.replace(r, adapter=None) for r in stream(catalog(4)[0], n=60)]
    lone = setup(path_s=(0.004,))
    sim = simulate_fleet("pow2", base, {}, setup()).ttft
    offsets = np.linspace(0.0, 0.05, len(base))  # the longest simulated gets the most added
    real = (sim + offsets[np.argsort(np.argsort(sim))]).tolist()
    real[0] = None  # failed: out on both sides
    loaded = {
        "rate_rps": 30.0,
        "requests": [[r.arrival, r.prompt, r.output, r.max_tokens] for r in base],
        "ttft_s": {"pow2": real},
    }
    path = loaded_path(loaded, "pow2", lone)
    served = np.sort(sim[1:] + offsets[np.argsort(np.argsort(sim))][1:])
    assert path == pytest.approx(tuple(np.maximum(0.0, served - np.sort(sim[1:]))), abs=1e-12)
    assert len(path) == len(base) - 1 and max(path) > 0.04 and min(path) >= 0.0
    faster = {**loaded, "ttft_s": {"pow2": [None, *(sim[1:] - 1.0).tolist()]}}
    assert set(loaded_path(faster, "pow2", lone)) == {0.0}
    assert loaded_path(loaded, "affinity", lone) == (0.004,)
    assert loaded_path(None, "pow2", lone) == (0.004,)


def test_the_ranked_path_adds_the_calibrations_longest_paths_to_the_longest_waits():
    """`ranked_path`: the request at quantile q of the simulated TTFTs gets the path at q
    (ties in arrival order), whatever the two lengths; no path adds nothing."""
    from loraplex.benchmarks.fleet.validation import ranked_path

    ttft = np.array([0.30, 0.01, 0.02, 0.10, 0.02])
    path = (0.0, 0.0, 0.1, 0.2, 0.5)
    assert ranked_path(ttft, path) == pytest.approx([0.80, 0.01, 0.02, 0.30, 0.12])
    longer = tuple(np.linspace(0.0, 1.0, 101))  # quantiles 0, 0.25, ..., 1 -> 0, 0.25, ...
    assert ranked_path(ttft, longer) - ttft == pytest.approx([1.0, 0.0, 0.25, 0.75, 0.5])
    assert ranked_path(ttft, ()) is ttft


def test_the_validation_sets_the_real_engines_step_seconds_beside_the_simulated():
    """`step_seconds_ratio`: the median over routers of the real engines' forward-pass
    seconds over the simulated ones' in the same window; a router either side did not
    count is left out, and with none there is no ratio."""
    from loraplex.benchmarks.fleet.validation import _ratio

    routers = {
        "affinity": {"real_step_seconds": 6.0, "sim_step_seconds": 2.0},
        "pow2": {"real_step_seconds": 4.0, "sim_step_seconds": 2.0},
        "multiplex": {"real_step_seconds": 2.5, "sim_step_seconds": 1.0},
        "old": {"real_step_seconds": None, "sim_step_seconds": 1.0},  # a run before the count
        "idle": {"real_step_seconds": 1.0, "sim_step_seconds": 0.0},
    }
    assert _ratio(routers, "step_seconds") == pytest.approx(2.5)
    assert _ratio({"old": routers["old"]}, "step_seconds") is None
    charged = {"a": {"real_step_seconds": 6.0, "sim_step_seconds": 2.0, "with": 4.0}}
    assert _ratio(charged, "step_seconds", sim="with") == pytest.approx(1.5)


def test_the_validation_compares_the_means_over_the_repetitions():
    """Each repetition side by side (`_side_by_side`: the simulated step seconds less the
    streamed tokens' charge on every row), then each figure's mean over the repetitions; a
    figure one repetition lacks has no mean, and the error is taken on the means."""
    from loraplex.benchmarks.fleet.validation import _error, _mean_over, _side_by_side

    def real(p99: float, seconds: float | None) -> dict:
        return {"p99_ttft_s": p99, "p50_ttft_s": p99 / 4, "loads": 10, "reads": 5,
                "steps": 100, "step_seconds": seconds}  # fmt: skip

    def sim(p99: float) -> dict:
        return {"p99_ttft_s": p99, "p50_ttft_s": p99 / 4, "device_loads": 12,
                "store_reads": 5, "steps": 90, "step_seconds": 3.0, "step_rows": 200}  # fmt: skip

    first = {"a": _side_by_side(real(1.0, 2.0), sim(0.5), 0.01)}
    second = {"a": _side_by_side(real(3.0, None), sim(2.5), 0.01)}
    assert first["a"]["sim_step_seconds"] == pytest.approx(1.0)  # 3.0 - 0.01 x 200
    assert first["a"]["sim_step_seconds_with_stream"] == 3.0
    (means,) = _mean_over([first, second]).values()
    assert means["real_p99_ttft_s"] == 2.0 and means["sim_p99_ttft_s"] == 1.5
    assert means["sim_loads"] == 12 and means["real_step_seconds"] is None
    assert _error({"a": means}, "p99_ttft_s") == pytest.approx(0.25)  # not 0.5 and 0.17


def test_the_replay_at_the_real_step_speed_slows_the_engine_not_the_stream():
    """`_at_speed`: every step coefficient of the contended profile x the factor, and the
    streamed tokens' charge added to the row term, unscaled unless asked (the replay at the
    real step speed takes it for Serve's, paid outside the steps; the replay at the real
    busy time slows the whole simulated step, charge included)."""
    from loraplex.benchmarks.fleet.validation import _at_speed
    from loraplex.benchmarks.sim.profiles import LinearProfile

    profile = LinearProfile(
        "cpu", "", {}, 1 << 20, 1 << 16, 1e9, 0.0, (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    )
    assert _at_speed(profile, 0.5, 2.0).coef == (2.0, 4.0, 6.0, 8.0, 10.0, 12.5)
    assert _at_speed(profile, 0.0).coef == profile.coef
    assert _at_speed(profile, 0.5, 2.0, 2.0).coef == (2.0, 4.0, 6.0, 8.0, 10.0, 13.0)


@pytest.mark.parametrize("router", ROUTERS)
def test_every_request_finishes_and_a_run_repeats_exactly(router):
    adapters, by_name = catalog()
    reqs = stream(adapters)
    first = simulate_fleet(router, reqs, by_name, setup()).summary()
    again = simulate_fleet(router, reqs, by_name, setup()).summary()
    assert first["completed"] == len(reqs) and first["streams_failed"] == 0
    assert first == again


def test_affinity_keeps_an_adapter_where_it_is_and_power_of_two_spreads_it():
    adapters, by_name = catalog(5)
    reqs = [SimRequest(i, 0.5 * i, 100, 4, 16, adapters[0].name) for i in range(40)]
    where = {}
    for router in ("affinity", "pow2"):
        run = simulate_fleet(router, reqs, by_name, setup())
        where[router] = Counter(run.replica)
    assert len(where["affinity"]) == 1
    assert len(where["pow2"]) >= 3  # uniform over 4 replicas, 40 draws


def test_a_killed_replica_loses_no_request_and_is_replaced():
    adapters, by_name = catalog()
    reqs = stream(adapters, n=400, rate=40.0)
    kill = fw.kill_at(reqs)
    sim = FleetSim("affinity", reqs, by_name, setup(kill_at_s=kill, replace_after_s=2.0))
    run = sim.run()
    assert run.streams_failed == 0 and len(run.ttft) == len(reqs)
    assert run.streams_resumed > 0  # begun streams finished elsewhere
    # a resumed stream keeps its first token's time, and ends after the kill elsewhere
    resumed = [
        i
        for i, (a, t, e) in enumerate(zip(run.arrival, run.ttft, run.e2e, strict=True))
        if a + t < kill < a + e and run.replica[i] != sim.dead[0].replica_id
    ]
    assert len(resumed) >= run.streams_resumed
    assert len(sim.dead) == 1 and len(sim.replicas) == 4
    assert any(r.arrival > kill + 2.0 for r in reqs)
    late = {
        rep for rep, arrival in zip(run.replica, run.arrival, strict=True) if arrival > kill + 3
    }
    assert sim.dead[0].replica_id not in late
    assert f"replica-{4}" in late  # the replacement serves


def test_requests_without_a_first_token_on_a_killed_replica_are_retried():
    """Just before the kill, one request of every adapter: each replica then has requests
    queued behind its store reads, without a first token, when one of them dies. Those are
    sent again (Serve's retry), and every request finishes."""
    adapters, by_name = catalog()
    reqs = stream(adapters, n=400, rate=40.0)
    kill = fw.kill_at(reqs)
    burst = [
        dataclasses.replace(reqs[0], rid=len(reqs) + i, arrival=kill - 0.01, adapter=a.name)
        for i, a in enumerate(adapters)
    ]
    reqs = sorted(reqs + burst, key=lambda r: r.arrival)
    for router in ("affinity", "pow2", "multiplex"):
        run = FleetSim(router, reqs, by_name, setup(kill_at_s=kill, replace_after_s=2.0)).run()
        assert run.retried > 0, router
        assert run.streams_failed == 0 and len(run.ttft) == len(reqs), router


def test_multiplexed_replicas_evict_least_recently_used_models():
    adapters, by_name = catalog(30)
    reqs = stream(adapters, n=300, rate=20.0, workload="zipf")
    tight = simulate_fleet("multiplex", reqs, by_name, setup(models_per_replica=2))
    roomy = simulate_fleet("multiplex", reqs, by_name, setup(models_per_replica=30))
    assert tight.counters["multiplexed_loads"] > roomy.counters["multiplexed_loads"]
    assert roomy.counters["multiplexed_loads"] <= tight.distinct_adapters * 4


def test_hot_workload_and_shift_change_who_is_popular():
    names = [f"a{i}" for i in range(100)]
    lengths = fw.Lengths()
    hot = fw.requests("hot", names, 4000, 10.0, lengths, seed=3)
    top, count = Counter(r.adapter for r in hot).most_common(1)[0]
    assert 0.47 < count / len(hot) < 0.53
    shift = fw.requests("shift", names, 4000, 10.0, lengths, seed=3)
    before = Counter(r.adapter for r in shift[:2000]).most_common(5)
    after = Counter(r.adapter for r in shift[2000:]).most_common(5)
    assert not {a for a, _ in before} & {a for a, _ in after}
    warm = fw.requests("zipf", names, 4000, 10.0, lengths, seed=9)  # another stream, same order
    assert Counter(r.adapter for r in warm).most_common(1)[0][0] == before[0][0]


def test_bench_fleet_reports_every_key_on_a_tiny_shape():
    tiny = dataclasses.replace(
        bench_fleet.QUICK,
        replicas=2,
        adapters=20,
        window_s=3.0,
        warmup_per_adapter=2,
        rate_factors=(0.3, 0.6),
        reference_factor=0.3,
        scale_points=((2, 20),),
        scale_window_s=2.0,
        repeats=2,
    )
    out = bench_fleet.measure(tiny, None)
    for name in fw.WORKLOADS:
        w = out["workloads"][name]
        for key in (
            "goodput_ratio_vs_best_ray_router",
            "goodput_ratio_vs_best_ray_router_ci_low",
            "goodput_ratio_vs_best_ray_router_ci_high",
            "load_seconds_ratio_vs_best_ray_router",
            "load_seconds_ratio_vs_best_ray_router_ci_low",
            "reads_ratio_vs_multiplex",
            "loads_vs_floor",
            "slo_s",
            "goodput_rps",
            "placement_miss_rate",
            "host_hits",
            "distinct_adapters_held",
        ):
            assert key in w, (name, key)
        assert set(w["routers"]) == set(ROUTERS)
        # each repetition is its own seed: its own stream, so its own figures
        first, second = w["repetitions"]
        assert first["goodput_rps"] != second["goodput_rps"] or first["reads"] != second["reads"]
        ratios = [r["goodput_ratio_vs_best_ray_router"] for r in w["repetitions"]]
        if None not in ratios:
            low, high = min(ratios), max(ratios)
            assert w["goodput_ratio_vs_best_ray_router_ci_low"] == low, name
            assert w["goodput_ratio_vs_best_ray_router_ci_high"] == high, name
    for name in bench_fleet.REPLICAS_NEEDED_WORKLOADS:
        w = out["workloads"][name]
        assert set(w["replicas_needed"]) == set(ROUTERS)
        assert "replicas_needed_ratio_vs_best_ray_router_ci_low" in w
        for rep in w["repetitions"]:
            needed = rep["replicas_needed"]
            assert all(n is None or 1 <= n <= 4 * tiny.replicas for n in needed.values())
            ray = [needed[r] for r in ("pow2", "multiplex") if needed[r] is not None]
            if needed["affinity"] is not None and ray:
                ratio = rep["replicas_needed_ratio_vs_best_ray_router"]
                assert ratio == needed["affinity"] / min(ray), (name, needed)
    fail = out["workloads"]["failover"]
    assert fail["requests_lost"] == 0 and set(fail["streams_failed"]) == set(ROUTERS)
    assert out["repeats"] == 2
    assert out["scale"]["points"][0]["replicas"] == 2
    assert "p99_ratio_best_ray_over_affinity_ci_low" in out["scale"]["points"][0]
    eviction = out["eviction"]
    factor = bench_fleet.NODE_HOST_BYTES // bench_fleet.HOST_BYTES
    assert eviction["adapters"] == factor * tiny.adapters
    assert eviction["host_bytes_per_replica"] == factor * tiny.host_bytes
    assert set(eviction["routers"]) == set(ROUTERS)
    for figures in eviction["routers"].values():
        assert {"evictions", "host_hits", "store_reads", "device_loads"} <= set(figures)
    assert "reads_ratio_vs_multiplex_ci_low" in eviction
    assert "synthetic" in read_trace(None).source  # the stated stand-in without a trace


def test_a_cold_adapter_is_read_once_per_first_use_with_a_full_host_tier():
    """One replica whose host tier holds the largest adapter; eight adapters each requested
    once, one after another: one store read each (the read for the first use; the cache
    kept the copy it made for that request instead of dropping it first, as never used,
    and reading it again)."""
    adapters, by_name = catalog(8)
    host = max(a.nbytes for a in adapters)
    system = System("fifo", SCHED, CacheConfig(loading="thread", host_bytes=host))
    reqs = [SimRequest(i, 2.0 * i, 100, 4, 16, a.name) for i, a in enumerate(adapters)]
    run = simulate_fleet("affinity", reqs, by_name, setup(replicas=1, system=system))
    assert run.counters["host_drops"] >= 3  # the tier was full
    assert run.counters["store_reads"] == len(adapters)


def test_simulated_replicas_publish_what_a_replica_deployment_publishes(assets):
    """The same keys as the deployment's `record_routing_stats` over a real engine (both
    through replica/routing_report.py), measured costs included once steps were seen."""
    from loraplex.replica.config import EngineConfig
    from loraplex.replica.engine import LLMEngine
    from loraplex.replica.routing_report import routing_stats
    from loraplex.replica.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(assets.model), pool_bytes=64 << 20))
    engine.add_adapter("a", assets.adapters_dir / assets.adapter_names[0])
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True), "a")
    while engine.has_unfinished():
        engine.step()
    real = routing_stats(
        engine.stats(),
        reading=(),
        read_s=0.1,
        in_flight=0,
        adapter_queue={},
        max_concurrency=8,
        recorded_at=0.0,
    )
    real = set(real) - {"prefix_block_size", "prefix_share_base"} | {"requests_total"}
    adapters, by_name = catalog(5)
    sim = FleetSim("affinity", stream(adapters, n=120), by_name, setup(replicas=1))
    sim.run()
    assert set(sim.replicas["replica-0"].routing_stats()) == real


def test_placement_misses_count_predicted_holders_that_read_from_the_store():
    """A second request of an adapter, sent once the replica's stats show it on the device,
    was predicted held and read nothing; power of two has no view and predicts nothing; a
    replica that keeps nothing is never shown holding it, so its reads are no misses."""
    adapters, by_name = catalog(5)
    a = adapters[0].name
    reqs = [SimRequest(i, 5.0 * i, 100, 4, 16, a) for i in range(3)]
    run = simulate_fleet("affinity", reqs, by_name, setup(replicas=1))
    s = run.summary()
    assert s["predicted_held"] == 2 and s["placement_miss_rate"] == 0.0
    assert s["distinct_adapters_held"] == 1 and s["store_reads"] == 1
    assert s["host_hits"] == 0  # one device load, from the copy read for the first request
    # Evicted from the device after each request, kept in the host tier: two host hits.
    idle_out = System("fifo", SCHED, CacheConfig(loading="thread", keep_idle=False))
    s = simulate_fleet("affinity", reqs, by_name, setup(replicas=1, system=idle_out)).summary()
    assert s["store_reads"] == 1 and s["device_loads"] == 3 and s["host_hits"] == 2
    assert (
        simulate_fleet("pow2", reqs, by_name, setup(replicas=1)).summary()["placement_miss_rate"]
        is None
    )
    no_host = System("fifo", SCHED, CacheConfig(loading="thread", host_bytes=1, keep_idle=False))
    s = simulate_fleet("affinity", reqs, by_name, setup(replicas=1, system=no_host)).summary()
    assert s["store_reads"] >= 3 and s["placement_miss_rate"] is None  # never shown held


def test_a_request_behind_a_re_read_in_the_simulated_engine_is_not_held_up():
    """The simulated replica's engine is the real scheduler: a request whose adapter's host
    copy was dropped waits for its re-read from the store (~0.29 s for rank 128) aside,
    and a request of another adapter queued behind it starts at once."""
    adapters, by_name = catalog(5)
    big, small = adapters[4], adapters[0]  # rank 128 and rank 8
    host = big.nbytes  # both do not fit: the older copy (big's) is dropped
    system = System("fifo", SCHED, CacheConfig(loading="thread", host_bytes=host, keep_idle=False))
    reqs = [
        SimRequest(0, 0.0, 100, 2, 16, big.name),
        SimRequest(1, 2.0, 100, 2, 16, small.name),
        SimRequest(2, 4.0, 100, 2, 16, big.name),  # re-read inside the engine
        SimRequest(3, 4.001, 100, 2, 16, small.name),  # from the host tier: a copy
    ]
    run = simulate_fleet("affinity", reqs, by_name, setup(replicas=1, system=system))
    reread = STORE.latency_s + big.nbytes / STORE.bytes_per_s
    assert run.counters["store_reads"] == 3
    assert run.ttft[2] >= reread and run.ttft[3] < reread / 4


def test_affinity_estimates_a_saturated_replicas_wait_from_how_fast_it_drains():
    """Offered 3 x what two replicas serve, told a request holds a slot 50 ms where it holds
    it ~1 s (as `bench router` measures request_time_s on an idle engine): the TTFT affinity
    estimates on the replica it chose is about what the request then waited there (from
    leaving the router to its first token), since the stats say how fast each drains.
    Priced by request_time_s it was a quarter of it."""
    adapters, by_name = catalog(8)
    config = AffinityConfig(load_cost_s=0.2, host_load_cost_s=0.005, request_time_s=0.05)
    run = simulate_fleet(
        "affinity", stream(adapters, 600, 150.0), by_name, setup(2, affinity=config)
    )
    at_replica = run.ttft - (run.routed_at - run.arrival)
    queued = at_replica > 0.5  # those that waited for a slot
    assert queued.sum() > 100
    ratio = np.median(run.estimated_ttft[queued]) / np.median(at_replica[queued])
    assert 0.5 < ratio < 2.0, ratio


@pytest.mark.slow
def test_the_router_benchs_json_replays_in_the_simulator_at_its_rates():
    """`bench router`'s published run, replayed (benchmarks/fleet/validation.py
    `replay_bench`): its shape, capacity and costs, its seeds' streams, every router; the
    LoRA workload's burst capacity is below the base-model burst's the rates are fractions
    of, since its requests pay reads, loads and adapter segments besides the same work."""
    import json
    from pathlib import Path

    from loraplex.benchmarks.fleet.validation import replay_bench

    figures = json.loads((Path(__file__).parents[1] / "docs/bench/router.json").read_text())
    out = replay_bench(figures, ("zipf",), (0.35,), repeats=1)
    for router in ROUTERS:
        assert 0 < out["lora_capacity_rps"][router] < out["capacity_rps"]
        (run,) = out["workloads"]["zipf"][router]["0.35"]
        assert 0 <= run["within_slo"] <= 1 and run["p50_ttft_s"] <= run["p99_ttft_s"]
        assert ("estimate_p50_s" in run) == (router == "affinity")


def test_the_replayed_bench_stream_warms_the_catalog_as_the_bench_does():
    """`replay_bench`'s stream starts with `bench router`'s own warm-up (each adapter of the
    catalog once, in the sweep's seeded order), so a replayed run pays no store read the
    real run did not: a warm-up drawn from the popularity left ~40 of 120 adapters unread."""
    from loraplex.benchmarks.fleet.validation import BenchLike, _bench_stream
    from loraplex.benchmarks.router import bench as bench_router

    w = bench_router.QUICK
    names = [f"a{i}" for i in range(w.num_adapters)]
    b = BenchLike(w, None, {}, names, 40.0, 1.0, 20.0)  # type: ignore[arg-type]
    for rep, workload in ((0, "zipf"), (1, "shift")):
        stream, first = _bench_stream(b, workload, rep, 0, 10.0, 20.0)
        warm = stream[:first]
        assert sorted(r.adapter for r in warm) == sorted(names)
        index = fw.WORKLOADS.index(workload)
        expected = bench_router.warm_up(names, w.rate_factors[0] * 20.0, 10 * index + 100_000 * rep)
        assert [r.adapter for r in warm] == [r.adapter for r in expected]
        assert min(r.arrival for r in stream[first:]) > max(r.arrival for r in warm)


def test_a_published_router_run_replays_on_the_rate_grid_it_ran():
    """A run recorded before the grid changed (the quick grid gained 0.85 and 1.15 on
    2026-12-06) replays its own rates, whose positions seed its streams."""
    from loraplex.benchmarks.fleet.validation import published_workload
    from loraplex.benchmarks.router import bench as bench_router

    old = {
        "quick": True,
        "workload": {"rate_factors": [0.35, 0.7, 1.0, 1.3], "reference_factor": 0.35},
    }
    assert published_workload(old).rate_factors == (0.35, 0.7, 1.0, 1.3)
    assert published_workload(old).num_adapters == bench_router.QUICK.num_adapters
    assert published_workload({"quick": False}) == bench_router.FULL


@pytest.mark.parametrize("quick", [True, False])
def test_the_validation_runs_the_router_bench_at_its_reference_rate_alone(quick: bool):
    """The bench's repetitions at the reference rate, each of which the simulator replays;
    no rate past the grid, where a sweep goes while a router holds the SLO."""
    from loraplex.benchmarks.fleet.validation import validation_workload
    from loraplex.benchmarks.router import bench as bench_router

    w = validation_workload(quick)
    base = bench_router.QUICK if quick else bench_router.FULL
    assert w.all_rate_factors == (base.reference_factor,) and w.repeats == base.repeats > 1
    assert w.loaded_path_runs >= 3 and not base.loaded_path_runs  # what the bench skips
