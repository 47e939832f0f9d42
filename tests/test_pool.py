"""The unified paged pool: RowPacker layout, UnifiedPool invariants, and a randomized
property test of adapters and KV blocks sharing one pool through AdapterCache and KVCache."""

from __future__ import annotations

import collections
import functools
import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loraplex.adapter_format import TARGET_MODULES as TARGETS
from loraplex.benchmarks.sim import profiles as sim_profiles
from loraplex.replica.memory.adapter_cache import AdapterCache, CacheConfig
from loraplex.replica.memory.adapters import AdapterWeights, ResidentAdapter
from loraplex.replica.memory.kv_cache import KVCache
from loraplex.replica.memory.pool import (
    PageKind,
    PoolExhausted,
    RowPacker,
    UnifiedPool,
    chunk_views,
)
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.model.llama import LlamaModel
from loraplex.replica.model.lora_groups import LORA_GROUPS
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.sequence import Sequence

CPU = torch.device("cpu")

SMALL = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "torch_dtype": "float32",
}

LLAMA_7B = sim_profiles.LLAMA_7B  # the simulator's A40 profile uses the same shape


def columns_for(cfg: ModelConfig):
    """LlamaModel.output_columns only reads `self.cfg`: no weights needed."""
    return functools.partial(LlamaModel.output_columns, SimpleNamespace(cfg=cfg))


# ---------------------------------------------------------------------------------------------
# RowPacker and chunk_views


def check_layout(packer: RowPacker, matrices: list[tuple[int, int]]) -> None:
    """No row split across pages, rows covered once in order, chunks never overlap."""
    page = packer.page_elems
    assert len(packer.placements) == len(matrices)
    spans: dict[int, list[tuple[int, int]]] = {}
    used = 0
    last = (0, 0)  # (page, offset) of the previous chunk: layout order is monotone
    for placement, (rows, row_len) in zip(packer.placements, matrices, strict=True):
        assert (placement.rows, placement.row_len) == (rows, row_len)
        next_row = 0
        for c in placement.chunks:
            assert c.rows >= 1
            assert c.row_start == next_row, "chunks must cover rows in order, each once"
            next_row += c.rows
            assert 0 <= c.offset and c.offset + c.rows * row_len <= page, (
                "a chunk spills out of its page"
            )
            assert 0 <= c.page < packer.num_pages
            assert (c.page, c.offset) >= last
            last = (c.page, c.offset)
            spans.setdefault(c.page, []).append((c.offset, c.offset + c.rows * row_len))
        assert next_row == rows
        used += rows * row_len
    for intervals in spans.values():
        intervals.sort()
        for (_, end), (start, _) in itertools.pairwise(intervals):
            assert end <= start, "two chunks overlap in one page"
    assert packer.used_elems == used
    if packer.num_pages:
        assert packer.fragmentation() == pytest.approx(1 - used / (packer.num_pages * page))


def test_rowpacker_three_rows_per_page_wastes_ten_percent():
    packer = RowPacker(100)
    packer.add(9, 30)
    chunks = packer.placements[0].chunks
    assert [(c.page, c.offset, c.row_start, c.rows) for c in chunks] == [
        (0, 0, 0, 3),
        (1, 0, 3, 3),
        (2, 0, 6, 3),
    ]
    assert packer.num_pages == 3
    assert packer.fragmentation() == pytest.approx(0.10)
    check_layout(packer, [(9, 30)])


