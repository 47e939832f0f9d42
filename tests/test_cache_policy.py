"""Adapter-cache policies on hand-built cases: the eviction order of each score (worked
out by hand), pinned adapters never evicted, queued ones kept unless memory forces it,
watermark hysteresis, bounded prefetch, asynchronous loads and the host tier's budget.
The pool is a real UnifiedPool on the meta device; adapters are sized in pages only
(the simulator's layout)."""

from __future__ import annotations

import pytest
import torch

from loraplex.benchmarks.sim.replica import AdapterMeta, SimClock, SimLayout, SimLink
from loraplex.replica.memory.adapter_cache import AdapterCache, CacheConfig
from loraplex.replica.memory.eviction import GDSF, LRU, AdapterUsage, WeightedScore, make_eviction
from loraplex.replica.memory.pool import PageKind, UnifiedPool

PAGE = 1000  # bytes per page (fp32 elements of 250)
NO_DECAY = 1e12


def usage(name: str, nbytes: int, uses: int, last: float) -> AdapterUsage:
    u = AdapterUsage(name, nbytes)
    for _ in range(uses):
        u.touch(last, NO_DECAY)
    return u


def candidates() -> list[AdapterUsage]:
    # A: small, frequent, old; B: large, rare, recent; C: medium on every count
    return [usage("A", 10, 5, 0.0), usage("B", 100, 1, 10.0), usage("C", 50, 2, 5.0)]


def names(us: list[AdapterUsage]) -> list[str]:
    return [u.name for u in us]


def test_chameleon_score_order_by_hand():
    # normalised (freq, recency, size): A (1, 0, .1), B (.2, 1, 1), C (.4, .5, .5)
    # 0.45 f + 0.10 r + 0.45 s: A .495, B .64, C .455 -> C, A, B
    policy = WeightedScore(half_life_s=NO_DECAY)
    assert policy.scores(candidates(), 10.0) == pytest.approx([0.495, 0.64, 0.455])
    assert names(policy.order(candidates(), 10.0)) == ["C", "A", "B"]


def test_equal_weights_lru_and_gdsf_orders_by_hand():
    # equal thirds: A .367, B .733, C .467 -> A, C, B
    assert names(make_eviction("equal", NO_DECAY).order(candidates(), 10.0)) == ["A", "C", "B"]
    assert names(LRU().order(candidates(), 10.0)) == ["A", "C", "B"]
    # GDSF with cost = 1 s + bytes / (1 B/s): H = freq * (1 + n) / n:
    # A 5 * 1.1 = 5.5, B 1 * 1.01 = 1.01, C 2 * 1.02 = 2.04 -> B, C, A
    gdsf = GDSF(link_bytes_per_s=1.0, setup_s=1.0, half_life_s=NO_DECAY)
    cands = candidates()
    for u in cands:
        gdsf.touched(u, 10.0)
    assert names(gdsf.order(cands, 10.0)) == ["B", "C", "A"]
    gdsf.evicted(cands[1])  # L rises to B's H: a newcomer starts above the old ones
    assert gdsf.inflation == pytest.approx(1.01)
    newcomer = usage("D", 10, 1, 11.0)
    gdsf.touched(newcomer, 11.0)
    assert names(gdsf.order([cands[0], cands[2], newcomer], 11.0)) == ["C", "D", "A"]


def test_frequency_decays_with_the_half_life():
    u = AdapterUsage("a", 1)
    u.touch(0.0, 10.0)
    u.touch(0.0, 10.0)
    assert u.frequency_at(10.0, 10.0) == pytest.approx(1.0)
    assert u.frequency_at(30.0, 10.0) == pytest.approx(0.25)


# -- the cache ----------------------------------------------------------------------------


