"""The prefix cache in the unified pool: the one eviction decision over idle cached blocks and
idle adapters, and a randomized churn of requests, adapters and cached blocks checked
against the test's own record of who owns what (test_pool.py's style)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import random

import numpy as np
import torch
from test_pool import CPU, SMALL, columns_for, fixed_weights, random_weights

from loraplex.replica.memory.adapter_cache import AdapterCache, CacheConfig
from loraplex.replica.memory.adapters import ResidentAdapter
from loraplex.replica.memory.eviction import AdapterUsage, RestoreCosts, victims
from loraplex.replica.memory.kv_cache import KVCache
from loraplex.replica.memory.pool import PageKind, UnifiedPool
from loraplex.replica.memory.prefix_cache import PrefixCache
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.sequence import Sequence

# ---------------------------------------------------------------------------------------------
# the merge of adapters and blocks (pure)


class Blocks:
    """An idle-block count that `victims`' caller decrements by evicting."""

    def __init__(self, n: int):
        self.num_idle = n


def drain(order, blocks: Blocks) -> list[tuple[str, bool]]:
    out = []
    for usage, spare in order:
        if usage is None:
            blocks.num_idle -= 1
            out.append(("block", spare))
        else:
            out.append((usage.name, spare))
    return out


def test_victims_merge_by_cost_then_wanted_adapters():
    cold = [AdapterUsage("x", 1), AdapterUsage("y", 1)]
    warm = [AdapterUsage("w", 1)]
    blocks = Blocks(3)
    # blocks cost 2 per page; x 1, y 5: x, then the blocks, then y, then w (wanted)
    loss = {"x": 1.0, "y": 5.0}
    got = drain(victims(cold, warm, blocks, lambda u: 2.0 < loss[u.name]), blocks)
    assert got == [("x", True)] + [("block", True)] * 3 + [("y", True), ("w", False)]


def test_victims_with_a_static_share_take_blocks_last_and_never_as_spare():
    cold = [AdapterUsage("x", 1), AdapterUsage("y", 1)]
    blocks = Blocks(2)
    got = drain(victims(cold, [AdapterUsage("w", 1)], blocks, None, blocks_last=True), blocks)
    assert got == [("x", True), ("y", True), ("w", False), ("block", False), ("block", False)]
    assert drain(victims(cold, [], None, None), Blocks(0)) == [("x", True), ("y", True)]


# ---------------------------------------------------------------------------------------------
# the decision in a real pool: whichever is cheaper to lose goes


def _setup(costs: RestoreCosts, share: float | None = None):
    cfg = ModelConfig.from_dict(SMALL)
    pool = UnifiedPool(64, 2048, cfg.dtype, CPU)  # 16 tokens of KV per page
    kv = KVCache(pool, cfg)
    kv.prefix = PrefixCache(
        pool, kv.block_size, half_life_s=60.0, share_base=False, share=share, clock=lambda: 0.0
    )
    cache = AdapterCache(
        pool,
        cfg,
        columns_for(cfg),
        clock=lambda: 0.0,
        config=CacheConfig(eviction="lru"),
        blocks=kv.prefix,
        restore_costs=lambda: costs,
    )
    gen = torch.Generator().manual_seed(0)
    weights = fixed_weights("ad", cfg, 16, ("q_proj", "v_proj"), gen)
    cache.add(dataclasses.replace(weights, version="v1"))
    resident = cache.acquire("ad")
    cache.release(resident)  # idle, used once
    # one request fills 4 blocks of a prompt and leaves: 4 idle cached blocks, used once
    seq = Sequence("s", list(range(70)), SamplingParams(), None, 0.0, torch.Generator())
    kv.match(seq, kv.prefix.root(None, None, None))
    assert kv.ensure(seq, 64)
    seq.num_computed = 64
    kv.commit(seq)
    kv.free(seq)
    assert kv.prefix.num_idle == min(4, kv.prefix.cap)
    assert pool.kind[resident.pages[0]] == PageKind.ADAPTER
    return pool, kv, cache, resident


