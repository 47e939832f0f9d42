"""One replica of the fleet simulator: the replica simulator (the real Scheduler,
AdapterCache and pool accounting) plus what a replica deployment adds around its engine.

Adapters come from an artifact store through the read model replicas apply in the real
bench (one stream per replica: latency, then bytes / bandwidth after the previous read).
Two deployments, as the real bench runs them:

    sync       replica/deployment.py + replica/adapter_sync.py: an adapter is read on its
               first request here (concurrent requests wait for one read), then stays in
               the host tier within `host_bytes` (least recently used dropped, read again
               inside the device load that needs it: AdapterCache's disk tier)
    multiplex  benchmarks/router/apps.py MultiplexedReplica under Ray's `@serve.multiplexed`:
               a per-replica LRU of `models_per_replica` adapters, loaded one at a time,
               each load a read into the engine under a name of its own; an evicted one
               leaves the engine when its last request ends

Both then load adapters host -> device over the profile's link, as the engine's cache does.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.benchmarks.peers.ray_routers import MultiplexLRU
from loraplex.benchmarks.sim.replica import (
    AdapterMeta,
    SimClock,
    SimLink,
    SimReplica,
    System,
)
from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest
from loraplex.replica.demand import AdapterDemand
from loraplex.replica.engine import batch_adapters, queued_prefill_tokens
from loraplex.replica.routing_report import routing_stats


@dataclass(frozen=True, slots=True)
class StoreModel:
    """The artifact tier as a replica sees it: `latency_s` per read, then `bytes_per_s`."""

    bytes_per_s: float
    latency_s: float

    def read_s(self, nbytes: int) -> float:
        """One read alone."""
        return self.latency_s + nbytes / self.bytes_per_s


class StoreLink:
    """A replica's reads from the artifact store, as replica/memory/store_reads.py paces
    them: one after another on one stream, each paying the latency beside the others:
    finish = max(submitted + latency, previous finish) + bytes / bandwidth."""

    def __init__(self, store: StoreModel, clock: SimClock):
        self.store = store
        self.clock = clock
        self.busy_until = 0.0
        self.items: list[tuple[float, object]] = []  # (finishes at, token), in order

    def submit(self, token: object, nbytes: int) -> None:
        begin = max(self.clock() + self.store.latency_s, self.busy_until)
        self.busy_until = begin + nbytes / self.store.bytes_per_s
        self.items.append((self.busy_until, token))

    def next_done(self) -> float | None:
        return self.items[0][0] if self.items else None

    def done(self) -> list[object]:
        now = self.clock()
        finished = [token for at, token in self.items if at <= now]
        self.items = self.items[len(finished) :]
        return finished


class FleetLink:
    """The engine cache's transfer: a device load over the host link, preceded by a read
    from the store when the cache had dropped the adapter's host copy (`reading` is set by
    the cache's re-read callable while the load's job runs)."""

    def __init__(self, host: SimLink, store: StoreLink):
        self.host = host
        self.store = store
        self.reading = False
        self._rereads: dict[object, int] = {}
        self.first_reads: list[object] = []  # first-use reads the replica submitted, done
        self.fresh: set[str] = set()  # engine names read for a request, not yet on the device
        self.host_hits = 0  # device loads from a host copy held before the request came

    def submit(
        self, token: object, nbytes: int, job: Callable[[], None], join: bool = True
    ) -> None:
        self.reading = False
        job()
        if self.reading:
            self._rereads[token] = nbytes
            self.store.submit(("reread", token), nbytes)
            return
        name = getattr(token, "name", None)
        if name in self.fresh:
            self.fresh.discard(name)
        else:
            self.host_hits += 1
        self.host.submit(token, nbytes, _nothing)

    def collect(self) -> None:
        for token in self.store.done():
            if isinstance(token, tuple) and token[0] == "reread":
                self.host.submit(token[1], self._rereads.pop(token[1]), _nothing)
            else:
                self.first_reads.append(token)

    def wait(self, timeout_s: float) -> None:
        return None  # simulated time: the replica's event loop advances it

    def done(self) -> list[object]:
        self.collect()
        return self.host.done()

    def next_done(self) -> float | None:
        times = [t for t in (self.host.next_done(), self.store.next_done()) if t is not None]
        return min(times, default=None)

    @property
    def busy_s(self) -> float:
        return self.host.busy_s


def _nothing() -> None:
    pass


class FleetReplica:
    def __init__(
        self,
        replica_id: str,
        profile,
        system: System,
        max_len: int,
        store: StoreModel,
        catalog: dict[str, AdapterSpec],
        models_per_replica: int | None = None,
        *,
        demand: AdapterDemand,
    ):
        """`models_per_replica`: None for the sync deployment, else the multiplex LRU's size;
        `demand` the adapters' demand it keeps, as the deployment does."""
        self.replica_id = replica_id
        self.catalog = catalog
        self.links: FleetLink | None = None

        def link(clock: SimClock) -> FleetLink:
            host = SimLink(profile.link_bytes_per_s, profile.load_setup_s, clock)
            self.links = FleetLink(host, StoreLink(store, clock))
            return self.links

        self.sim = SimReplica(profile, system, [], max_len, link=link)
        assert self.links is not None
        self.clock = self.sim.clock
        self.max_concurrency = system.scheduler.max_num_seqs
        self.lru = None if models_per_replica is None else MultiplexLRU(models_per_replica)
        self.in_flight = 0  # routed here and not finished: what Serve's router counts
        self.reading: dict[str, float] = {}  # adapter (or lease) -> read started at
        self.waiting: dict[str, list[SimRequest]] = {}  # requests waiting on that read
        self.leases: dict[str, str] = {}  # multiplexed model -> its engine name
        self.lease_users: Counter[str] = Counter()
        self.evicted: set[str] = set()
        self.read_seconds = 0.0  # reads on first use, start to done
        self.first_reads = 0  # those reads, done
        self.reads = 0  # every read from the store, re-reads included
        self.requests_total = 0
        self.predicted_held = 0  # placements whose router's view had the adapter held here
        self.placement_misses = 0  # of those, placements that waited for a store read
        self.multiplex_loads = 0
        self.alive = True
        self._collected = 0
        self._routed: dict[int, SimRequest] = {}  # by rid, as the router sent them
        self.demand = demand

    # -- requests

    def admit(self, req: SimRequest, predicted_held: bool = False) -> None:
        """A request the router sent here, at the replica's current time; `predicted_held`:
        the router's view had its adapter here, on the device or with a host copy."""
        if predicted_held:
            self.predicted_held += 1
            self.placement_misses += self.needs_read(req.adapter)
        self.in_flight += 1
        self.requests_total += 1
        self._routed[req.rid] = req
        adapter = req.adapter
        if adapter is not None:
            self.demand.asked(adapter, self.catalog[adapter].nbytes, self.clock.now)
        if adapter is None:
            self._enqueue(req, None)
        elif self.lru is None:
            if adapter in self.sim.cache:
                self._enqueue(req, adapter)
            else:
                self.waiting.setdefault(adapter, []).append(req)
                if adapter not in self.reading:
                    self._read(adapter)
        elif self.lru.use(adapter):
            self._enqueue(req, self.leases[adapter])
        else:
            self.waiting.setdefault(adapter, []).append(req)
            self._next_multiplex_load()

    def needs_read(self, adapter: str | None) -> bool:
        """Would a request of `adapter` arriving now wait for a read from the store (its
        first read here, one in flight, or a re-read of a host copy the budget dropped)?"""
        if adapter is None:
            return False
        if self.lru is not None:
            return adapter not in self.leases
        cache = self.sim.cache
        return adapter not in cache or (
            cache.tier(adapter) != "device" and adapter not in cache.host
        )

    def held(self) -> set[str]:
        """Adapters held on the device or in the host tier (multiplexed leases by model)."""
        cache = self.sim.cache
        return {name.split("#")[0] for name in (*cache.resident, *cache.host)}

    def _enqueue(self, req: SimRequest, engine_name: str | None) -> None:
        if engine_name is not None and engine_name != req.adapter:
            self.lease_users[engine_name] += 1
            req = dataclasses.replace(req, adapter=engine_name)
        self.sim.add(req)

    def _read(self, adapter: str) -> None:
        self.reading[adapter] = self.clock.now
        self.reads += 1
        self.links.store.submit(adapter, self.catalog[adapter].nbytes)

    def _next_multiplex_load(self) -> None:
        started = self.lru.start_next_load()
        if started is None:
            return
        model, evicted = started
        if evicted is not None:
            self.evicted.add(self.leases.pop(evicted))
            self._drop_unused_leases()
        self._read(model)

    def _reread(self, adapter: str) -> Callable[[], AdapterMeta]:
        spec = self.catalog[adapter]

        def read() -> AdapterMeta:
            self.links.reading = True
            self.reads += 1
            return AdapterMeta(adapter, spec.rank, spec.nbytes)

        return read

    def _read_done(self, adapter: str) -> None:
        self.read_seconds += self.clock.now - self.reading.pop(adapter)
        self.first_reads += 1
        spec = self.catalog[adapter]
        if self.lru is None:
            self.sim.rank[adapter] = spec.rank
            self.sim.cache.add(AdapterMeta(adapter, spec.rank, spec.nbytes), self._reread(adapter))
            name = adapter
        else:
            self.multiplex_loads += 1
            name = f"{adapter}#{self.multiplex_loads}"
            self.sim.rank[name] = spec.rank
            self.sim.cache.add(AdapterMeta(name, spec.rank, spec.nbytes))
            self.lru.loaded(adapter)
            self.leases[adapter] = name
        self.links.fresh.add(name)
        for req in self.waiting.pop(adapter, []):
            self._enqueue(req, name)
        if self.lru is not None:
            self._next_multiplex_load()

    def _drop_unused_leases(self) -> None:
        for name in [n for n in self.evicted if self.lease_users[n] == 0]:
            self.evicted.discard(name)
            self.sim.cache.remove(name)

    # -- time

    def advance_until(self, t: float) -> None:
        """Run the replica until its clock reaches t (a step may end after it); t = inf
        runs until nothing is left to do."""
        if self._idle():
            self.clock.now = max(self.clock.now, t) if not math.isinf(t) else self.clock.now
            return
        while self.clock.now < t:
            self._collect()
            reads = self.links.store.next_done()
            until = t if reads is None else min(t, reads)
            if not self.sim.step(until=until) and reads is None:
                if math.isinf(t):
                    assert not self.sim.scheduler.has_work(), "the replica is stuck"
                    break
            self._collect()

    def _idle(self) -> bool:
        """Nothing queued, running, loading or being read: time can jump."""
        links = self.links
        return (
            not self.sim.scheduler.has_work()
            and not links.store.items
            and not links.host.active
            and not links.first_reads
        )

    def _collect(self) -> None:
        self.links.collect()
        reads, self.links.first_reads = self.links.first_reads, []
        for adapter in reads:
            self._read_done(adapter)
        done = self.sim.done[self._collected :]
        self._collected = len(self.sim.done)
        for record in done:
            self.in_flight -= 1
            del self._routed[record.request.rid]
            name = record.request.adapter
            if name in self.lease_users:
                self.lease_users[name] -= 1
        if done and self.evicted:
            self._drop_unused_leases()

    # -- what the router sees

    @property
    def mean_read_s(self) -> float | None:
        """The mean first-use read, start to done (AdapterSync.mean_read_s; None before
        the first)."""
        return self.read_seconds / self.first_reads if self.first_reads else None

    def routing_stats(self) -> dict:
        """The sync deployment's `record_routing_stats` (replica/deployment.py): the same
        function (replica/routing_report.py) over the same state: the engine's stats as
        `engine_stats` gives them, the reads on first use (AdapterSync's), the requests
        held, in all and per adapter."""
        published = routing_stats(
            self.engine_stats(),
            reading=self.reading,
            read_s=self.mean_read_s,
            in_flight=self.in_flight,
            adapter_queue=self.adapter_queue(),
            max_concurrency=self.max_concurrency,
            recorded_at=self.clock.now,
        )
        published["requests_total"] = self.requests_total
        return published

    def adapter_queue(self) -> Counter[str]:
        """Requests held per adapter."""
        return Counter(r.adapter for r in self._routed.values() if r.adapter)

    def engine_stats(self) -> dict:
        """What the engine's `stats()` (replica/engine.py) holds of what routing reads."""
        cache, costs = self.sim.cache, self.sim.step_costs.estimate()
        return {
            "adapters": {
                "resident": list(cache.resident),
                "loading": list(cache.loading),
                "host": list(cache.host),
                "load_seconds": cache.stats.load_seconds,
                "loads": cache.stats.loads,
            },
            "pool": {"free_pages": self.sim.pool.num_free, "num_pages": self.sim.pool.num_pages},
            "step_costs": None if costs is None else dataclasses.asdict(costs),
            "prefix_cache": {"enabled": False},
            "queued_prefill_tokens": queued_prefill_tokens(self.sim.scheduler),
            "running": len(self.sim.scheduler.running),
            "waiting_for_pages": self.sim.scheduler.waiting_for_pages,
            "step_token_budget": self.sim.scheduler.cfg.max_num_batched_tokens,
            "batch_adapters": batch_adapters(self.sim.scheduler),
            "max_loras_per_batch": self.sim.scheduler.cfg.max_loras_per_batch,
        }

    def model_ids(self) -> frozenset[str]:
        """What `@serve.multiplexed` reports: loaded and loading models."""
        return frozenset() if self.lru is None else self.lru.reported()

    # -- failure

    def kill(self) -> tuple[list[tuple[SimRequest, float, int]], list[SimRequest]]:
        """The replica dies: the streams that had begun, as (request as routed here, its
        first token's time, tokens streamed; the ingress resumes them elsewhere after those),
        and the requests without a first token (the ingress retries them elsewhere)."""
        self.alive = False
        started = [
            (self._routed[r.request.rid], r.first_token, len(seq.output_ids))
            for seq, r in self.sim.records.items()
            if not math.isnan(r.first_token)
        ]
        begun = {req.rid for req, _, _ in started}
        retry = [req for rid, req in self._routed.items() if rid not in begun]
        self.sim.records.clear()
        self.waiting.clear()
        self._routed.clear()
        return started, retry

    # -- what it cost

    def load_seconds(self) -> float:
        """Time spent loading adapters: reads on first use (multiplexed loads) plus device
        loads (re-reads from the store included)."""
        return self.read_seconds + self.sim.cache.stats.load_seconds

    def counters(self) -> dict:
        stats = self.sim.cache.stats
        return {
            "device_loads": stats.loads,
            "store_reads": self.reads,
            "load_seconds": self.load_seconds(),
            "multiplexed_loads": self.multiplex_loads,
            "evictions": stats.evictions,
            "host_drops": stats.host_drops,
            "host_hits": self.links.host_hits,
            "predicted_held": self.predicted_held,
            "placement_misses": self.placement_misses,
            "preemptions": self.sim.scheduler.num_preemptions,
            "steps": self.sim.steps,
            "step_seconds": self.sim.busy_s,
            "step_rows": sum(self.sim.batch_sizes),  # a prefill chunk or a decode row each
        }