def make_cache(num_pages: int, sizes: dict[str, int], **cfg) -> tuple[AdapterCache, SimClock]:
    """Adapter name -> pages. Loads finish at once unless cfg asks for the link."""
    clock = SimClock()
    pool = UnifiedPool(num_pages, PAGE // 4, torch.float32, torch.device("meta"))
    link = cfg.pop("link", None)
    cache = AdapterCache(
        pool,
        None,
        clock=clock,
        config=CacheConfig(**{"loading": "sync", **cfg}),
        layout=SimLayout(PAGE),
        transfer=SimLink(*link, clock) if link else None,
    )
    for name, pages in sizes.items():
        cache.add(AdapterMeta(name, 8, pages * PAGE))
    return cache, clock


def use(cache: AdapterCache, clock: SimClock, name: str, at: float) -> None:
    clock.now = at
    cache.release(cache.acquire(name))


def test_a_pinned_adapter_is_never_evicted_and_kv_gets_only_idle_pages():
    cache, clock = make_cache(10, {"a": 4, "b": 4}, eviction="lru")
    held = cache.acquire("a")
    use(cache, clock, "b", 1.0)
    assert cache.pool.num_free == 2
    # KV wants 6 pages: only b (4 idle) can go, not enough -> nothing is evicted
    assert not cache.pool.can_allocate(7)
    assert set(cache.resident) == {"a", "b"}
    assert cache.pool.can_allocate(6) and set(cache.resident) == {"a"}
    kv = cache.pool.allocate(6, PageKind.KV)
    assert cache.acquire("b") is None  # no room: a is pinned, the rest is KV
    cache.pool.free(kv)
    cache.release(held)


def test_queued_adapters_are_kept_unless_memory_forces_it():
    cache, clock = make_cache(12, {"cold": 4, "queued": 4, "new": 4}, eviction="lru")
    use(cache, clock, "queued", 0.0)  # older: LRU alone would evict it first
    use(cache, clock, "cold", 1.0)
    cache.want(["queued"])
    assert cache.acquire("new") is not None
    assert cache.pool.can_allocate(4)  # one more adapter's worth for KV
    assert set(cache.resident) == {"queued", "new"}, "the cold one goes first"
    kv = cache.pool.allocate(4, PageKind.KV)
    assert cache.pool.can_allocate(4)  # now only the queued one is left idle: forced
    assert set(cache.resident) == {"new"}
    cache.pool.free(kv)


def test_low_watermark_evicts_ahead_so_kv_growth_does_not_evict_every_step():
    def grow(**cfg) -> int:
        cache, clock = make_cache(100, {f"a{i}": 5 for i in range(20)}, **cfg)
        for i in range(20):
            use(cache, clock, f"a{i}", float(i))
        assert cache.pool.num_free == 0
        for _ in range(30):  # a batch growing one KV block per step
            cache.pool.allocate(1, PageKind.KV)
        return cache.stats.reclaims

    assert grow() == 6  # every 5th block evicts one 5-page adapter
    assert grow(low_watermark=0.1, high_watermark=0.2) == 2  # 15 pages per eviction round


def test_prefetch_respects_the_high_watermark_and_never_evicts_pinned_or_queued():
    cache, clock = make_cache(
        20, {"run": 6, "q1": 4, "q2": 4, "q3": 4}, prefetch=3, high_watermark=0.2
    )
    held = cache.acquire("run")
    cache.want(["q1", "q2", "q3"])
    cache.prefetch()
    # 14 free, 4 must stay free: q1 and q2 fit (14 - 8 = 6 >= 4), q3 would leave 2
    assert set(cache.resident) == {"run", "q1", "q2"}
    assert cache.stats.prefetches == 2 and cache.pool.num_free == 6
    cache.want(["q3"])
    cache.prefetch()  # may evict q1/q2 now (no longer queued), never "run"
    assert "run" in cache.resident and "q3" in cache.resident
    assert cache.pool.num_free >= 4
    cache.release(held)


def test_loads_take_link_time_and_are_shared_among_concurrent_loads():
    # 1000 B/s, no setup: a 4-page (4000 B) adapter loads in 4 s alone, 8 s beside another
    cache, clock = make_cache(20, {"a": 4, "b": 4}, link=(1000.0, 0.0))
    assert cache.acquire("a") is None and cache.tier("a") == "loading"
    assert cache.acquire("b") is None
    clock.now = 7.9
    cache.poll()
    assert not cache.resident
    clock.now = 8.0
    cache.poll()
    assert set(cache.resident) == {"a", "b"}
    assert cache.stats.load_seconds_max == pytest.approx(8.0)
    assert cache.acquire("a") is not None and cache.stats.hits == 1


def test_host_budget_drops_cold_host_copies_and_reads_them_back_from_disk():
    reads = []

    def reader(name: str, pages: int):
        def read() -> AdapterMeta:
            reads.append(name)
            return AdapterMeta(name, 8, pages * PAGE)

        return read

    cache, clock = make_cache(20, {}, host_bytes=6 * PAGE)
    for i, name in enumerate(("a", "b", "c")):
        clock.now = float(i)
        cache.add(AdapterMeta(name, 8, 3 * PAGE), reader(name, 3))
    assert cache.tier("a") == "disk" and cache.tier("c") == "host"  # 9 pages > budget 6
    use(cache, clock, "a", 5.0)
    assert reads == ["a"] and cache.stats.disk_reads == 1 and cache.tier("a") == "device"
    assert cache.stats.host_drops >= 2
    # Replacing an adapter with a larger version, and removing one, keep the budget: the
    # new version's copy is the newest, a (used at 5) goes.
    clock.now = 6.0
    cache.add(AdapterMeta("c", 8, 5 * PAGE), reader("c", 5))
    assert set(cache.host) == {"c"}
    drops = cache.stats.host_drops
    cache.remove("c")
    cache.add(AdapterMeta("d", 8, 2 * PAGE), reader("d", 2))
    assert set(cache.host) == {"d"} and cache.stats.host_drops == drops  # c's bytes are gone


def test_without_keep_idle_an_adapter_leaves_with_its_last_request_unless_queued():
    cache, clock = make_cache(20, {"a": 4, "b": 4}, keep_idle=False)
    use(cache, clock, "a", 0.0)
    assert not cache.resident and cache.stats.evictions == 1
    cache.want(["b"])
    use(cache, clock, "b", 1.0)
    assert set(cache.resident) == {"b"}


def test_a_new_host_copy_counts_as_just_used_and_queued_adapters_keep_theirs():
    """With a full host tier, the copy just read is not the first dropped (it would be read
    again by its first request): the least recently used one goes. An adapter queued
    requests want keeps its host copy whatever its age."""
    reads = []

    def reader(name: str):
        def read() -> AdapterMeta:
            reads.append(name)
            return AdapterMeta(name, 8, 3 * PAGE)

        return read

    cache, clock = make_cache(20, {}, host_bytes=6 * PAGE)
    for i, name in enumerate(("a", "b")):
        cache.add(AdapterMeta(name, 8, 3 * PAGE), reader(name))
        use(cache, clock, name, float(i))
    clock.now = 2.0
    cache.add(AdapterMeta("c", 8, 3 * PAGE), reader("c"))  # its first read, for a request
    assert cache.tier("c") == "host" and set(cache.host) == {"b", "c"}
    use(cache, clock, "c", 3.0)
    assert reads == [] and cache.stats.disk_reads == 0  # one read per first use: the add's

    cache.want(["b"])  # b is the least recently used now, but a request waits for it
    clock.now = 4.0
    cache.add(AdapterMeta("d", 8, 3 * PAGE), reader("d"))
    assert "b" in cache.host and "c" not in cache.host


def test_a_read_again_within_the_window_counts_as_thrash_and_one_long_after_does_not():
    """The `lora` autoscaling policy adds a replica for a working set past the tiers, which
    it reads from re-reads. An adapter read again within `reread_window_s` (the policy's
    demand window) of its previous load here is one the tiers cannot keep; one read again
    long after is demand that came back (after a step down, the leaving replica's adapters
    at homes that last had them long before): a disk read, not thrash."""

    def reader(name: str):
        return lambda: AdapterMeta(name, 8, 3 * PAGE)

    cache, clock = make_cache(20, {}, host_bytes=3 * PAGE, keep_idle=False)
    cache.reread_window_s = 60.0
    cache.add(AdapterMeta("a", 8, 3 * PAGE), reader("a"))  # its first read, at 0
    use(cache, clock, "a", 0.0)
    clock.now = 10.0
    cache.add(AdapterMeta("b", 8, 3 * PAGE), reader("b"))  # a's copy dropped
    assert cache.tier("a") == "disk"
    use(cache, clock, "a", 50.0)  # read again 50 s after its last load
    assert cache.stats.disk_reads == 1 and cache.stats.quick_rereads == 1
    assert cache.tier("b") == "disk"  # dropped for a's copy
    use(cache, clock, "b", 100.0)  # read again 90 s after its last load
    assert cache.stats.disk_reads == 2 and cache.stats.quick_rereads == 1
