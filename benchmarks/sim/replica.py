"""Discrete-event simulator of one or N replicas that drives the real scheduling and cache
code: `Scheduler` (with its FIFO / SJF / Chameleon policy), `AdapterCache` (eviction,
watermarks, prefetch), `KVCache` and `UnifiedPool` — the pool on the meta device, so page
accounting is real and no memory is allocated. Only the forward pass and the copies are
replaced: a step takes `profile.step_time`, a load takes setup + bytes / link bandwidth,
the link shared by the loads in flight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.benchmarks.sim.profiles import StepLoad
from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest
from loraplex.replica.memory.adapter_cache import AdapterCache, CacheConfig
from loraplex.replica.memory.kv_cache import KVCache
from loraplex.replica.memory.pool import UnifiedPool
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.scheduling.chameleon import Chameleon
from loraplex.replica.scheduling.fairness import tenant_policies
from loraplex.replica.scheduling.scheduler import Scheduler, SchedulerConfig
from loraplex.replica.sequence import Sequence
from loraplex.replica.step_costs import StepCostEstimator, step_rows


class SimClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True, eq=False)
class SimResident:
    name: str
    rank: int
    pages: list[int]
    pins: int = 0


@dataclass(frozen=True, slots=True)
class AdapterMeta:
    """An adapter as the simulated host tier holds it: its size, no weights."""

    name: str
    rank: int
    nbytes: int
    version: str | None = None


class SimLayout:
    """Adapters take ceil(bytes / page) pages (the real layout wastes < 2% at 2 MiB)."""

    def __init__(self, page_bytes: int):
        self.page_bytes = page_bytes

    def num_pages(self, weights: AdapterMeta) -> int:
        return math.ceil(weights.nbytes / self.page_bytes)

    def skeleton(self, weights: AdapterMeta) -> AdapterMeta:
        return weights

    def place(self, weights: AdapterMeta, pages: list[int]) -> SimResident:
        return SimResident(weights.name, weights.rank, pages)

    def fill(self, resident: SimResident, weights: AdapterMeta) -> None:
        pass


class SimLink:
    """Host -> device link: processor sharing among the loads in flight; each load is
    `setup_s` of link time plus its bytes. `done()` reports the loads finished by now."""

    def __init__(self, bytes_per_s: float, setup_s: float, clock: SimClock):
        self.rate = bytes_per_s
        self.setup_bytes = setup_s * bytes_per_s
        self.clock = clock
        self.active: list[list] = []  # [token, bytes left]
        self.finished: list[object] = []
        self.last = 0.0
        self.busy_s = 0.0

    def submit(
        self, token: object, nbytes: int, job: Callable[[], None], join: bool = True
    ) -> None:
        self._advance(self.clock())
        job()
        self.active.append([token, nbytes + self.setup_bytes])

    def _advance(self, now: float) -> None:
        while self.active and self.last < now:
            share = self.rate / len(self.active)
            first = min(b for _, b in self.active)
            dt = min(first / share, now - self.last)
            for item in self.active:
                item[1] -= share * dt
            self.busy_s += dt
            self.last += dt
            done = [t for t, b in self.active if b <= 1e-6]
            self.finished += done
            self.active = [item for item in self.active if item[1] > 1e-6]
        self.last = max(self.last, now)

    def next_done(self) -> float | None:
        if not self.active:
            return None
        return self.last + min(b for _, b in self.active) * len(self.active) / self.rate

    def wait(self, timeout_s: float) -> None:
        return None  # simulated time: the replica's event loop advances it

    def done(self) -> list[object]:
        self._advance(self.clock())
        finished, self.finished = self.finished, []
        return finished


@dataclass(frozen=True, slots=True)
class System:
    """What one simulated replica runs: loraplex's engine (`scheduler` and `cache` drive
    the real Scheduler and AdapterCache), or S-LoRA's (`slora`: benchmarks/peers/slora.py)."""

    name: str
    scheduler: SchedulerConfig
    cache: CacheConfig
    slora: object | None = None  # an SLoRAConfig: S-LoRA's engine instead of loraplex's


@dataclass(frozen=True, slots=True)
class ReplicaCounters:
    """What a simulated replica reports beside its finished requests."""

    cache: dict
    preemptions: int
    steps: int
    link_busy_s: float
    peak_memory_fraction: float
    bypasses: int
    squashes: int = 0


@dataclass(slots=True)
class Record:
    request: SimRequest
    first_token: float = math.nan
    finish: float = math.nan
    admitted: float = math.nan


