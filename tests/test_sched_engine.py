"""The real engine (demo model, CPU) under each scheduling policy and cache configuration:
a heterogeneous workload finishes (no starvation) and first tokens come in the order the
policy promises."""

from __future__ import annotations

import pytest

from loraplex.demo.assets import DemoAssets
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.memory.adapter_cache import CacheConfig
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.scheduling.chameleon import ChameleonParams
from loraplex.replica.scheduling.fairness import tenant_policies
from loraplex.replica.scheduling.scheduler import SchedulerConfig

PAGE = 64 * 1024
LONG, SHORT = "math-r64", "sql-r8"


def engine(assets: DemoAssets, policy: str, cache: CacheConfig | None = None) -> LLMEngine:
    sched = SchedulerConfig(policy=policy, max_num_seqs=2, chameleon=ChameleonParams(min_samples=8))
    eng = LLMEngine(
        EngineConfig(
            model=str(assets.model),
            page_bytes=PAGE,
            pool_bytes=512 * PAGE,
            scheduler=sched,
            cache=cache or CacheConfig(loading="thread"),
        )
    )
    for name in assets.adapter_names:
        eng.add_adapter(name, assets.adapters_dir / name)
    return eng


def run_workload(eng: LLMEngine) -> tuple[dict[str, int], dict[str, list[int]]]:
    """4 long requests (60-token prompts, 24 tokens out) arrive before 6 short ones (4 in,
    3 out); two batch slots. Returns the step of each request's first token, and tokens."""
    params = {
        "L": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        "S": SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
    }
    for i in range(4):
        eng.add_request(list(range(3 + i, 63 + i)), params["L"], LONG, request_id=f"L{i}")
    for i in range(6):
        eng.add_request([5 + i, 6, 7, 8], params["S"], SHORT, request_id=f"S{i}")
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    for step in range(1000):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            first.setdefault(out.request_id, step)
            if out.finished:
                assert out.finish_reason == "length"
                tokens[out.request_id] = out.token_ids
    assert len(tokens) == 10, f"requests starved: {sorted(set(first) ^ set(tokens))}"
    stats = eng.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["pool"]["kv_pages"] == 0
    eng.pool.check_invariants()
    return first, tokens


def split(first: dict[str, int]) -> tuple[list[int], list[int]]:
    return [v for k, v in first.items() if k[0] == "L"], [
        v for k, v in first.items() if k[0] == "S"
    ]


@pytest.fixture(scope="module")
def fifo_run(assets):
    return run_workload(engine(assets, "fifo"))


def test_fifo_serves_in_arrival_order(fifo_run):
    first, _ = fifo_run
    longs, shorts = split(first)
    assert max(longs) < min(shorts)  # the short requests wait behind every long one


@pytest.mark.parametrize("policy", ["sjf", "chameleon"])
def test_short_requests_go_first_and_nothing_starves(assets, policy, fifo_run):
    eng = engine(assets, policy)
    first, tokens = run_workload(eng)
    longs, shorts = split(first)
    # two long requests hold the slots from the first step; then every short goes ahead of
    # the two longs still waiting
    assert sorted(longs)[2] > max(shorts)
    fifo_longs, fifo_shorts = split(fifo_run[0])
    assert sum(shorts) / len(shorts) < sum(fifo_shorts) / len(fifo_shorts)
    assert tokens == fifo_run[1]  # the same greedy tokens, whatever the order
    if policy == "chameleon":
        [chameleon] = tenant_policies(eng.scheduler.policy)  # one tenant (None)
        assert len(chameleon.queues) >= 2  # clustered into size classes


@pytest.mark.parametrize(
    "cache",
    [
        CacheConfig(loading="sync", eviction="lru"),
        CacheConfig(loading="thread", eviction="gdsf", keep_idle=False, prefetch=4),
        CacheConfig(loading="thread", eviction="equal", low_watermark=0.05, high_watermark=0.1),
    ],
    ids=["sync-lru", "thread-gdsf-nocache-prefetch", "thread-equal-watermarks"],
)
def test_cache_configurations_serve_the_same_tokens(assets, cache, fifo_run):
    eng = engine(assets, "chameleon", cache)
    _, tokens = run_workload(eng)
    assert tokens == fifo_run[1]
    s = eng.adapters.stats
    assert s.loads >= 2 and s.hits + s.misses >= 10
    if not cache.keep_idle:
        assert not eng.adapters.resident  # each adapter left with its last request


def test_a_host_budget_reads_cold_adapters_back_from_disk(assets, fifo_run):
    one = max(
        engine(assets, "fifo").adapters.nbytes_of(n) for n in (LONG, SHORT)
    )  # the budget holds one of the two adapters the workload uses
    eng = engine(assets, "fifo", CacheConfig(loading="thread", host_bytes=one, keep_idle=False))
    assert sum(eng.adapters.tier(n) == "disk" for n in assets.adapter_names) >= 1
    _, tokens = run_workload(eng)
    assert tokens == fifo_run[1]
    assert eng.adapters.stats.disk_reads >= 1 and eng.adapters.stats.host_drops >= 1