def test_rowpacker_hand_computed_cases():
    # 10 rows of 30 in pages of 100: 3+3+3+1 rows over 4 pages, 300 of 400 used.
    p = RowPacker(100)
    p.add(10, 30)
    assert p.num_pages == 4
    assert p.fragmentation() == pytest.approx(0.25)
    check_layout(p, [(10, 30)])

    # Back to back: the second matrix fills the rest of page 0 before moving on.
    p = RowPacker(100)
    p.add(2, 30)  # page 0, [0, 60)
    p.add(3, 40)  # 1 row at page 0 offset 60, 2 rows on page 1
    assert [(c.page, c.offset, c.row_start, c.rows) for c in p.placements[1].chunks] == [
        (0, 60, 0, 1),
        (1, 0, 1, 2),
    ]
    assert p.num_pages == 2
    assert p.fragmentation() == pytest.approx(1 - 180 / 200)
    check_layout(p, [(2, 30), (3, 40)])

    # A row that does not fit in the rest of a page starts the next page.
    p = RowPacker(100)
    p.add(1, 70)
    p.add(1, 40)
    assert [(c.page, c.offset) for c in p.placements[1].chunks] == [(1, 0)]
    assert p.fragmentation() == pytest.approx(1 - 110 / 200)

    # Rows exactly one page long: no waste; small rows filling a page exactly: no waste.
    p = RowPacker(100)
    p.add(3, 100)
    p.add(4, 25)
    assert p.num_pages == 4
    assert p.fragmentation() == 0.0
    check_layout(p, [(3, 100), (4, 25)])

    # Nothing packed: no pages, no waste.
    assert RowPacker(100).num_pages == 0
    assert RowPacker(100).fragmentation() == 0.0


def test_rowpacker_row_longer_than_page_raises():
    p = RowPacker(100)
    with pytest.raises(ValueError, match="101"):
        p.add(1, 101)
    p.add(1, 100)  # exactly one page is fine
    assert p.num_pages == 1


def test_rowpacker_random_layouts_and_chunk_views_round_trip():
    rng = random.Random(7)
    for _ in range(300):
        page = rng.choice([1, 7, 16, 64, 100, 1000])
        matrices = [(rng.randint(0, 40), rng.randint(1, page)) for _ in range(rng.randint(1, 8))]
        packer = RowPacker(page)
        for m in matrices:
            packer.add(*m)
        check_layout(packer, matrices)

    # Views land in the pool pages the allocation maps to, and read back what was written.
    for _ in range(30):
        page = rng.choice([16, 64, 100])
        matrices = [(rng.randint(1, 30), rng.randint(1, page)) for _ in range(rng.randint(1, 6))]
        packer = RowPacker(page)
        for m in matrices:
            packer.add(*m)
        arena = torch.full((packer.num_pages + 5, page), -1.0)
        pages = rng.sample(range(arena.shape[0]), packer.num_pages)  # not contiguous, not sorted
        data = [torch.randn(r, n) for r, n in matrices]
        for placement, d in zip(packer.placements, data, strict=True):
            views = chunk_views(arena, placement, pages)
            assert sum(v.shape[0] for v in views) == d.shape[0]
            start = 0
            for v in views:
                assert v.data_ptr() >= arena.data_ptr()  # a view, not a copy
                v.copy_(d[start : start + v.shape[0]])
                start += v.shape[0]
        for placement, d in zip(packer.placements, data, strict=True):
            assert torch.equal(torch.cat(chunk_views(arena, placement, pages)), d)
        unused = sorted(set(range(arena.shape[0])) - set(pages))
        assert (arena[unused] == -1.0).all(), "a view wrote outside the allocation's pages"


# ---------------------------------------------------------------------------------------------
# UnifiedPool


def test_pool_allocate_free_pin_unpin():
    pool = UnifiedPool(8, 16, torch.float32, CPU)
    assert pool.num_free == 8 and pool.page_bytes == 64
    kv = pool.allocate(3, PageKind.KV)
    ad = pool.allocate(2, PageKind.ADAPTER)
    assert len(set(kv) | set(ad)) == 5
    assert (pool.kind[kv] == PageKind.KV).all() and (pool.kind[ad] == PageKind.ADAPTER).all()
    pool.check_invariants()
    s = pool.stats()
    assert (s.free_pages, s.kv_pages, s.adapter_pages, s.pinned_pages) == (3, 3, 2, 0)

    pool.pin(ad)
    pool.pin(ad[:1])  # pins count
    assert pool.stats().pinned_pages == 2
    with pytest.raises(AssertionError, match="pinned"):
        pool.free(ad)
    assert (pool.kind[ad] == PageKind.ADAPTER).all() and pool.num_free == 3, (
        "a refused free changed state"
    )
    pool.unpin(ad)
    with pytest.raises(AssertionError, match="pinned"):
        pool.free(ad)  # ad[0] is still pinned once
    pool.unpin(ad[:1])
    assert pool.stats().pinned_pages == 0
    pool.free(ad)
    pool.free(kv)
    pool.check_invariants()
    assert pool.num_free == 8 and pool.stats().kv_pages == pool.stats().adapter_pages == 0