def test_kv_demand_evicts_whichever_is_cheaper_to_lose():
    # the adapter (4 KiB of weights in its pages) reloads at 1 s/MB: 4 ms, spread over its
    # pages; a block recomputes 16 tokens at 1 ms each: 16 ms. The adapter goes first.
    pool, kv, cache, resident = _setup(RestoreCosts(1e-3, 1e-6))
    adapter_pages = len(resident.pages)
    assert cache.nbytes_of("ad") * 1e-6 / adapter_pages < 16e-3
    filler = Sequence("f", [0] * 2048, SamplingParams(), None, 0.0, torch.Generator())
    free = pool.num_free
    assert kv.ensure(filler, (free + 1) * kv.block_size)  # one page more than is free
    assert "ad" not in cache.resident and kv.prefix.num_idle == 4

    # recomputing is cheap now (1 us a token), reloading dear (1 ms a byte): a block goes
    pool, kv, cache, resident = _setup(RestoreCosts(1e-6, 1e-3))
    filler = Sequence("f", [0] * 2048, SamplingParams(), None, 0.0, torch.Generator())
    assert kv.ensure(filler, (pool.num_free + 1) * kv.block_size)
    assert "ad" in cache.resident and kv.prefix.num_idle == 3
    assert kv.prefix.stats.evictions == 1
    # the deepest of the chain went: the first three blocks still match
    probe = Sequence("p", list(range(70)), SamplingParams(), None, 0.0, torch.Generator())
    assert kv.match(probe, kv.prefix.root(None, None, None)) == 3


def test_a_static_share_keeps_blocks_until_no_idle_adapter_is_left():
    # blocks are dear to lose, the adapter cheap: the split still caps blocks at its share
    pool, kv, cache, resident = _setup(RestoreCosts(1.0, 1e-12), share=3 / 64)
    assert kv.prefix.num_idle == 3 and kv.prefix.stats.evictions == 1  # over the share
    # and KV takes the idle adapter's pages before any block, then a block
    filler = Sequence("f", [0] * 2048, SamplingParams(), None, 0.0, torch.Generator())
    assert kv.ensure(filler, (pool.num_free + 1) * kv.block_size)
    assert "ad" not in cache.resident and kv.prefix.num_idle == 3
    assert kv.ensure(filler, (len(filler.block_table) + pool.num_free + 1) * kv.block_size)
    assert kv.prefix.num_idle == 2  # nothing else was idle


# ---------------------------------------------------------------------------------------------
# randomized churn


def stamp_of(root: bytes, tokens: tuple[int, ...]) -> float:
    """What a block computed for these tokens after `root` holds: a value written out of
    the test's own record (not the cache's keys), exactly representable in float32."""
    return float(hash((root, tokens)) % (1 << 20))