class SimReplica:
    """`link(clock)` makes the transfer adapter loads go through (default: a `SimLink` of
    the profile's bandwidth); it must also answer `next_done()` and `busy_s`."""

    def __init__(
        self,
        profile,
        system: System,
        adapters: list[AdapterSpec],
        max_len: int,
        link: Callable[[SimClock], SimLink] | None = None,
    ):
        self.profile = profile
        self.clock = SimClock()
        cfg = ModelConfig.from_dict(profile.model)
        elem = 2 if cfg.dtype in (torch.float16, torch.bfloat16) else 4
        pool = UnifiedPool(
            profile.pool_bytes // profile.page_bytes,
            profile.page_bytes // elem,
            cfg.dtype,
            torch.device("meta"),
        )
        self.pool = pool
        self.kv = KVCache(pool, cfg)
        if link is None:
            self.link = SimLink(profile.link_bytes_per_s, profile.load_setup_s, self.clock)
        else:
            self.link = link(self.clock)
        self.cache = AdapterCache(
            pool,
            cfg,
            clock=self.clock,
            config=system.cache,
            layout=SimLayout(pool.page_bytes),
            transfer=self.link,
        )
        self.rank = {a.name: a.rank for a in adapters}
        for a in adapters:
            self.cache.add(AdapterMeta(a.name, a.rank, a.nbytes))
        self.scheduler = Scheduler(system.scheduler, self.kv, self.cache, max_len, self.clock)
        self.records: dict[Sequence, Record] = {}
        self.done: list[Record] = []
        self.steps = 0
        self.busy_s = 0.0
        self.batch_sizes: list[int] = []
        self.peak_pages_in_use = 0  # KV blocks + pinned adapters: what the batch needs
        self.step_costs = StepCostEstimator()  # what the replica measures, as the engine does

    @property
    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.policy)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def holds(self, adapter: str) -> bool:
        return self.cache.is_resident(adapter)

    def counters(self) -> ReplicaCounters:
        # under fair admission across tenants, one policy per tenant
        chameleons = [p for p in tenant_policies(self.scheduler.policy) if isinstance(p, Chameleon)]
        return ReplicaCounters(
            cache={f: getattr(self.cache.stats, f) for f in self.cache.stats.__slots__},
            preemptions=self.scheduler.num_preemptions,
            steps=self.steps,
            link_busy_s=self.link.busy_s,
            peak_memory_fraction=self.peak_pages_in_use / self.pool.num_pages,
            bypasses=sum(p.num_bypasses for p in chameleons),
            squashes=sum(p.num_squashes for p in chameleons),
        )

    def add(self, req: SimRequest) -> None:
        params = SamplingParams(max_tokens=req.max_tokens)
        seq = Sequence(str(req.rid), [0] * req.prompt, params, req.adapter, req.arrival, None)
        self.records[seq] = Record(req)
        self.scheduler.add(seq)

    def advance_until(self, t: float) -> None:
        """Run steps while the replica's clock is before t (the last may end after t)."""
        while self.clock.now < t:
            if not self.step(until=t):
                return

    def step(self, until: float = math.inf) -> bool:
        """One engine step; when nothing can run, jump to the next load completion (or
        to `until`). False when idle with nothing pending."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            nxt = self.link.next_done()
            if nxt is None:  # idle until the next arrival
                if self.scheduler.has_work() and until == math.inf:
                    raise RuntimeError("the simulated replica is stuck: work but no progress")
                if until != math.inf:
                    self.clock.now = max(self.clock.now, until)
                return False
            self.clock.now = max(self.clock.now + 1e-9, min(nxt, until))
            return True
        adapters = {s.adapter for s, _ in scheduled if s.adapter is not None}
        load = StepLoad(
            tokens=sum(n for _, n in scheduled),
            context=sum(s.num_computed + n for s, n in scheduled),
            token_rank=sum(n * self.rank[s.adapter] for s, n in scheduled if s.adapter),
            adapter_bytes=sum(self.cache.nbytes_of(a) for a in adapters),
            adapters=len(adapters),
            rows=len(scheduled),
        )
        dt = self.profile.step_time(load)
        self.step_costs.record_step(*step_rows(scheduled), len(adapters), dt)
        self.clock.now += dt
        self.busy_s += dt
        self.steps += 1
        self.batch_sizes.append(len(scheduled))
        in_use = sum(len(s.block_table) for s in self.scheduler.running) + sum(
            len(r.pages) for r in self.cache.resident.values() if r.pins > 0
        )
        self.peak_pages_in_use = max(self.peak_pages_in_use, in_use)
        now = self.clock.now
        for seq, n in scheduled:
            record = self.records[seq]
            if math.isnan(record.admitted):
                record.admitted = now - dt
            seq.num_computed += n
            if seq.num_computed < seq.num_tokens:
                continue  # a prefill chunk: no token yet
            seq.output_ids.append(0)
            if len(seq.output_ids) == 1:
                record.first_token = now
            if len(seq.output_ids) >= record.request.output:
                record.finish = now
                self.scheduler.finish(seq, "length")
                self.step_costs.record_finished(len(seq.output_ids))
                self.done.append(self.records.pop(seq))
        return True