def test_pool_misuse_asserts():
    pool = UnifiedPool(4, 8, torch.float32, CPU)
    pages = pool.allocate(2, PageKind.KV)
    free_page = next(p for p in range(4) if p not in pages)
    with pytest.raises(AssertionError):
        pool.free([free_page])  # not allocated
    with pytest.raises(AssertionError):
        pool.free([pages[0], pages[0]])  # twice
    with pytest.raises(AssertionError):
        pool.pin([free_page])
    with pytest.raises(AssertionError):
        pool.allocate(1, PageKind.FREE)
    pool.check_invariants()
    pool.free(pages)
    with pytest.raises(AssertionError):
        pool.free(pages)  # double free
    pool.check_invariants()
    assert pool.num_free == 4


def test_pool_any_free_pages_will_do():
    """No external fragmentation: n free pages, wherever they are, satisfy n."""
    pool = UnifiedPool(10, 4, torch.float32, CPU)
    pages = pool.allocate(10, PageKind.KV)
    pool.free(pages[::2])
    got = pool.allocate(5, PageKind.ADAPTER)
    assert sorted(got) == sorted(pages[::2])
    pool.check_invariants()


def test_pool_exhausted_and_reclaim():
    pool = UnifiedPool(6, 8, torch.float32, CPU)
    held = pool.allocate(4, PageKind.ADAPTER)
    with pytest.raises(PoolExhausted):
        pool.allocate(3, PageKind.KV)  # no reclaimer
    assert pool.num_free == 2 and pool.stats().kv_pages == 0

    asked = []

    def reclaim(n):
        asked.append(n)
        pool.free([held.pop() for _ in range(min(n, len(held)))])

    pool.set_reclaimer(reclaim)
    assert pool.can_allocate(2) and asked == []  # enough free: reclaimer not asked
    with pytest.raises(PoolExhausted):
        pool.allocate(3, PageKind.KV, reclaim=False)
    assert asked == []
    got = pool.allocate(3, PageKind.KV)
    assert asked == [1], "the reclaimer is asked for the shortfall only"
    assert len(got) == 3 and pool.stats().kv_pages == 3 and pool.stats().adapter_pages == 3
    pool.check_invariants()

    # A reclaimer that cannot free enough: PoolExhausted, nothing allocated.
    pool.set_reclaimer(lambda n: None)
    before = pool.stats()
    with pytest.raises(PoolExhausted):
        pool.allocate(1, PageKind.KV)
    assert pool.stats() == before
    pool.check_invariants()


# ---------------------------------------------------------------------------------------------
# Adapters and KV in one pool


def random_weights(
    name: str, cfg: ModelConfig, rng: random.Random, gen: torch.Generator
) -> AdapterWeights:
    """Mixed ranks (1..128, often 4 and 7), a random target subset, sometimes per-module ranks
    that differ and sometimes only some layers — all shapes load_adapter accepts."""
    rank = rng.choice([1, 2, 4, 4, 7, 7, 8, 16, 24, 32, 64, 128])
    targets = rng.sample(TARGETS, rng.randint(1, len(TARGETS)))
    layers = list(range(cfg.num_layers))
    if rng.random() < 0.2:
        layers = rng.sample(layers, rng.randint(1, len(layers)))
    mixed = rng.random() < 0.25
    shapes = cfg.projection_shapes()
    modules = {}
    for layer in layers:
        for t in targets:
            r = rng.randint(1, rank) if mixed else rank
            fan_in, fan_out = shapes[t].in_features, shapes[t].out_features
            a = torch.randn(r, fan_in, generator=gen).to(cfg.dtype)
            bt = torch.randn(r, fan_out, generator=gen).to(cfg.dtype)
            modules[(layer, t)] = (a, bt)
    return AdapterWeights(
        name=name,
        rank=max(a.shape[0] for a, _ in modules.values()),
        targets=tuple(t for t in TARGETS if t in targets),
        modules=modules,
    )