class PrefixWorld:
    """Requests on a few shared documents, adapters registered, replaced and removed, all in
    one small pool with a prefix cache. The world records each request's blocks, each
    adapter's pins and what each block must hold, and checks the pool against it."""

    def __init__(self, seed: int, num_pages: int):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.cfg = ModelConfig.from_dict(SMALL)
        self.pool = UnifiedPool(num_pages, 2048, self.cfg.dtype, CPU)
        self.kv = KVCache(self.pool, self.cfg)
        self.bs = self.kv.block_size
        ticks = itertools.count()
        clock = lambda: float(next(ticks))  # noqa: E731
        self.kv.prefix = PrefixCache(
            self.pool, self.bs, half_life_s=200.0, share_base=False, share=None, clock=clock
        )
        self.costs = RestoreCosts(1e-3, 1e-9)
        self.cache = AdapterCache(
            self.pool,
            self.cfg,
            columns_for(self.cfg),
            clock=clock,
            config=CacheConfig(half_life_s=200.0),
            blocks=self.kv.prefix,
            restore_costs=lambda: self.costs,
        )
        self.names = [f"a{i}" for i in range(6)]
        self.versions = itertools.count()
        self.docs = [[self.rng.randrange(64) for _ in range(12 * self.bs)] for _ in range(4)]
        self.running: dict[str, tuple[Sequence, ResidentAdapter | None]] = {}
        self.retired: set[ResidentAdapter] = set()
        self.expected: dict[int, float] = {}  # registered page -> what it must hold
        self.ids = itertools.count()
        self.counts = collections.Counter()
        for name in self.names[:4]:
            self.register(name)

    # -- operations

    def register(self, name: str) -> None:
        old = self.cache.resident.get(name)
        weights = random_weights(name, self.cfg, self.rng, self.gen)
        self.cache.add(dataclasses.replace(weights, version=f"{name}-v{next(self.versions)}"))
        if old is not None and old.pins > 0:
            self.retired.add(old)
        self.counts["register"] += 1

    def remove(self) -> None:
        known = [n for n in self.names if n in self.cache]
        if len(known) <= 1:
            return
        name = self.rng.choice(known)
        old = self.cache.resident.get(name)
        self.cache.remove(name)
        if old is not None and old.pins > 0:
            self.retired.add(old)
        self.counts["remove"] += 1

    def admit(self) -> None:
        if len(self.running) >= 6:
            return self.finish()
        adapter = self.rng.choice([None, *[n for n in self.names if n in self.cache]])
        tenant = self.rng.choice(["t0", "t1"])
        doc = self.rng.choice(self.docs)
        length = self.rng.randint(1, len(doc))
        seq = Sequence(f"r{next(self.ids)}", doc[:length], SamplingParams(), adapter, 0.0, None)
        version = None if adapter is None else self.cache.version_of(adapter)
        root = self.kv.prefix.root(version, tenant, None)
        pinned = [r for r, _ in self._held()]
        hits = self.kv.match(seq, root)
        self._check_hits(seq, root, hits)
        lora = None
        if adapter is not None:
            lora = self.cache.acquire(adapter)
            if lora is None:
                self.kv.free(seq)
                self.counts["adapter_wait"] += 1
                return
            assert lora.version == version
        n = self.rng.randint(1, seq.num_tokens - seq.num_computed)
        if not self.kv.ensure(seq, seq.num_computed + n):
            if lora is not None:
                self.cache.release(lora)
            self.kv.free(seq)
            self.counts["refused"] += 1
        else:
            self.kv.admitted(seq)
            self.running[seq.request_id] = (seq, lora)
            self._compute(seq, n)
            self.counts["admitted"] += 1
            self.counts["hit_blocks"] += hits
        for r in pinned:
            assert self.cache.resident.get(r.name) is r or r in self.retired, (
                "evicted a pinned adapter"
            )

    def advance(self) -> None:
        """A running request computes more of its prompt, or decodes."""
        if not self.running:
            return
        seq, _ = self.running[self.rng.choice(list(self.running))]
        if seq.num_computed == seq.num_tokens:  # a few decode steps' tokens
            seq.output_ids += [self.rng.randrange(64) for _ in range(self.rng.randint(1, 24))]
        n = self.rng.randint(1, seq.num_tokens - seq.num_computed)
        table = list(seq.block_table)
        if self.kv.ensure(seq, seq.num_computed + n):
            assert seq.block_table[: len(table)] == table
            self._compute(seq, n)
            self.counts["advanced"] += 1
        else:
            assert seq.block_table == table
            self.preempt(seq)

    def preempt(self, seq: Sequence) -> None:
        self._leave(seq)
        self.counts["preempted"] += 1

    def finish(self) -> None:
        if self.running:
            self._leave(self.running[self.rng.choice(list(self.running))][0])
            self.counts["finished"] += 1

    def load(self) -> None:
        """An adapter load for a request that does not start here: adapter pressure."""
        name = self.rng.choice([n for n in self.names if n in self.cache])
        lora = self.cache.acquire(name)
        if lora is not None:
            self.cache.release(lora)
            self.counts["loads"] += 1

    def reprice(self) -> None:
        """The measured costs move: sometimes blocks are the cheaper to lose, sometimes not."""
        self.costs = RestoreCosts(10 ** self.rng.uniform(-6, -2), 10 ** self.rng.uniform(-12, -6))

    # -- bookkeeping

    def _compute(self, seq: Sequence, n: int) -> None:
        """Write what positions num_computed..+n produce into their blocks (the block's
        stamp so far), then register the blocks that filled."""
        end = seq.num_computed + n
        tokens = seq.all_token_ids()
        for i in range(seq.num_computed // self.bs, -(-end // self.bs)):
            page = seq.block_table[i]
            assert self.kv.refs[page] == 1, "a request wrote into a block it shares"
            self.kv.view[page].fill_(
                stamp_of(seq.prefix_root, tuple(tokens[: min(end, (i + 1) * self.bs)]))
            )
        seq.num_computed = end
        before = set(self.kv.prefix.by_page)
        self.kv.commit(seq)
        for page in set(self.kv.prefix.by_page) - before:
            self.expected[page] = float(self.kv.view[page].flatten()[0])

    def _check_hits(self, seq: Sequence, root: bytes, hits: int) -> None:
        tokens = seq.all_token_ids()
        for i, page in enumerate(seq.block_table[:hits]):
            want = stamp_of(root, tuple(tokens[: (i + 1) * self.bs]))
            assert bool((self.kv.view[page] == want).all()), "a hit found another prefix's KV"

    def _leave(self, seq: Sequence) -> None:
        _, lora = self.running.pop(seq.request_id)
        self.kv.free(seq)
        seq.num_computed = seq.num_committed = 0
        if lora is not None:
            self.cache.release(lora)
            if lora.pins == 0:
                self.retired.discard(lora)

    def _held(self) -> list[tuple[ResidentAdapter, str]]:
        return [(lora, rid) for rid, (_, lora) in self.running.items() if lora is not None]

    # -- checks

    def check(self, data: bool) -> None:
        pool, kv, prefix = self.pool, self.kv, self.kv.prefix
        pool.check_invariants()
        for page in [p for p in self.expected if p not in prefix.by_page]:
            del self.expected[page]  # evicted (or never registered again)
        adapters = list(self.cache.resident.values()) + list(self.cache.loading.values())
        adapters += list(self.retired)
        adapter_pages = [p for r in adapters for p in r.pages]
        assert len(adapter_pages) == len(set(adapter_pages)), "an adapter page has two owners"
        holders = collections.Counter(p for s, _ in self.running.values() for p in s.block_table)
        cached = [p for p in prefix.by_page if pool.kind[p] == PageKind.CACHED]
        owned = adapter_pages + list(holders) + cached
        assert len(owned) == len(set(owned)), "a page has two kinds of owner"
        assert set(owned) == set(np.flatnonzero(pool.kind != PageKind.FREE).tolist()), (
            "a page leaked"
        )
        assert (pool.kind[adapter_pages] == PageKind.ADAPTER).all()
        for page, n in holders.items():
            assert pool.kind[page] == PageKind.KV and kv.refs[page] == n, "reference count is off"
        assert not kv.refs[cached].any() and len(cached) == prefix.num_idle
        for key, block in prefix.blocks.items():  # no evicted page is still found by a key
            assert prefix.by_page[block.page] is block and block.key == key
            assert pool.kind[block.page] in (PageKind.KV, PageKind.CACHED)
        pinned = {p for r in adapters if r.pins > 0 for p in r.pages}
        assert set(np.flatnonzero(pool.pins > 0).tolist()) == pinned
        for lora, _ in self._held():
            assert self.cache.resident.get(lora.name) is lora or lora in self.retired, (
                "a pinned adapter was evicted"
            )
        if data:
            for page, want in self.expected.items():
                assert bool((kv.view[page] == want).all()), "a cached block was overwritten"

    def drain(self) -> None:
        while self.running:
            self.finish()
        self.check(data=True)
        self.kv.prefix.clear()
        for name in [n for n in self.names if n in self.cache]:
            self.cache.remove(name)
        self.pool.check_invariants()
        assert self.pool.num_free == self.pool.num_pages, "pages leaked"
        assert not self.kv.refs.any()


def test_random_churn_of_requests_adapters_and_cached_blocks():
    world = PrefixWorld(seed=1, num_pages=56)
    ops = [world.admit] * 6 + [world.advance] * 8 + [world.finish] * 3 + [world.load] * 2
    ops += [lambda: world.register(world.rng.choice(world.names)), world.remove, world.reprice]
    for step in range(3000):
        world.rng.choice(ops)()
        world.check(data=step % 100 == 99)
    counts = world.counts
    stats = world.kv.prefix.stats
    print(f"\nchurn: {dict(counts)}; {stats}; adapter evictions {world.cache.stats.evictions}")
    assert counts["admitted"] > 300 and counts["hit_blocks"] > 300
    assert counts["preempted"] > 0 and counts["refused"] > 0 and counts["adapter_wait"] > 0
    assert stats.evictions > 100 and world.cache.stats.evictions > 50
    assert int(world.kv.refs.max()) >= 1 and counts["register"] > 50
    world.drain()
