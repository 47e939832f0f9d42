"""The adapter cache (Chameleon, seed 004 §4.2): three tiers, device pool ← host memory ←
artifact store on disk.

- Device: adapters resident in pool pages. A running request pins its adapter; idle
  adapters stay warm in idle pages and leave, in the eviction policy's order, when the
  pool needs the pages — for another adapter or for KV blocks (the pool calls `reclaim`).
  Adapters of queued requests (`want`) are kept unless memory forces it. With a prefix
  cache, idle cached KV blocks are evictable too, and one decision picks between the next
  adapter and the next block: the cheaper to lose (eviction.py `victims`).
- Host: the registered weights in memory (pinned on CUDA). With a `host_bytes` budget the
  least recently used ones are dropped and read again from disk; a copy just made (added,
  or read back) counts as just used, and adapters of queued requests keep theirs: a
  copy read for a request is never dropped before that request runs on it.
- Loads go through a `Transfer` (a copy thread beside the compute, or the simulator's
  link): `acquire` starts a missing adapter's load and answers None until it is ready.

Dynamic sizing with hysteresis: when KV needs pages, `reclaim` frees `low_watermark` of
the pool beyond the shortfall, so that a batch growing one block per step does not evict
once per step; prefetch loads only while `high_watermark` of the pool stays free.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from loraplex.replica.config import CacheConfig
from loraplex.replica.demand import DEMAND_TAU_S
from loraplex.replica.memory.adapters import AdapterWeights, PoolLayout
from loraplex.replica.memory.eviction import (
    AdapterUsage,
    EvictionPolicy,
    RestoreCosts,
    make_eviction,
    victims,
)
from loraplex.replica.memory.pool import PageKind, UnifiedPool
from loraplex.replica.memory.transfer import CopyThread, Immediate, Transfer

if TYPE_CHECKING:
    from loraplex.replica.memory.prefix_cache import PrefixCache

log = logging.getLogger(__name__)


class UnknownAdapter(KeyError):
    pass


@dataclass(slots=True)
class CacheStats:
    hits: int = 0  # acquisitions that found the adapter on the device
    misses: int = 0  # loads started for a request (not prefetches)
    loads: int = 0  # every load, prefetches included
    evictions: int = 0
    bytes_loaded: int = 0
    host_hits: int = 0  # loads served from host memory
    disk_reads: int = 0  # loads that first read the artifact from disk
    # disk reads within `reread_window_s` of the same adapter's previous load here (from
    # either tier): a working set the tiers cannot keep, read again and again; not an
    # adapter whose demand came back long after it was last here (after a step down, the
    # leaving replica's adapters at homes that last had them long before), read once
    quick_rereads: int = 0
    prefetches: int = 0
    reclaims: int = 0  # times KV demand evicted adapters
    host_drops: int = 0  # host copies dropped for the host budget
    load_seconds: float = 0.0  # sum over loads of start -> ready
    load_seconds_max: float = 0.0
    load_failures: int = 0  # copies that raised (e.g. an artifact that went missing)


class Resident(Protocol):
    name: str
    pins: int
    pages: list[int]


class AdapterLayout(Protocol):
    """How adapters take pool pages: the engine's `PoolLayout`, or the simulator's,
    which counts pages and moves no data."""

    def num_pages(self, weights) -> int: ...

    def skeleton(self, weights):
        """What `place` needs of the weights (shapes), kept while the weights are on disk."""

    def place(self, weights, pages: list[int]) -> Resident: ...

    def fill(self, resident: Resident, weights) -> None: ...


@dataclass(slots=True)
class _Entry:
    """A registered adapter. `weights` is None while it lives on disk only."""

    name: str
    version: str | None  # content digest: what cached KV blocks computed with it are keyed by
    nbytes: int
    pages: int
    usage: AdapterUsage
    skeleton: object
    weights: object | None
    read: Callable[[], object] | None  # reads it from the artifact store again
    # when its host copy was last made or refreshed: added, or a load of it finished (from
    # the host tier or read back from disk); quick_rereads reads it as its last load here
    host_at: float = float("-inf")

    def host_recency(self) -> float:
        """When the host copy was last used or made: what the host budget drops by."""
        return max(self.usage.last_used, self.host_at)


class AdapterCache:
    def __init__(
        self,
        pool: UnifiedPool,
        model,
        columns: Callable | None = None,
        clock: Callable[[], float] = time.monotonic,
        config: CacheConfig | None = None,
        layout: AdapterLayout | None = None,
        transfer: Transfer | None = None,
        eviction: EvictionPolicy | None = None,
        blocks: PrefixCache | None = None,
        restore_costs: Callable[[], RestoreCosts] | None = None,
    ):
        """`blocks`: the prefix cache whose idle blocks share the eviction decision, with
        `restore_costs` to weigh them against adapters."""
        assert (blocks is None) == (restore_costs is None), "blocks need restore_costs"
        self.cfg = config or CacheConfig()
        self.pool = pool
        self.clock = clock
        self.layout = layout or PoolLayout(pool, model, columns)
        if transfer is None:
            transfer = (
                CopyThread(pool.arena.device) if self.cfg.loading == "thread" else Immediate()
            )
        self.transfer = transfer
        self.eviction = eviction or make_eviction(self.cfg.eviction, self.cfg.half_life_s)
        self.blocks = blocks
        self.restore_costs = restore_costs
        self.entries: dict[str, _Entry] = {}
        self.host: dict[str, AdapterWeights] = {}  # the host tier: weights in memory
        self._host_bytes = 0  # their bytes, kept as it changes: the budget check is O(1)
        self.resident: dict[str, Resident] = {}  # the device tier, ready to use
        self.loading: dict[str, Resident] = {}  # pages taken, copy in flight
        self._started: dict[Resident, float] = {}
        self._retired: set[Resident] = set()  # removed or replaced while pinned or loading
        self.wanted: dict[str, None] = {}  # adapters of queued requests, in admission order
        self._copy_errors: dict[Resident, BaseException] = {}  # written by the copy job
        self.failed: dict[str, str] = {}  # adapter -> why its last load failed, until taken
        self.stats = CacheStats()
        # what counts as a quick re-read: the autoscaling policy's demand window
        # (`lora.demand_window_s`; the deployment and the fleet simulator set it)
        self.reread_window_s = DEMAND_TAU_S
        pool.set_reclaimer(self.reclaim)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    # -- registration

    def add(self, weights, read: Callable[[], object] | None = None) -> None:
        """Register (or replace) an adapter. A replaced one still in use keeps serving the
        requests that hold it and is freed when they finish. `read` re-reads it from the
        artifact store, which lets the host budget drop its host copy."""
        self._retire(weights.name)
        old = self.entries.get(weights.name)
        usage = AdapterUsage(weights.name, weights.nbytes)
        if old is not None:
            usage.frequency, usage.last_used = old.usage.frequency, old.usage.last_used
            self._drop_host(weights.name)  # the old version's bytes
        self.entries[weights.name] = _Entry(
            weights.name,
            weights.version,
            weights.nbytes,
            self.layout.num_pages(weights),
            usage,
            self.layout.skeleton(weights),
            weights,
            read,
        )
        self._set_host(weights.name, weights)
        self._fit_host_budget()

    def remove(self, name: str) -> None:
        if name not in self.entries:
            raise UnknownAdapter(name)
        self._retire(name)
        self._drop_host(name)
        del self.entries[name]

    def _retire(self, name: str) -> None:
        loading = self.loading.pop(name, None)
        if loading is not None:
            self._retired.add(loading)  # freed when its copy finishes
        resident = self.resident.pop(name, None)
        if resident is None:
            return
        if resident.pins > 0:
            self._retired.add(resident)
        else:
            self.pool.free(resident.pages)

    def pages_of(self, name: str) -> int:
        return self.entries[name].pages

    def nbytes_of(self, name: str) -> int:
        return self.entries[name].nbytes

    def held_bytes(self) -> int:
        """The weights of the distinct adapters held now, on the device or in the host tier
        (one adapter in both counts once)."""
        return sum(self.entries[n].nbytes for n in self.resident.keys() | self.host.keys())

    def version_of(self, name: str) -> str | None:
        return self.entries[name].version

    def is_resident(self, name: str) -> bool:
        return name in self.resident

    def tier(self, name: str) -> Literal["device", "loading", "host", "disk"]:
        if name in self.resident:
            return "device"
        if name in self.loading:
            return "loading"
        return "host" if name in self.host else "disk"

    # -- use

    def acquire(self, name: str) -> Resident | None:
        """Pin `name` if it is on the device. Otherwise start its load (evicting idle
        adapters if pages are short) and answer None: ask again once it is ready. None too
        if its pages cannot be found without evicting a pinned adapter or KV blocks."""
        if name not in self.entries:
            raise UnknownAdapter(name)
        resident = self.resident.get(name)
        if resident is None:
            if name not in self.loading and self._load(name, evict=True):
                self.stats.misses += 1
                self.poll()  # an immediate transfer is done already
            resident = self.resident.get(name)
            if resident is None:
                return None
        else:
            self.stats.hits += 1
        if resident.pins == 0:
            self.pool.pin(resident.pages)
        resident.pins += 1
        entry = self.entries[name]
        now = self.clock()
        entry.usage.touch(now, self.cfg.half_life_s)
        self.eviction.touched(entry.usage, now)
        return resident

    def release(self, resident: Resident) -> None:
        resident.pins -= 1
        assert resident.pins >= 0, "adapter released more often than acquired"
        if resident.pins > 0:
            return
        self.pool.unpin(resident.pages)
        if resident in self._retired:
            self._retired.discard(resident)
            self.pool.free(resident.pages)
        elif not self.cfg.keep_idle and resident.name not in self.wanted:
            self._evict_one(resident.name)

    def want(self, names: Iterable[str]) -> None:
        """The adapters of queued requests, in the order they will be admitted."""
        self.wanted = dict.fromkeys(n for n in names if n in self.entries)

    def prefetch(self) -> None:
        """Start loads for the first `prefetch` wanted adapters that are not on the device.
        A prefetch evicts only idle adapters no queued request wants, never a pinned one,
        and leaves `high_watermark` of the pool free."""
        if self.cfg.prefetch == 0:
            return
        reserve = math.ceil(self.cfg.high_watermark * self.pool.num_pages)
        for name in list(self.wanted)[: self.cfg.prefetch]:
            if name in self.resident or name in self.loading:
                continue
            need = self.entries[name].pages + reserve
            if self.pool.num_free < need and not self._evict(
                need - self.pool.num_free, queued=False
            ):
                continue
            self._load(name, evict=False)
            self.stats.prefetches += 1
        self.poll()

    def poll(self) -> None:
        """Collect finished copies: their adapters become usable."""
        finished = self.transfer.done()  # may wait for copies (CopyThread joins them)
        now = self.clock()  # after that wait: a load lasts until the engine has it
        for resident in finished:
            started = self._started.pop(resident)
            self.stats.load_seconds += now - started
            self.stats.load_seconds_max = max(self.stats.load_seconds_max, now - started)
            error = self._copy_errors.pop(resident, None)
            if resident in self._retired:
                self._retired.discard(resident)
                self.pool.free(resident.pages)
                continue
            if error is not None:  # the requests waiting for it fail; the next one retries
                del self.loading[resident.name]
                self.pool.free(resident.pages)
                self.stats.load_failures += 1
                log.error("adapter %r failed to load", resident.name, exc_info=error)
                self.failed[resident.name] = "the adapter failed to load; retry"
                continue
            del self.loading[resident.name]
            self.resident[resident.name] = resident
            weights = self.entries[resident.name].weights
            if weights is not None:
                self._set_host(resident.name, weights)  # read back from disk: host tier again
        self._fit_host_budget()

    # -- loading and eviction

    def _load(self, name: str, evict: bool) -> bool:
        entry = self.entries[name]
        short = entry.pages - self.pool.num_free
        if short > 0 and not (evict and self._evict(short, queued=True)):
            return False
        pages = self.pool.allocate(entry.pages, PageKind.ADAPTER, reclaim=False)
        resident = self.layout.place(entry.skeleton, pages)
        self.loading[name] = resident
        self._started[resident] = self.clock()
        self.stats.loads += 1
        self.stats.bytes_loaded += entry.nbytes
        if entry.weights is None:
            self.stats.disk_reads += 1
            if self.clock() - entry.host_at <= self.reread_window_s:  # its last load here
                self.stats.quick_rereads += 1
        else:
            self.stats.host_hits += 1
        self.transfer.submit(
            resident,
            entry.nbytes,
            lambda: self._fill(resident, entry),
            join=entry.weights is not None,  # a read from the store first: not waited for
        )
        return True

    def wait_for_loads(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a load that reads from the store (one `poll` does not
        wait for) to finish; for an engine with nothing else to run."""
        self.transfer.wait(timeout_s)

    def take_failures(self) -> dict[str, str]:
        """Adapters whose load failed since the last call, with why."""
        failed, self.failed = self.failed, {}
        return failed

    def _fill(self, resident: Resident, entry: _Entry) -> None:
        """The copy job (off the engine thread). A failure is one adapter's, not the
        engine's: it is kept for `poll`, which fails the requests that wait for it."""
        try:
            self._copy(resident, entry)
        except Exception as e:
            self._copy_errors[resident] = e

    def _copy(self, resident: Resident, entry: _Entry) -> None:
        """From host memory, or from disk first."""
        weights = entry.weights
        if weights is None:
            weights = entry.read()
            entry.weights = weights  # back in the host tier; the budget is applied on poll
        self.layout.fill(resident, weights)

    def reclaim(self, pages_needed: int) -> None:
        """The pool is short of `pages_needed` pages (for KV): evict idle adapters (those no
        queued request wants first) and idle cached blocks, and with them `low_watermark`
        of the pool more."""
        extra = math.ceil(self.cfg.low_watermark * self.pool.num_pages)
        if self._evict(pages_needed, queued=True, extra=extra):
            self.stats.reclaims += 1

    def _evict(self, pages_needed: int, queued: bool, extra: int = 0) -> bool:
        """Free at least `pages_needed` pages from idle adapters (wanted ones last, and
        only if `queued`) and idle cached blocks (eviction.py `victims`), then up to `extra`
        more from ones nothing queued waits for. Evicts nothing and answers False if all
        the idle pages would not be enough."""
        now = self.clock()
        idle = [e.usage for n, e in self.entries.items() if n in self.resident]
        idle = [u for u in idle if self.resident[u.name].pins == 0]
        cold = [u for u in idle if u.name not in self.wanted]
        warm = [u for u in idle if u.name in self.wanted] if queued else []
        blocks = self.blocks
        split = blocks is not None and blocks.share is not None
        if split and not queued:  # a prefetch never takes a static share's blocks
            blocks = None
        idle_blocks = 0 if blocks is None else blocks.num_idle
        if sum(self.entries[u.name].pages for u in cold + warm) + idle_blocks < pages_needed:
            return False
        order = victims(
            self.eviction.order(cold, now),
            self.eviction.order(warm, now),
            blocks,
            self._block_first(now) if blocks is not None else None,
            blocks_last=split,
        )
        freed = 0
        for usage, spare in order:
            if freed >= pages_needed and (freed >= pages_needed + extra or not spare):
                break
            if usage is None:
                freed += self.blocks.evict_cheapest()
            else:
                freed += len(self.resident[usage.name].pages)
                self._evict_one(usage.name)
        return True

    def _block_first(self, now: float) -> Callable[[AdapterUsage], bool]:
        """Whether the cheapest idle block costs less to lose than an idle adapter."""
        blocks, costs = self.blocks, self.restore_costs()

        def first(usage: AdapterUsage) -> bool:
            block = blocks.cheapest()
            entry = self.entries[usage.name]
            block_loss = costs.block_loss(blocks.frequency_at(block, now), blocks.block_size)
            adapter_loss = costs.adapter_loss_per_page(
                usage.frequency_at(now, self.cfg.half_life_s), entry.nbytes, entry.pages
            )
            return block_loss < adapter_loss

        return first

    def _evict_one(self, name: str) -> None:
        resident = self.resident.pop(name)
        self.pool.free(resident.pages)
        self.stats.evictions += 1
        self.eviction.evicted(self.entries[name].usage)

    def _set_host(self, name: str, weights) -> None:
        self._drop_host(name)
        self.host[name] = weights
        self.entries[name].host_at = self.clock()
        self._host_bytes += self.entries[name].nbytes

    def _drop_host(self, name: str) -> None:
        if self.host.pop(name, None) is not None:
            self._host_bytes -= self.entries[name].nbytes

    def _fit_host_budget(self) -> None:
        """Drop the least recently used host copies (those that can be read again, not
        being loaded, not wanted by queued requests) until the host tier fits its budget.
        A copy wanted or in flight may leave the tier over budget until it is used."""
        budget = self.cfg.host_bytes
        if budget is None or self._host_bytes <= budget:
            return
        droppable = [
            self.entries[name]
            for name in self.host
            if self.entries[name].read is not None
            and name not in self.loading
            and name not in self.wanted
        ]
        for entry in sorted(droppable, key=_Entry.host_recency):
            if self._host_bytes <= budget:
                break
            entry.weights = None
            self._drop_host(entry.name)
            self.stats.host_drops += 1