def fixed_weights(
    name: str, cfg: ModelConfig, rank: int, targets: tuple[str, ...], gen: torch.Generator
) -> AdapterWeights:
    shapes = cfg.projection_shapes()
    modules = {
        (layer, t): (
            torch.randn(rank, shapes[t].in_features, generator=gen).to(cfg.dtype),
            torch.randn(rank, shapes[t].out_features, generator=gen).to(cfg.dtype),
        )
        for layer in range(cfg.num_layers)
        for t in targets
    }
    return AdapterWeights(name, rank, tuple(t for t in TARGETS if t in targets), modules)


def pages_needed(weights: AdapterWeights, cfg: ModelConfig, page_elems: int) -> int:
    return expected_layout(weights, cfg, page_elems).num_pages


def expected_layout(weights: AdapterWeights, cfg: ModelConfig, page_elems: int) -> RowPacker:
    """The layout ResidentAdapter documents, written out independently: per layer and LoRA
    group, the group's A rows back to back, then each target's Bt."""
    packer = RowPacker(page_elems)
    for layer in range(cfg.num_layers):
        for targets in LORA_GROUPS.values():
            mods = [weights.modules[(layer, t)] for t in targets if (layer, t) in weights.modules]
            if mods:
                packer.add(sum(a.shape[0] for a, _ in mods), mods[0][0].shape[1])
                for _, bt in mods:
                    packer.add(*bt.shape)
    return packer


def assert_resident_data(
    resident: ResidentAdapter, weights: AdapterWeights, cfg: ModelConfig
) -> None:
    """The kernel views of a resident adapter still hold its host weights (A and Bt rows)."""
    cols = columns_for(cfg)
    seen = set()
    for layer in range(cfg.num_layers):
        for group, targets in LORA_GROUPS.items():
            present = [t for t in targets if (layer, t) in weights.modules]
            g = resident.groups[layer][group]
            if not present:
                assert g is None
                continue
            a_cat = torch.cat([weights.modules[(layer, t)][0] for t in present])
            assert torch.equal(torch.cat(g.a), a_cat), (
                f"A of layer {layer} group {group} changed in the pool"
            )
            assert [o.col_start for o in g.outs] == [cols(group)[t][0] for t in present]
            h = 0
            for t, out in zip(present, g.outs, strict=True):
                a, bt = weights.modules[(layer, t)]
                assert (out.h_start, out.h_end) == (h, h + a.shape[0])
                assert (out.col_start, out.col_end) == cols(group)[t]
                h += a.shape[0]
                assert torch.equal(torch.cat(out.bt), bt), (
                    f"Bt of layer {layer} {t} changed in the pool"
                )
                seen.add((layer, t))
    assert seen == set(weights.modules)


def new_seq(i: int) -> Sequence:
    return Sequence(f"seq-{i}", [1, 2, 3], SamplingParams(), None, 0.0, torch.Generator())


