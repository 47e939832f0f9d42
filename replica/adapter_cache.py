"""Adapters known to the engine (host tier) and those resident in the pool (device tier).

A running request pins its adapter's pages. Unpinned resident adapters stay warm in idle
pages and are evicted, least recently used first, when the pool needs pages — for another
adapter or for KV blocks (the pool calls `reclaim`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.replica.adapters import AdapterWeights, ResidentAdapter
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.pool import PoolExhausted, UnifiedPool


class UnknownAdapter(KeyError):
    pass


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    bytes_loaded: int = 0


class AdapterCache:
    def __init__(
        self,
        pool: UnifiedPool,
        model: ModelConfig,
        columns: Callable[[int], dict[str, tuple[int, int]]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool = pool
        self.model = model
        self.columns = columns
        self.clock = clock
        self.host: dict[str, AdapterWeights] = {}
        self.resident: dict[str, ResidentAdapter] = {}
        self.last_used: dict[str, float] = {}
        self._retired: set[ResidentAdapter] = set()  # removed or replaced while still pinned
        self.stats = CacheStats()
        pool.set_reclaimer(self.reclaim)

    def __contains__(self, name: str) -> bool:
        return name in self.host

    def add(self, weights: AdapterWeights) -> None:
        """Register (or replace) an adapter. A replaced one still in use keeps serving the
        requests that hold it and is freed when they finish."""
        self._retire(weights.name)
        self.host[weights.name] = weights

    def remove(self, name: str) -> None:
        if name not in self.host:
            raise UnknownAdapter(name)
        self._retire(name)
        del self.host[name]

    def _retire(self, name: str) -> None:
        resident = self.resident.pop(name, None)
        if resident is None:
            return
        if resident.pins > 0:
            self._retired.add(resident)
        else:
            self.pool.free(resident.pages)

    def is_resident(self, name: str) -> bool:
        return name in self.resident

    def acquire(self, name: str) -> ResidentAdapter | None:
        """Make `name` resident and pin it. None if its pages cannot be found without
        evicting a pinned adapter or KV blocks."""
        if name not in self.host:
            raise UnknownAdapter(name)
        resident = self.resident.get(name)
        if resident is None:
            try:
                resident = ResidentAdapter(self.host[name], self.pool, self.model, self.columns)
            except PoolExhausted:
                return None
            self.resident[name] = resident
            self.stats.misses += 1  # counted once per load, not per retry while pages are short
            self.stats.loads += 1
            self.stats.bytes_loaded += self.host[name].nbytes
        else:
            self.stats.hits += 1
        if resident.pins == 0:
            self.pool.pin(resident.pages)
        resident.pins += 1
        self.last_used[name] = self.clock()
        return resident

    def release(self, resident: ResidentAdapter) -> None:
        resident.pins -= 1
        assert resident.pins >= 0, "adapter released more often than acquired"
        if resident.pins > 0:
            return
        self.pool.unpin(resident.pages)
        if resident in self._retired:
            self._retired.discard(resident)
            self.pool.free(resident.pages)

    def reclaim(self, pages_needed: int) -> None:
        """Evict unpinned resident adapters, least recently used first, until
        `pages_needed` pages are freed or none is left to evict."""
        idle = sorted(
            (n for n, r in self.resident.items() if r.pins == 0), key=self.last_used.__getitem__
        )
        if sum(len(self.resident[n].pages) for n in idle) < pages_needed:
            return  # evicting would not be enough: keep the cache warm
        freed = 0
        for name in idle:
            if freed >= pages_needed:
                break
            resident = self.resident.pop(name)
            self.pool.free(resident.pages)
            freed += len(resident.pages)
            self.stats.evictions += 1
