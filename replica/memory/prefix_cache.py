"""The prefix cache: full KV blocks kept after their requests end, found again by content.

A block's key chains: key(i) = H(key(i-1), its token ids), from a root H(adapter version,
salt) (replica/prefix_keys.py: one definition, which the router keys prompts with too). So a block matches only the same tokens after the same prefix, computed with the
same adapter weights (the version is a content digest: other weights registered under a
name never reuse the old name's blocks; the base model has no version), within the same
salt. The salt is the tenant, narrowed by the request's own `cache_salt`, so tenants never
share blocks (a shared cache would leak another tenant's prompts through TTFT timing);
`share_base` lets base-model blocks be shared across tenants, never adapter blocks.

Blocks live in the unified pool. A block held by running requests is a KV page with a
reference count (kv_cache.py): shared by many requests, it is one page. When its last
holder leaves, a registered block is parked here as a CACHED page: idle, found by its key,
evictable. Idle blocks go cheapest first: least often used (a use count halving every
`half_life_s`), deepest in its chain on a tie, since a block is only reachable through its
parent. Whether an idle block or an idle adapter goes is decided with the adapter cache, by
the cost of losing each (adapter_cache.py `_evict`).

`share` (a comparison baseline, not the default) gives cached blocks a static share of the
pool instead: they never exceed it and are evicted for other pages only as a last resort.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.replica.memory.eviction import decayed
from loraplex.replica.memory.pool import PageKind, UnifiedPool
from loraplex.replica.prefix_keys import extend_block_keys, prefix_root


@dataclass(slots=True, eq=False)
class CachedBlock:
    key: bytes
    page: int
    depth: int  # its index in the chain (0: the first block of a prompt)
    frequency: float = 0.0
    last_used: float = float("-inf")
    stamp: int = 0  # bumped when it leaves the idle heap: older heap entries are stale

    def order(self, half_life_s: float) -> float:
        """log2 of its decayed use count, plus a constant all blocks share at any instant:
        the order it gives does not change while blocks sit idle."""
        return math.log2(max(self.frequency, 1e-300)) + self.last_used / half_life_s


@dataclass(slots=True)
class PrefixStats:
    lookups: int = 0  # admissions that looked the cache up
    hit_blocks: int = 0
    miss_blocks: int = 0  # full blocks looked up and not found
    hit_tokens: int = 0
    evictions: int = 0  # idle cached blocks evicted
    registered: int = 0  # blocks that entered the cache


class PrefixCache:
    def __init__(
        self,
        pool: UnifiedPool,
        block_size: int,
        *,
        half_life_s: float,
        share_base: bool,
        share: float | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool = pool
        self.block_size = block_size
        self.clock = clock
        self.half_life_s = half_life_s
        self.share_base = share_base
        self.share = share
        self.blocks: dict[bytes, CachedBlock] = {}
        self.by_page: dict[int, CachedBlock] = {}
        self._idle: list[tuple[float, int, int, int, CachedBlock]] = []  # lazy min-heap
        self._ticket = itertools.count()
        self.num_idle = 0
        self.stats = PrefixStats()

    # keys

    def root(self, version: str | None, tenant: str | None, cache_salt: str | None) -> bytes:
        """The chain's root for a request: its adapter's version (None: the base model)
        and its salt (replica/prefix_keys.py, the function the router keys prompts with)."""
        return prefix_root(version, tenant, cache_salt, share_base=self.share_base)

    def extend_keys(self, keys: list[bytes], root: bytes, tokens: list[int], n: int) -> None:
        """Append the keys of blocks len(keys)..n-1 of `tokens` to the chain `keys`."""
        extend_block_keys(keys, root, tokens, self.block_size, n)

    # requests

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Pages of the longest cached prefix of the chain `keys`."""
        pages = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                break
            pages.append(block.page)
        return pages

    def take(self, pages: list[int]) -> None:
        """A request holds these cached pages now: idle ones leave the idle heap."""
        idle = [p for p in pages if self.pool.kind[p] == PageKind.CACHED]
        for page in idle:
            self.by_page[page].stamp += 1
        self.num_idle -= len(idle)
        if idle:
            self.pool.retag(idle, PageKind.KV)

    def touch(self, pages: list[int]) -> None:
        """One more request used these blocks (those that are registered)."""
        now = self.clock()
        for page in pages:
            block = self.by_page.get(page)
            if block is not None:
                block.frequency = (
                    decayed(block.frequency, block.last_used, now, self.half_life_s) + 1.0
                )
                block.last_used = now

    def register(self, key: bytes, page: int, depth: int) -> None:
        """A request filled block `depth` of its chain in `page`. If another page holds the
        key already (two requests computed it at once), this one stays private."""
        if key in self.blocks or page in self.by_page:
            return
        block = CachedBlock(key, page, depth)
        self.blocks[key] = self.by_page[page] = block
        self.stats.registered += 1
        self.touch([page])

    def park(self, pages: list[int]) -> list[int]:
        """Pages whose last holder left: registered ones stay as idle cached blocks; the
        others are returned, to be freed."""
        free = []
        parked = []
        for page in pages:
            block = self.by_page.get(page)
            if block is None:
                free.append(page)
                continue
            parked.append(page)
            block.stamp += 1
            entry = (block.order(self.half_life_s), -block.depth, next(self._ticket))
            heapq.heappush(self._idle, (*entry, block.stamp, block))
        if parked:
            self.pool.retag(parked, PageKind.CACHED)
            self.num_idle += len(parked)
            self._compact()
        if self.share is not None:
            while self.num_idle > self.cap:
                self.evict_cheapest()
        return free

    # eviction

    @property
    def cap(self) -> int:
        """Idle cached blocks allowed under a static share (all of the pool otherwise)."""
        if self.share is None:
            return self.pool.num_pages
        return math.floor(self.share * self.pool.num_pages)

    def cheapest(self) -> CachedBlock | None:
        """The idle block that goes first, or None."""
        heap = self._idle
        while heap:
            *_, stamp, block = heap[0]
            if stamp == block.stamp and self.by_page.get(block.page) is block:
                return block
            heapq.heappop(heap)
        return None

    def frequency_at(self, block: CachedBlock, now: float) -> float:
        return decayed(block.frequency, block.last_used, now, self.half_life_s)

    def evict_cheapest(self) -> int:
        """Free the cheapest idle block's page; the pages freed (0 when none is idle)."""
        block = self.cheapest()
        if block is None:
            return 0
        heapq.heappop(self._idle)
        self._forget(block)
        self.num_idle -= 1
        self.pool.free([block.page])
        self.stats.evictions += 1
        return 1

    def clear(self) -> int:
        """Drop every cached block: idle ones are freed, those held by running requests
        stay with them as private blocks. The pages freed."""
        idle = [p for p, b in self.by_page.items() if self.pool.kind[p] == PageKind.CACHED]
        self.blocks.clear()
        self.by_page.clear()
        self._idle.clear()
        self.num_idle = 0
        self.pool.free(idle)
        return len(idle)

    def _forget(self, block: CachedBlock) -> None:
        del self.blocks[block.key]
        del self.by_page[block.page]

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber the live ones."""
        if len(self._idle) > 2 * self.num_idle + 64:
            self._idle = [e for e in self._idle if e[3] == e[4].stamp and e[4].page in self.by_page]
            heapq.heapify(self._idle)