class World:
    """Drives one pool through AdapterCache and KVCache, keeping its own record of who owns
    what, and checks the pool against it."""

    def __init__(self, seed: int, num_pages: int, page_elems: int, num_names: int):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.cfg = ModelConfig.from_dict(SMALL)
        self.pool = UnifiedPool(num_pages, page_elems, self.cfg.dtype, CPU)
        self.kv = KVCache(self.pool, self.cfg)
        ticks = itertools.count()
        self.cache = AdapterCache(
            self.pool,
            self.cfg,
            columns_for(self.cfg),
            clock=lambda: float(next(ticks)),
            # lru: the order test_kv_and_adapter_split checks; sync: loads complete at once
            config=CacheConfig(eviction="lru", loading="sync"),
        )
        self.names = [f"a{i}" for i in range(num_names)]
        self.loaded_from: dict[
            int, AdapterWeights
        ] = {}  # id(resident) -> weights it was built from
        self.held: list[ResidentAdapter] = []  # one entry per acquire not yet released
        self.retired: set[ResidentAdapter] = set()  # removed/replaced while pinned
        self.seqs: dict[int, Sequence] = {}
        self.stamps: dict[int, float] = {}
        self.seq_ids = itertools.count()
        self.fragmentation: list[float] = []
        self.max_held, self.max_seqs, self.max_blocks = 4, 5, 20
        self.counts = dict.fromkeys(
            (
                "acquire_ok",
                "acquire_none",
                "hit",
                "kv_ok",
                "kv_refused",
                "release",
                "kv_free",
                "add",
                "remove",
            ),
            0,
        )

    # -- helpers

    def idle_pages(self) -> int:
        return sum(len(r.pages) for r in self.cache.resident.values() if r.pins == 0)

    def all_adapters(self) -> list[ResidentAdapter]:
        return list(self.cache.resident.values()) + list(self.retired)

    def register(self, name: str) -> None:
        old = self.cache.resident.get(name)
        self.cache.add(random_weights(name, self.cfg, self.rng, self.gen))
        if old is not None and old.pins > 0:
            self.retired.add(old)
        self.counts["add"] += 1

    # -- operations

    def acquire(self) -> None:
        if len(self.held) >= self.max_held:  # requests finish as others start
            self.release()
        known = [n for n in self.names if n in self.cache]
        if not known:
            return
        name = self.rng.choice(known)
        weights = self.cache.host[name]
        was = self.cache.resident.get(name)
        pinned_before = {id(r): r for r in self.held}
        need = pages_needed(weights, self.cfg, self.pool.page_elems)
        available = self.pool.num_free + self.idle_pages()
        kv_before = self.pool.stats().kv_pages
        got = self.cache.acquire(name)
        if was is not None:
            assert got is was, "a resident adapter must be a hit"
            self.counts["hit"] += 1
        elif got is None:
            assert available < need, f"acquire failed with {available} pages available for {need}"
            assert name not in self.cache.resident
            self.counts["acquire_none"] += 1
        else:
            assert available >= need
            assert len(got.pages) == need
            self.loaded_from[id(got)] = weights
            self.fragmentation.append(got.fragmentation)
            self.counts["acquire_ok"] += 1
        assert self.pool.stats().kv_pages == kv_before, "loading an adapter must not take KV blocks"
        for r in pinned_before.values():
            assert self.cache.resident.get(r.name) is r or r in self.retired, (
                "a pinned adapter was evicted"
            )
        if got is not None:
            self.held.append(got)

    def release(self) -> None:
        if not self.held:
            return
        r = self.held.pop(self.rng.randrange(len(self.held)))
        self.cache.release(r)
        if r.pins == 0 and r in self.retired:
            self.retired.discard(r)
        self.counts["release"] += 1

    def grow_kv(self) -> None:
        if not self.seqs or (len(self.seqs) < self.max_seqs and self.rng.random() < 0.3):
            i = next(self.seq_ids)
            self.seqs[i] = new_seq(i)
            self.stamps[i] = 1000.0 + i
        i = self.rng.choice(list(self.seqs))
        seq = self.seqs[i]
        if len(seq.block_table) >= self.max_blocks:  # the request finishes
            self.free_kv(i)
            return
        tokens = len(seq.block_table) * self.kv.block_size + self.rng.randint(1, 160)
        missing = self.kv.blocks_for(tokens) - len(seq.block_table)
        available = self.pool.num_free + self.idle_pages()
        table = list(seq.block_table)
        pinned = [r for r in self.all_adapters() if r.pins > 0]
        if self.kv.ensure(seq, tokens):
            assert available >= missing
            assert (
                seq.block_table[: len(table)] == table
                and len(seq.block_table) == len(table) + missing
            )
            for page in seq.block_table[len(table) :]:
                self.kv.view[page].fill_(self.stamps[i])
            self.counts["kv_ok"] += 1
        else:
            assert available < missing, (
                f"KV refused {missing} blocks with {available} pages available"
            )
            assert seq.block_table == table, "a refused ensure changed the block table"
            self.counts["kv_refused"] += 1
        for r in pinned:
            assert self.cache.resident.get(r.name) is r or r in self.retired, (
                "KV evicted a pinned adapter"
            )

    def free_kv(self, i: int | None = None) -> None:
        if not self.seqs:
            return
        if i is None:
            i = self.rng.choice(list(self.seqs))
        seq = self.seqs.pop(i)
        assert self.kv_intact(seq, self.stamps.pop(i)), "KV block contents were overwritten"
        self.kv.free(seq)
        assert seq.block_table == []
        self.counts["kv_free"] += 1

    def add(self) -> None:
        self.register(self.rng.choice(self.names))

    def remove(self) -> None:
        known = [n for n in self.names if n in self.cache]
        if not known:
            return
        name = self.rng.choice(known)
        old = self.cache.resident.get(name)
        self.cache.remove(name)
        assert name not in self.cache and name not in self.cache.resident
        if old is not None and old.pins > 0:
            self.retired.add(old)
        self.counts["remove"] += 1

    # -- checks

    def kv_intact(self, seq: Sequence, stamp: float) -> bool:
        return all(bool((self.kv.view[page] == stamp).all()) for page in seq.block_table)

    def check(self, data_sample: int | None) -> None:
        pool = self.pool
        pool.check_invariants()
        adapters = self.all_adapters()
        assert len({id(r) for r in adapters}) == len(adapters)
        adapter_pages = [p for r in adapters for p in r.pages]
        kv_pages = [p for s in self.seqs.values() for p in s.block_table]
        owned = adapter_pages + kv_pages
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert set(owned) == set(np.flatnonzero(pool.kind != PageKind.FREE).tolist()), (
            "a page leaked"
        )
        assert (pool.kind[adapter_pages] == PageKind.ADAPTER).all()
        assert (pool.kind[kv_pages] == PageKind.KV).all()
        # pins: exactly the pages of adapters held by a request, and each adapter's count is right
        pinned_pages = {p for r in adapters if r.pins > 0 for p in r.pages}
        assert set(np.flatnonzero(pool.pins > 0).tolist()) == pinned_pages
        holds = collections.Counter(id(h) for h in self.held)
        for r in adapters:
            assert r.pins == holds[id(r)]
        for r in self.held:
            assert self.cache.resident.get(r.name) is r or r in self.retired, (
                "a pinned adapter was evicted"
            )
        for r in self.retired:
            assert r.pins > 0, "a retired adapter outlived its last request"
        # data: a few adapters (or all of them) still hold their host weights
        sample = (
            adapters
            if data_sample is None
            else self.rng.sample(adapters, min(data_sample, len(adapters)))
        )
        for r in sample:
            assert_resident_data(r, self.loaded_from[id(r)], self.cfg)
        if data_sample is None:
            for i, s in self.seqs.items():
                assert self.kv_intact(s, self.stamps[i]), "KV block contents were overwritten"

    def drain(self) -> None:
        while self.held:
            self.release()
        while self.seqs:
            self.free_kv()
        self.check(None)
        # only idle residents are left: their pages are exactly the non-free ones
        assert not self.retired
        assert self.pool.num_pages - self.pool.num_free == sum(
            len(r.pages) for r in self.cache.resident.values()
        )
        for name in [n for n in self.names if n in self.cache]:
            self.cache.remove(name)
        self.pool.check_invariants()
        stats = self.pool.stats()
        assert stats.free_pages == self.pool.num_pages, (
            f"{self.pool.num_pages - stats.free_pages} pages leaked"
        )
        assert stats.kv_pages == stats.adapter_pages == stats.pinned_pages == 0
        assert not self.cache.resident


def test_random_load_evict_cycles_keep_the_pool_consistent():
    # 64-wide model, 2 layers: a KV block of 2048 fp32 elements holds 16 tokens; the largest
    # adapter (rank 128 on all seven targets) takes 128 of the 160 pages, a rank-4 one a few.
    world = World(seed=20240611, num_pages=160, page_elems=2048, num_names=48)
    for name in world.names[:32]:
        world.register(name)
    ops = [world.acquire] * 6 + [world.release] * 5 + [world.grow_kv] * 4 + [world.free_kv]
    ops += [world.add, world.remove]
    for step in range(10_000):
        world.rng.choice(ops)()
        world.check(data_sample=None if step % 500 == 499 else 1)
    counts = world.counts
    mean_frag = float(np.mean(world.fragmentation))
    print(
        f"\nchurn: {counts}; evictions {world.cache.stats.evictions}; "
        f"mean ResidentAdapter.fragmentation {mean_frag:.2%} over {len(world.fragmentation)} loads "
        f"(small pages of {world.pool.page_elems} elems, rows of 32..128)"
    )
    # the run exercised what it claims to: loads, hits, evictions, refusals on both sides
    assert counts["acquire_ok"] > 300 and counts["hit"] > 300
    assert world.cache.stats.evictions > 100
    assert counts["acquire_none"] > 0 and counts["kv_refused"] > 0 and counts["kv_ok"] > 500
    assert counts["remove"] > 100 and counts["add"] > 100
    world.drain()


def test_llama7b_adapters_waste_under_two_percent_of_2mib_pages():
    cfg = ModelConfig.from_dict(LLAMA_7B)
    page_elems = (2 << 20) // 2  # 2 MiB of fp16
    cases = {"r16 q,k,v,o": (16, TARGETS[:4]), "r64 all seven": (64, TARGETS)}
    figures = {}
    for label, (rank, targets) in cases.items():
        # Shapes only: meta tensors carry shapes, allocate nothing.
        shapes = cfg.projection_shapes()
        modules = {
            (layer, t): (
                torch.empty(rank, shapes[t].in_features, dtype=cfg.dtype, device="meta"),
                torch.empty(rank, shapes[t].out_features, dtype=cfg.dtype, device="meta"),
            )
            for layer in range(cfg.num_layers)
            for t in targets
        }
        weights = AdapterWeights(label, rank, targets, modules)
        packer = expected_layout(weights, cfg, page_elems)
        check_layout(packer, [(p.rows, p.row_len) for p in packer.placements])
        # The real ResidentAdapter on a meta-device pool lays it out the same way.
        pool = UnifiedPool(packer.num_pages, page_elems, cfg.dtype, torch.device("meta"))
        resident = ResidentAdapter(weights, pool, cfg, columns_for(cfg))
        assert len(resident.pages) == packer.num_pages
        assert resident.fragmentation == pytest.approx(packer.fragmentation())
        figures[label] = (packer.num_pages, packer.fragmentation())
    print(
        "\nLlama-7B adapters in 2 MiB fp16 pages: "
        + "; ".join(f"{k}: {n} pages, {f:.3%} waste" for k, (n, f) in figures.items())
    )
    # r16 on q,k,v,o: rows of 4096 tile a page exactly (128 * 4096 elements per layer).
    assert figures["r16 q,k,v,o"] == (16, 0.0)
    for _, frag in figures.values():
        assert frag < 0.02


def fill_with_idle_adapters(world: World, names: list[str]) -> list[str]:
    loaded = []
    for name in names:
        if (
            pages_needed(world.cache.host[name], world.cfg, world.pool.page_elems)
            > world.pool.num_free
        ):
            continue
        r = world.cache.acquire(name)
        assert r is not None
        world.loaded_from[id(r)] = world.cache.host[name]
        world.cache.release(r)
        loaded.append(name)
    return loaded


def test_kv_and_adapter_split_moves_with_load():
    world = World(seed=5, num_pages=64, page_elems=2048, num_names=40)
    for name in world.names:
        world.cache.add(random_weights(name, world.cfg, world.rng, world.gen))
    # 1. idle (released) adapters fill the pool
    loaded = fill_with_idle_adapters(world, world.names)
    s0 = world.pool.stats()
    assert len(loaded) >= 3 and s0.kv_pages == 0 and s0.pinned_pages == 0
    assert s0.adapter_pages >= 56, s0
    world.check(None)

    # 2. KV takes pages by evicting idle adapters, least recently used first
    seq = new_seq(0)
    world.seqs[0], world.stamps[0] = seq, 1.0
    tokens = 40 * world.kv.block_size  # 40 blocks, more than are free
    assert world.kv.blocks_for(tokens) > s0.free_pages
    assert world.kv.ensure(seq, tokens)
    for page in seq.block_table:
        world.kv.view[page].fill_(1.0)
    s1 = world.pool.stats()
    assert s1.kv_pages == 40
    assert s1.adapter_pages < s0.adapter_pages
    evicted = [n for n in loaded if n not in world.cache.resident]
    assert evicted and evicted == loaded[: len(evicted)], "evicts least recently used first"
    world.check(None)

    # 3. a pinned adapter keeps its pages: KV cannot have more than free + idle
    kept = next(n for n in loaded if n in world.cache.resident)
    pinned = world.cache.acquire(kept)
    world.held.append(pinned)
    other = new_seq(1)
    too_many = world.pool.num_pages - len(pinned.pages) - s1.kv_pages + 1
    assert not world.kv.ensure(other, too_many * world.kv.block_size)
    assert other.block_table == [] and world.cache.resident[kept] is pinned
    world.check(None)
    world.release()

    # 4. KV finishes; adapters fill the idle pages again
    world.free_kv()
    s2 = world.pool.stats()
    assert s2.kv_pages == 0
    fill_with_idle_adapters(world, world.names)
    s3 = world.pool.stats()
    assert s3.adapter_pages > s2.adapter_pages and s3.adapter_pages >= 56, s3
    world.check(None)
    world.drain()


def test_replacing_or_removing_a_pinned_adapter_frees_it_on_release():
    world = World(seed=11, num_pages=64, page_elems=2048, num_names=2)
    world.cache.add(fixed_weights("a0", world.cfg, 8, ("q_proj", "v_proj"), world.gen))
    r = world.cache.acquire("a0")
    assert r is not None
    world.loaded_from[id(r)] = world.cache.host["a0"]
    world.held.append(r)
    pages = list(r.pages)
    world.cache.add(fixed_weights("a0", world.cfg, 16, TARGETS, world.gen))  # replaced while in use
    world.retired.add(r)
    assert world.cache.resident.get("a0") is None
    assert (world.pool.kind[pages] == PageKind.ADAPTER).all(), "in-use pages freed early"
    world.check(None)
    r2 = world.cache.acquire("a0")  # the new version loads beside the old one
    assert r2 is not None and r2 is not r and not set(r2.pages) & set(pages)
    world.loaded_from[id(r2)] = world.cache.host["a0"]
    world.held.append(r2)
    world.check(None)
    world.cache.remove("a0")  # removed while the new version is in use too
    world.retired.add(r2)
    world.check(None)
    world.drain()


def test_a_bfloat16_kv_cache_holds_twice_a_float32_pages_tokens_in_the_same_pages():
    """kv_cache_dtype bfloat16 under a float32 model: the pool's pages and what it counts
    are unchanged, each page holds twice the tokens, and what is written through `rows`
    is read back through `view` rounded to bfloat16; a cache wider than the pool is
    refused with the reason."""
    cfg = ModelConfig.from_dict(SMALL)
    page_elems = 2 * cfg.kv_elems_per_token() * 4  # 4 float32 tokens of KV
    pool = UnifiedPool(8, page_elems, torch.float32, CPU)
    wide, narrow = KVCache(pool, cfg), KVCache(pool, cfg, torch.bfloat16)
    assert (wide.block_size, narrow.block_size) == (8, 16)
    assert narrow.view.dtype == narrow.rows.dtype == narrow.dtype == torch.bfloat16
    assert narrow.view.shape[0] == pool.num_pages == 8
    assert narrow.rows.untyped_storage().data_ptr() == pool.arena.untyped_storage().data_ptr()
    seq = new_seq(0)
    assert narrow.ensure(seq, 17) and len(seq.block_table) == 2  # 17 tokens: two pages
    assert pool.stats().kv_pages == 2
    pages, offsets = narrow.slots(seq, 0, 17)
    rows = narrow.write_rows(pages, offsets)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(cfg.num_layers, 2, 17, cfg.kv_size, generator=g)
    for layer in range(cfg.num_layers):
        for half in range(2):
            narrow.rows.index_copy_(0, rows[layer, half], kv[layer, half].to(torch.bfloat16))
    for t, (page, offset) in enumerate(zip(pages, offsets, strict=True)):
        got = narrow.view[page, :, :, offset].reshape(cfg.num_layers, 2, cfg.kv_size)
        assert torch.equal(got, kv[:, :, t].to(torch.bfloat16))
    narrow.free(seq)
    assert pool.stats().kv_pages == 0
    half = UnifiedPool(8, page_elems, torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="cannot be wider than the pool's torch.bfloat16"):
        KVCache(half, cfg, torch.float32)
