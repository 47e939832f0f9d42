"""Adapter-affinity replica selection: a pure policy over the replicas' routing stats.

The Ray Serve `RequestRouter`, the simulator and the tests drive this one object: `choose`
ranks replicas for a request and `observe` feeds the per-adapter request-rate estimate. It
imports nothing of Ray and reads time only through the injected clock.

The routing-stats contract, what each replica publishes, is in router/routing_stats.py.

Adapters are named by version (`tenant/name@version`, replica/protocol.py): residency,
rates, placements and homes are per version, while an adapter's consistent-hash walk is
per name (router/walk.py), so a name's new version goes where its old one was.

Measured costs (`use_measured_costs`) are pooled: every replica is judged by the mean of
what the replicas publish, the configured cost while none has. Replicas of one deployment
run on the same hardware, so their differences are noise, and per-replica noise would
decide ties that belong to the adapter's walk (and make a new replica, not yet measured,
look dearer or cheaper than the rest).
"""

from __future__ import annotations

import collections
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from loraplex.router.prefix_affinity import PrefixIndex
from loraplex.router.rates import HeldHeat, RateEstimator
from loraplex.router.routing_stats import ReplicaStats
from loraplex.router.walk import cached_walk
from loraplex.settings import FORBID_EXTRA


class Affinity(IntEnum):
    """How well a replica suits an adapter; lower is better."""

    DEVICE = 0  # resident in the device pool
    LOADING = 1  # being loaded, or just sent a request of it (its stats do not show it yet)
    EXTRA_HOME = 2  # a home of a hot adapter that does not hold it yet
    SPARE = 3  # holds it but is no longer one of its homes (it is being withdrawn)
    COLD = 4  # not on the device, within the bounded load and the bounded adapter count
    CROWDED = 5  # not on the device, within the bounded load, holding more than its share
    # of adapters or of their request rate
    OVER_BOUND = 6  # not on the device, above the bounded load


@pydantic_dataclass(frozen=True, slots=True, config=FORBID_EXTRA)
class AffinityConfig:
    """The policy's settings (each declared here once; the YAML config's `router:` section
    is router/settings.py's RouterSettings, which extends this)."""

    load_cost_s: float = Field(
        0.5, ge=0, le=600, description="What a cold adapter load adds to TTFT, seconds."
    )
    host_load_cost_s: float = Field(
        0.02,
        ge=0,
        le=600,
        description="Host tier -> device load time, seconds (at most load_cost_s); also "
        "charged while a load is in flight.",
    )
    request_time_s: float = Field(
        2.0,
        gt=0,
        le=3600,
        description="Mean time a request holds a batch slot, seconds, until the replicas "
        "have measured it: a saturated replica's slots over the requests it finishes a second.",
    )
    busy_cost_s: float = Field(
        0.0,
        ge=0,
        le=600,
        description="TTFT each request already on a replica adds, seconds: ~0 on GPUs "
        "(decode batching is nearly free), the per-sequence step time on CPUs.",
    )
    bounded_load_c: float = Field(
        1.25,
        gt=1,
        le=100,
        description="A cold home takes a request only below ceil(c * mean load).",
    )
    bounded_adapters_c: float = Field(
        1.1,
        gt=1,
        le=100,
        description="A cold home takes a new adapter only below ceil(c * mean adapters held).",
    )
    home_utilisation: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of a replica's batch slots one adapter should fill: an adapter "
        "gets as many homes as its request rate needs at this share (Little's law with "
        "the time a request holds a slot).",
    )
    home_hysteresis: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="A home of a hot adapter is withdrawn only once its rate needs (1 - "
        "this) of one home less, so a rate near a threshold does not flap.",
    )
    max_homes_per_adapter: int = Field(
        4, ge=1, le=4096, description="Most replicas one adapter is spread over."
    )
    rate_window_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Time constant of the adapter request-rate estimate's exponential decay.",
    )
    stale_after_s: float = Field(
        30.0, gt=0, le=3600, description="Routing stats older than this rank their replica last."
    )
    use_measured_costs: bool = Field(
        True,
        description="Judge each replica by the busy and host-load costs the replicas measure "
        "on their own steps and loads (the configured ones stand in until they have).",
    )
    prefill_token_cost_s: float = Field(
        1e-4,
        ge=0,
        le=1,
        description="Prefill time per prompt token, seconds: what each token found in a "
        "replica's prefix cache saves, and what each token its engine has yet to prefill adds "
        "to a new request's wait (replicas' measurements replace it as for busy_cost_s).",
    )
    prefix_blocks: int = Field(
        128,
        ge=0,
        le=4096,
        description="Leading KV blocks of a prompt the router matches against the prefixes "
        "it sent to each replica; 0 turns prefix affinity off.",
    )
    prefix_index_keys: int = Field(
        65536,
        ge=1,
        le=1 << 24,
        description="Block keys the router remembers for prefix affinity (least recently "
        "used go first).",
    )
    prefix_ttl_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="A prefix not routed for this long is forgotten (the replica has likely "
        "evicted it).",
    )
    cold_walk_reads: float = Field(
        0.0,
        ge=0,
        le=100,
        description="A cold adapter goes to the first replica on its walk, within the load "
        "bound, whose TTFT is within this many store reads of the least such replica's; 0: "
        "to the least TTFT (measured in the fleet simulator over 5 seeds: 1 helped shift on "
        "3, hurt zipf on 3 and hot on all 5, by 1-4%).",
    )
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seeds tie-breaks between replicas.")

    @model_validator(mode="after")
    def _host_below_cold(self) -> AffinityConfig:
        if self.host_load_cost_s > self.load_cost_s:
            raise ValueError(
                f"host_load_cost_s ({self.host_load_cost_s:g}) must not exceed load_cost_s "
                f"({self.load_cost_s:g}): a host-tier load is a part of a cold load"
            )
        return self


@dataclass(frozen=True, slots=True)
class AdapterHomes:
    """One adapter as `AffinityPolicy.snapshot` reports it."""

    adapter: str
    rate_per_s: float
    homes: tuple[str, ...]  # replicas it is routed to: its homes, or where it is warm


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    """Why a replica ranked where it did for a request, as `choose` judged it: its
    `affinity`, and the `tier` it held the adapter in as its stats (and this router's sends
    since) showed: "device", "loading", "host" or "store" (held nowhere: sent there, the
    request waits for a read from the artifact store)."""

    affinity: Affinity
    tier: str


def _tier(r: ReplicaStats, adapter: str, warm: dict[str, Affinity]) -> str:
    """Placement.tier of `adapter` on r (`warm`: the replicas `_choose` found it warm on)."""
    if adapter in r.device_adapters:
        return "device"
    if r.replica_id in warm:
        return "loading"
    return "host" if adapter in r.host_adapters else "store"


def batch_slots(r: ReplicaStats, adapter: str | None = None) -> int:
    """The requests r runs at once: its batch slots, or the rows its engine ran when its
    stats found it unable to take more in the next step: its last step held requests back
    for want of pages (long contexts fill the pool before the slots), or more prompt tokens
    wait to be prefilled than one step takes (`step_token_budget`: a backlog of prompts
    enters a step's budget at a time, so a new request waits behind all of it), or, for a
    request of `adapter`, its batch already runs `max_loras_per_batch` other adapters (the
    request waits until one of theirs leaves the batch, however many slots are free).
    Requests that wait for the next step, or within one step's budget, do not count: a row
    frees for them within a step or two."""
    backlog = 0 < r.step_token_budget < r.queued_prefill_tokens
    capped = (
        adapter is not None
        and 0 < r.max_loras_per_batch <= len(r.batch_adapters)
        and adapter not in r.batch_adapters
    )
    if r.running is None or (r.waiting_for_pages == 0 and not backlog and not capped):
        return r.max_concurrency
    return max(1, min(r.running, r.max_concurrency))


class _Drain:
    """How fast one replica finishes requests while saturated, from its published stats:
    the requests finished between two stats that both found it holding at least its batch
    slots, over the time between them, averaged (each new pair weighs `WEIGHT`)."""

    WEIGHT = 0.5

    def __init__(self) -> None:
        self.recorded_at: float | None = None
        self.finished = 0
        self.saturated = False
        self.rate_per_s: float | None = None

    def saw(self, recorded_at: float, finished: int, saturated: bool) -> None:
        if self.recorded_at is not None and recorded_at <= self.recorded_at + 1e-3:
            return  # the same stats, seen again
        if self.recorded_at is not None and saturated and self.saturated:
            done = finished - self.finished
            if done == 0:
                return  # none finished yet: the next stats measure over both periods
            if done > 0:  # < 0: a replacement replica under the same id
                rate = done / (recorded_at - self.recorded_at)
                self.rate_per_s = (
                    rate
                    if self.rate_per_s is None
                    else self.rate_per_s + self.WEIGHT * (rate - self.rate_per_s)
                )
        self.recorded_at, self.finished, self.saturated = recorded_at, finished, saturated


class AffinityPolicy:
    """Ranks replicas for a request from their `ReplicaStats`.

    Adapter request, adapter `a`, n replicas. For every replica r:

        wait(r)  = max(0, queue_len - slots(r) + 1) / drain
                   + queue_len * busy_cost_s
                   + prefills(r)
                   (seconds until a batch slot frees: 0 while one is free, since continuous
                   batching admits at the next step; else the requests ahead of it over the
                   rate r finishes them.
                   drain = the requests a replica finished per second between two of its
                   stats that both found it saturated (queue_len >= max_concurrency as
                   published; finished = requests_total - queue_len), averaged over such
                   pairs, and pooled over the replicas as the measured costs are (per
                   replica, 1 s samples of ~10 completions each made noise decide: in the
                   quick fleet with it on, affinity's zipf goodput went 76.2 -> 73.6 req/s);
                   max_concurrency / request_time_s until one has measured it, or without
                   use_measured_costs. request_time_s alone, measured on an
                   idle engine, priced the bench's saturated homes at 34 ms for 16 queued
                   where they drained 20-40 a second (0.4-0.8 s): a home kept its adapters
                   however long its queue, until Serve's max_ongoing_requests turned
                   requests away at random. busy_cost_s is what each request already there adds
                   to the steps a new one waits through: about 0 on a GPU, whose decode
                   step time hardly grows with the batch, but a compute-bound CPU step
                   grows with every sequence in it. The prompt tokens r's engine has yet
                   to prefill come first: a replica that just took a burst of long prompts
                   has a free slot and a short queue, and its prefills still take seconds)
        slots(r) = max_concurrency, or the rows r's engine ran while its last step held
                   requests back because the pool had no pages for them (`running` while
                   `waiting_for_pages` > 0, as published): a batch whose KV pages fill
                   first is full below its slots, and a request sent there waits for a row
                   to finish; or while more prompt tokens wait to be prefilled there than
                   one step takes (`queued_prefill_tokens` > `step_token_budget`): a new
                   request then waits behind a backlog that enters a step at a time (on the
                   autoscaled quick day's ramp, 0 of 7,832 held requests were held for
                   pages, 292 for adapter loads, the rest by the token budget); or, for
                   a request whose adapter r's running batch lacks, while that batch runs
                   max_loras_per_batch adapters already (`batch_adapters`,
                   `max_loras_per_batch`): it waits for one of theirs to leave the batch,
                   whatever the free rows (seed 27 of that day, 880-960 s: two replicas ran
                   32 adapters, the cap, in 39-40 of 64 rows, ~5 requests waiting, nearly
                   all of other adapters; they waited 0.41-0.65 s median for a first token
                   where this estimate, counting the free rows, gave 22 ms). Those
                   waiting for the next step, or within one step's budget, do not count
                   (counting every waiting request, a warm replica between two steps with
                   half its pages free read as full: zipf's store reads at the reference
                   rate rose 43 -> 60 over five seeds, goodput unchanged)
        prefills(r) = the prefill time ahead of a new request: queued_prefill_tokens (what
                   r's engine had yet to prefill when it recorded its stats) and the prompt
                   tokens of each request this router sent r since (`observe(...,
                   prompt_tokens=)`), at prefill_token_cost_s a token, drained at that rate
                   from the stats' time and each send's until now. queue_len is the
                   caller's own count (Serve's queue-length cache), but queued_prefill_tokens
                   is a stats period old: without the sends every request of a period would
                   see the same backlogs and go to the replica that published the least, and
                   without the drain a backlog long prefilled would still send requests away
                   from their adapter
        reads(r) = store reads queued on r: adapters it is loading that it holds neither
                   on the device nor in the host tier, and those this router sent it since
                   its stats that it held nowhere (a replica reads one adapter after
                   another, replica/memory/store_reads.py, so a read waits for those ahead)
        read     = load_cost_s - host_load_cost_s of the config   (one store read)
        load(r)  = 0 on device | reads(r) * read for a new home (its own read is waived,
                   not the queue before it) | host_load_cost_s in the host tier or holding
                   it beyond its homes | host_load_cost_s + reads(r) * read / 2 loading
                   (its read is somewhere in that queue) | host_load_cost_s + (reads(r) +
                   1) * read otherwise (read from the artifact store)
        saved(r) = matched(r) * prefix_block_size * prefill_token_cost_s
                   (matched(r): how many leading KV blocks of the prompt this router sent
                   to r within prefix_ttl_s, router/prefix_affinity.py; r skips their
                   prefill if its prefix cache still holds them)
        ttft(r)  = wait(r) + load(r) - saved(r)
                   (busy_cost_s, host_load_cost_s and prefill_token_cost_s are the mean of
                   the replicas' measurements once they publish them, the configured
                   values until then; a load from the artifact store adds load_cost_s -
                   host_load_cost_s of the config)
        capacity = ceil(c * (sum of queue_len + 1) / n)        (bounded loads, Mirrokni
                   et al.: a cold replica is within the bound iff queue_len < capacity,
                   i.e. it holds <= capacity after taking this request; the least
                   loaded replica always is. A replica with a free batch slot (below
                   slots(r)) is always within it: continuous batching admits the request at the
                   next step, so taking it delays no one, and leaving the adapter's
                   home then would only load the adapter twice)
        held(r)  = adapters on r's device or loading there, with those this router sent
                   r a request of since r's stats were recorded
        share    = ceil(c_adapters * (sum of held + 1) / n)    (the same bound over
                   adapters: a cold adapter skips a home holding >= share adapters,
                   so the hash's imbalance never makes one pool evict while another
                   has room)
        heat(r)  = sum of rate(b) over b in held(r): the request rate its adapters draw
        crowded  = held(r) >= share, or heat(r) > c * (sum of heat) / n: a replica whose
                   adapters already draw more than their share of the traffic takes no
                   new one while another replica can

    Warm means on the device or loading there. A replica whose host tier holds the adapter
    is only cheaper to load on, not warm: a replica keeps in its host tier every adapter it
    has served, so under a router that spreads requests the host tiers fill with every
    adapter.

    Placements. `observe(a, replica_id)` records that a request of `a` went to the
    replica. Until the replica publishes stats newer than that, it counts as loading `a`:
    stats are a period old, and without this a burst of one cold adapter would each be
    judged against stats that do not show the first of them.

    Homes. An adapter needs need(a) = max(rate(a) * hold, in_flight(a)) / (home_utilisation
    * slots) homes (its requests in flight, by Little's law or as the replicas count them in
    `adapter_queue`, over the share of a home's batch slots, slots being the mean
    max_concurrency, one adapter should fill; hold = how long a request holds a slot,
    max_concurrency / drain, request_time_s until a drain is measured: in the router
    bench's hot workload on two cores a saturated replica finished 25-35 requests a second
    in 16 slots, 0.46-0.65 s a slot, where request_time_s, measured on an idle engine, said
    0.048 s; the rate then asked for a tenth of the homes the adapter needed, and only the
    requests queued on its homes gave more, until they drained and took them away again:
    at 0.85-1.15 x the bench's basis the hot adapter's homes changed 3 times a run, held
    fewer than 3 for 12-22% of its requests, and with this none or once). Its count k(a)
    grows to ceil(need) as soon as need exceeds it, and drops by one only once need <= (k -
    1) * (1 - home_hysteresis), so a rate near a threshold does not flap; 1 <= k <= min(n,
    max_homes_per_adapter): a cold adapter keeps one home. While k >= 2 the adapter's homes
    are a list kept across requests: replicas holding it first, then uncrowded replicas
    within the bound along its walk; shrinking drops the newest. A new home's load cost is
    waived (it amortises over the adapter's rate), and among its homes a request goes to
    the least utilised of equal TTFT, so the traffic spreads. Replicas that still hold it
    but are no longer homes (SPARE) cost a host-tier load: they get its requests only while
    every home is busier by that much, and its copies there go cold. The list is kept
    while the adapter is counted, k = 1 included, until only its first home holds it.
    Adapters that never had two homes have none recorded: every replica holding them is
    one.

    Order: ascending (stale, ttft, affinity, utilisation among a hot adapter's homes,
    position on a's walk), stale meaning stats_age_s > stale_after_s. Among fresh replicas,
    a warm one is passed over only when another's wait plus its load cost is strictly lower
    (equal estimates go to affinity), and a cold adapter goes to the first replica on its
    walk within both bounds whose TTFT is within one store read of the least such
    replica's (`_level_cold`: it spills down its walk only past that imbalance).

    Base-model request: ascending (stale, wait - saved, queue_len / max_concurrency,
    -free_pages, a draw from the seeded RNG), so equally loaded replicas share base traffic
    and a shared prefix goes where it is cached while that is cheaper than waiting.

    Prefix and adapter affinity are one cost: a prefix hit saves its prefill time, an
    adapter hit saves a load, and whichever replica's total is lowest wins. The prompt's
    keys (`choose(..., prefix=keys)`, `observe(..., prefix=keys)`) are those of
    `protocol.extend_block_keys`, computed by the caller with the replicas' block size.

    Every replica is returned, best first; no replicas gives []. The caller tries them in
    order and applies its own back-pressure. Call `observe` once per routed request.
    `choose`, `observe` and `snapshot` may be called from different threads.
    """

    def __init__(
        self,
        config: AffinityConfig,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.clock = clock
        self._rng = random.Random(config.seed)
        self._rates = RateEstimator(config.rate_window_s, clock())
        self._heat = HeldHeat(self._rates)
        self._placed: dict[str, dict[str, float]] = {}  # replica -> {adapter: sent at}
        # replica -> (sent at, prompt tokens) of each request sent it, oldest first
        self._sent_tokens: dict[str, collections.deque[tuple[float, int]]] = {}
        self._homes: dict[str, list[str]] = {}  # hot (or formerly hot) adapter -> homes
        self._drains: dict[str, _Drain] = {}  # replica -> what its stats say it finishes
        self.prefixes = PrefixIndex(config.prefix_index_keys, config.prefix_ttl_s)
        # Adapter requests routed, by the Placement of the replica each went to (`observe`)
        self._routed: collections.Counter[Placement] = collections.Counter()
        self._lock = threading.Lock()

    def observe(
        self,
        adapter: str | None,
        replica_id: str | None = None,
        prefix: Sequence[bytes] = (),
        prompt_tokens: int = 0,
        placement: Placement | None = None,
    ) -> None:
        """Count one request of `adapter` now, sent to `replica_id` when given, its prompt
        `prompt_tokens` long and starting with the blocks `prefix`; base-model requests'
        rates are not tracked. `placement`: that replica's, from `choose`, counted in
        `placement_counts`."""
        with self._lock:
            now = self.clock()
            if placement is not None:
                self._routed[placement] += 1
            if replica_id is not None:
                if prefix:
                    self.prefixes.record(prefix[: self.config.prefix_blocks], replica_id, now)
                if prompt_tokens:
                    sends = self._sent_tokens.setdefault(replica_id, collections.deque())
                    while sends and now - sends[0][0] > self.config.stale_after_s:
                        sends.popleft()  # stats fresher than this have long arrived
                    sends.append((now, prompt_tokens))
            if adapter is None:
                return
            self._heat.counted(adapter, self._rates.add(adapter, now))
            if replica_id is not None:
                placed = self._placed.setdefault(replica_id, {})  # oldest placement first
                while placed and now - next(iter(placed.values())) > self.config.stale_after_s:
                    del placed[next(iter(placed))]  # stats fresher than this have long arrived
                placed.pop(adapter, None)
                placed[adapter] = now

    def placement_counts(self) -> dict[Placement, int]:
        """The adapter requests `observe` was told the `Placement` of, by placement."""
        with self._lock:
            return dict(self._routed)

    def rate(self, adapter: str) -> float:
        """Requests/s of `adapter`, decayed over rate_window_s."""
        return self._rates.rate(adapter, self.clock())

    def homes_needed(self, adapter: str, slots: float = 1.0) -> float:
        """need(adapter) by its rate, for replicas of `slots` batch slots each."""
        c = self.config
        with self._lock:
            hold_s = self._hold_s(self._drains.values(), slots)
        return self.rate(adapter) * hold_s / (c.home_utilisation * slots)

    def homes(self, adapter: str) -> tuple[str, ...]:
        """The adapter's recorded homes (empty: it never needed two)."""
        return tuple(self._homes.get(adapter, ()))

    def snapshot(self, top_n: int) -> tuple[list[AdapterHomes], AdapterHomes]:
        """The `top_n` adapters by rate with their homes (recorded ones, else the replicas
        holding it or sent it), and the rest summed as one entry ("other": total rate,
        and the replicas any of them is on)."""
        with self._lock:
            now = self.clock()
            weights = sorted(self._rates.weights.items(), key=lambda kv: kv[1], reverse=True)
            top = [
                AdapterHomes(
                    a, self._rates.to_count(w, now) / self.config.rate_window_s, self._where(a)
                )
                for a, w in weights[:top_n]
            ]
            rest = weights[top_n:]
            where = sorted({r for a, _ in rest for r in self._where(a)})
            total = sum(self._rates.to_count(w, now) for _, w in rest) / self.config.rate_window_s
        return top, AdapterHomes("other", total, tuple(where))

    def _where(self, adapter: str) -> tuple[str, ...]:
        if adapter in self._homes:
            return tuple(self._homes[adapter])
        sent = {r for r, placed in self._placed.items() if adapter in placed}
        return tuple(sorted(self._heat.holders.get(adapter, set()) | sent))

    def choose(
        self,
        adapter: str | None,
        replicas: Sequence[ReplicaStats],
        prefix: Sequence[bytes] = (),
        estimates: dict[str, float] | None = None,
        placements: dict[str, Placement] | None = None,
    ) -> list[str]:
        """The replicas, best first. `estimates`, when given, receives each replica's
        estimated TTFT for this request (an adapter's: ttft(r); the base model's: its wait
        less the prefill it saves), so a caller can set it beside what the request got;
        `placements` each replica's `Placement` (an adapter's request only), which the
        caller hands back to `observe` for the replica the request went to."""
        ids = tuple(r.replica_id for r in replicas)
        assert len(set(ids)) == len(ids), f"duplicate replica ids in {ids}"
        if not replicas:
            return []
        with self._lock:
            busy = self._pooled([r.busy_cost_s for r in replicas], self.config.busy_cost_s)
            per_token = self._pooled(
                [r.prefill_token_cost_s for r in replicas], self.config.prefill_token_cost_s
            )
            now = self.clock()
            drain = self._drain_rates(replicas, now)
            wait = {
                r.replica_id: self._wait_s(r, adapter, now, busy, per_token, drain[r.replica_id])
                for r in replicas
            }
            saved = self._prefill_saved(replicas, prefix, per_token)
            if adapter is None:
                if estimates is not None:
                    estimates.update({rid: w - saved.get(rid, 0.0) for rid, w in wait.items()})
                return [
                    r.replica_id
                    for r in sorted(replicas, key=lambda r: self._base_key(r, wait, saved))
                ]
            return self._choose(adapter, replicas, ids, wait, saved, estimates, placements)

    def _choose(
        self,
        adapter: str,
        replicas: Sequence[ReplicaStats],
        ids: tuple[str, ...],
        wait: dict[str, float],
        saved: dict[str, float],
        estimates: dict[str, float] | None,
        placements: dict[str, Placement] | None,
    ) -> list[str]:
        c = self.config
        n = len(replicas)
        now = self.clock()
        walk = cached_walk(adapter, ids)
        position = {replica_id: i for i, replica_id in enumerate(walk)}
        by_id = {r.replica_id: r for r in replicas}
        capacity = math.ceil(c.bounded_load_c * (sum(r.queue_len for r in replicas) + 1) / n - 1e-9)
        held, heat = {}, {}
        for r in replicas:
            held[r.replica_id], heat[r.replica_id] = self._held(r, now)
        if len(self._heat.held) > n:
            self._heat.forget(set(ids))  # replicas gone from the deployment
        share = math.ceil(c.bounded_adapters_c * (sum(held.values()) + 1) / n - 1e-9)
        hot_share = c.bounded_load_c * sum(heat.values()) / n
        host = self._pooled([r.host_load_cost_s for r in replicas], c.host_load_cost_s)

        warm: dict[str, Affinity] = {}
        for r in replicas:
            if adapter in r.device_adapters:
                warm[r.replica_id] = Affinity.DEVICE
            elif adapter in r.loading_adapters or self._placed_since(r, adapter, now):
                warm[r.replica_id] = Affinity.LOADING

        def in_bound(replica_id: str) -> bool:
            r = by_id[replica_id]
            return r.queue_len < max(capacity, batch_slots(r, adapter))

        def crowded(replica_id: str) -> bool:
            return held[replica_id] >= share or heat[replica_id] > hot_share

        slots = sum(r.max_concurrency for r in replicas) / n
        in_flight = sum(r.adapter_queue.get(adapter, 0) for r in replicas)
        hold_s = self._hold_s((self._drains[r.replica_id] for r in replicas), slots)
        homes = self._update_homes(
            adapter, now, hold_s, slots, in_flight, walk, position, warm, in_bound, crowded
        )
        spread = homes is not None and len(homes) > 1

        def affinity(r: ReplicaStats) -> Affinity:
            rid = r.replica_id
            if homes is not None and rid not in homes:
                if rid in warm:
                    return Affinity.SPARE
            elif rid in warm:
                return warm[rid]
            elif homes is not None:
                return Affinity.EXTRA_HOME
            if not in_bound(rid):
                return Affinity.OVER_BOUND
            return Affinity.CROWDED if crowded(rid) else Affinity.COLD

        read = c.load_cost_s - c.host_load_cost_s

        def load_s(r: ReplicaStats, a: Affinity) -> float:
            if a is Affinity.DEVICE:
                return 0.0
            ahead = self._reads_ahead(r, now) * read if read else 0.0
            if a is Affinity.EXTRA_HOME:
                return ahead
            if a is Affinity.SPARE or adapter in r.host_adapters:
                return host
            if a is Affinity.LOADING:
                return host + ahead / 2
            return host + ahead + read

        affinities = {r.replica_id: affinity(r) for r in replicas}
        ttft = {
            r.replica_id: wait[r.replica_id]
            + load_s(r, affinities[r.replica_id])
            - saved.get(r.replica_id, 0.0)
            for r in replicas
        }
        if estimates is not None:
            estimates.update(ttft)
        if placements is not None:
            placements.update(
                (r.replica_id, Placement(affinities[r.replica_id], _tier(r, adapter, warm)))
                for r in replicas
            )
        self._level_cold(adapter, replicas, affinities, ttft, read, capacity)

        def key(r: ReplicaStats) -> tuple:
            a = affinities[r.replica_id]
            home = spread and homes is not None and r.replica_id in homes
            return (
                self._stale(r),
                ttft[r.replica_id],
                Affinity.DEVICE if home else a,
                r.queue_len / r.max_concurrency if home else 0.0,
                position[r.replica_id],
            )

        return [r.replica_id for r in sorted(replicas, key=key)]

    def _level_cold(
        self,
        adapter: str,
        replicas: Sequence[ReplicaStats],
        affinities: dict[str, Affinity],
        ttft: dict[str, float],
        read: float,
        capacity: int,
    ) -> None:
        """Stage 2 of the decision (with cold_walk_reads > 0): among the fresh replicas
        below the load bound that would read the adapter from the store (COLD, CROWDED, no
        host copy), those whose TTFT is within cold_walk_reads store reads (the replicas'
        measured read time, pooled, or the configured one) of the least are levelled to the
        least, so the walk decides between them: a cold adapter goes to its walk home, and
        spills down the walk only once the home's wait exceeds the least loaded replica's
        by more than that. In queue terms the threshold is the reads over the wait one more
        request adds (busy_cost_s, or a batch slot's share of request_time_s once the batch
        is full). Without it any busy_cost_s > 0 sends a cold adapter to the shortest queue.

        Before replicas published their queued prefill tokens it hurt shift (p99 0.371 ->
        0.662 s in the fleet simulator): adapters that turn hot share a walk home, and the
        wait model priced that home at 54 of 64 slots at 27 ms where its prefills queued
        for ~0.8 s. With them priced (`_wait_s`) it is still off: at the quick fleet shape
        (8 x H100/7B, 1,500 adapters) affinity's goodput over seeds 0-2 (req/s) went shift
        60.4 / 71.0 / 66.6 -> 63.6 / 75.4 / 75.3, zipf 75.8 / 79.7 / 78.3 -> 79.3 / 77.1 /
        75.6, hot 84.1 / 80.5 / 82.0 -> 83.5 / 80.6 / 82.2, and on the bench's own two
        seeds (with the pricing) shift 61.8 / 69.6 -> 60.8 / 65.2, hot 85.5 / 82.3 -> 83.5
        / 81.6: not better over the seeds."""
        if self.config.cold_walk_reads == 0:
            return
        by_id = {r.replica_id: r for r in replicas}
        reading = [
            rid
            for rid, a in affinities.items()
            if a in (Affinity.COLD, Affinity.CROWDED)
            and not self._stale(by_id[rid])
            and adapter not in by_id[rid].host_adapters
            and by_id[rid].queue_len < capacity
        ]
        if len(reading) < 2:
            return
        threshold = self.config.cold_walk_reads * self._pooled(
            [r.store_read_s for r in replicas], read
        )
        least = min(ttft[rid] for rid in reading)
        for rid in reading:
            if ttft[rid] <= least + threshold:
                ttft[rid] = least

    def _update_homes(
        self,
        adapter: str,
        now: float,
        hold_s: float,
        slots: float,
        in_flight: int,
        walk: tuple[str, ...],
        position: dict[str, int],
        warm: dict[str, Affinity],
        in_bound: Callable[[str], bool],
        crowded: Callable[[str], bool],
    ) -> frozenset[str] | None:
        """The adapter's homes after this request (None: it has never needed two).
        `hold_s`: how long a request holds a batch slot (`_hold_s`); `in_flight`: its requests
        the replicas hold, as they published them."""
        c = self.config
        recorded = self._homes.get(adapter)
        # Little's law on the estimated rate, or the requests in flight counted: a queue
        # on its holders says it needs more homes before the rate estimate has caught up
        load = max(self._rates.rate(adapter, now) * hold_s, in_flight)
        need = load / (c.home_utilisation * slots)
        k = len(recorded) if recorded else 1
        if need > k:
            k = math.ceil(need)
        while k > 1 and need <= (k - 1) * (1 - c.home_hysteresis):
            k -= 1
        k = min(k, len(walk), c.max_homes_per_adapter)
        if recorded is None and k == 1:
            return None
        homes = [rid for rid in recorded or () if rid in position]
        candidates = (
            sorted(warm, key=lambda rid: (warm[rid], position[rid]))
            + [rid for rid in walk if in_bound(rid) and not crowded(rid)]
            + [rid for rid in walk if in_bound(rid)]
            + list(walk)
        )
        for rid in candidates:
            if len(homes) >= k:
                break
            if rid not in homes:
                homes.append(rid)
        del homes[k:]  # the newest homes are withdrawn first
        if k == 1 and set(warm) <= set(homes):
            self._homes.pop(adapter, None)  # only its home holds it: nothing to withdraw
            return None
        self._homes[adapter] = homes
        return frozenset(homes)

    def _prefill_saved(
        self, replicas: Sequence[ReplicaStats], prefix: Sequence[bytes], per_token: float
    ) -> dict[str, float]:
        """saved(r) for the replicas that match some of `prefix`."""
        prefix = prefix[: self.config.prefix_blocks]
        if not prefix:
            return {}
        alive = {r.replica_id for r in replicas}
        if self.prefixes.replicas - alive:  # replicas gone from the deployment
            self.prefixes.forget(alive)
        matched = self.prefixes.matched(prefix, (r.replica_id for r in replicas), self.clock())
        if not matched:
            return {}
        blocks = {r.replica_id: r.prefix_block_size for r in replicas}
        return {rid: n * blocks[rid] * per_token for rid, n in matched.items()}

    def _held(self, r: ReplicaStats, now: float) -> tuple[int, float]:
        """How many adapters r holds (device, loading, sent since its stats) and their
        weight (the rate they draw, in the estimator's units)."""
        self._heat.update(r.replica_id, r.device_adapters, r.loading_adapters)
        base = self._heat.held[r.replica_id]
        since = [a for a in self._sent_since(r, now) if a not in base]
        weight = self._heat.heat[r.replica_id] + sum(self._rates.weight(a) for a in since)
        return len(base) + len(since), weight

    def _reads_ahead(self, r: ReplicaStats, now: float) -> int:
        """reads(r): the store reads queued on r as far as this router can tell."""
        held = r.device_adapters | r.host_adapters
        known = held | r.loading_adapters
        sent = sum(1 for a in self._sent_since(r, now) if a not in known)
        return len(r.loading_adapters - held) + sent

    def _sent_since(self, r: ReplicaStats, now: float) -> Iterator[str]:
        """Adapters this router sent r since r recorded its stats, newest first."""
        recorded_at = now - r.stats_age_s
        placed = self._placed.get(r.replica_id, {})
        for a in reversed(placed):  # newest first: only those since the stats are read
            if placed[a] <= recorded_at:
                return
            yield a

    def _placed_since(self, r: ReplicaStats, adapter: str, now: float) -> bool:
        at = self._placed.get(r.replica_id, {}).get(adapter)
        return at is not None and at > now - r.stats_age_s

    def _wait_s(
        self,
        r: ReplicaStats,
        adapter: str | None,
        now: float,
        busy_cost_s: float,
        prefill_token_cost_s: float,
        drain_per_s: float,
    ) -> float:
        queued_behind = max(0, r.queue_len - batch_slots(r, adapter) + 1)
        slot = queued_behind / drain_per_s
        prefills = self._prefill_backlog_s(r, now, prefill_token_cost_s)
        return slot + r.queue_len * busy_cost_s + prefills

    def _drain_rates(self, replicas: Sequence[ReplicaStats], now: float) -> dict[str, float]:
        """drain for every replica, after taking in any stats newer than the last seen."""
        measured = []
        for r in replicas:
            d = self._drains.setdefault(r.replica_id, _Drain())
            d.saw(now - r.stats_age_s, r.requests_finished, r.held >= r.max_concurrency)
            measured.append(d.rate_per_s)
        if len(self._drains) > 2 * len(replicas):
            alive = {r.replica_id for r in replicas}
            self._drains = {k: v for k, v in self._drains.items() if k in alive}
        pooled = self._pooled(measured, math.nan)  # nan too without use_measured_costs
        return {
            r.replica_id: r.max_concurrency / self.config.request_time_s
            if math.isnan(pooled)
            else pooled
            for r in replicas
        }

    def _prefill_backlog_s(self, r: ReplicaStats, now: float, per_token: float) -> float:
        """prefills(r): the published backlog, and each prompt this router sent r after r
        recorded its stats, drained at one token per `per_token` from then until now.
        A send is matched to the stats by time (the stats' age against this clock). Serve
        reports a request routed once the replica has accepted it, so stats recorded after
        that include it; stats recorded between its arrival and that report count it
        twice, until the next stats (a period at most). Against the published backlog
        alone, over 8 seeds of the quick fleet: affinity goodput median zipf 77.3 vs 76.7,
        shift 69.1 vs 68.6 req/s (paired differences' 90% intervals span 0): kept as
        the replica's true backlog, not as a measured gain."""
        if per_token == 0:
            return 0.0
        recorded_at = now - r.stats_age_s
        since = []
        for at, tokens in reversed(self._sent_tokens.get(r.replica_id, ())):
            if at <= recorded_at:
                break
            since.append((at, tokens))
        backlog, t = r.queued_prefill_tokens * per_token, recorded_at
        for at, tokens in reversed(since):
            backlog = max(0.0, backlog - (at - t)) + tokens * per_token
            t = at
        return max(0.0, backlog - (now - t))

    def _hold_s(self, drains: Iterable[_Drain], slots: float) -> float:
        """hold: how long a request holds one of `slots` batch slots, by the requests a
        saturated replica finishes a second (`drains`, pooled), or request_time_s."""
        drain = self._pooled([d.rate_per_s for d in drains], math.nan)
        return self.config.request_time_s if math.isnan(drain) else slots / drain

    def _pooled(self, published: Sequence[float | None], configured: float) -> float:
        """The mean of the replicas' measured costs, or the configured cost."""
        measured = [c for c in published if c is not None]
        if not measured or not self.config.use_measured_costs:
            return configured
        return sum(measured) / len(measured)

    def _stale(self, r: ReplicaStats) -> bool:
        return r.stats_age_s > self.config.stale_after_s

    def _base_key(self, r: ReplicaStats, wait: dict[str, float], saved: dict[str, float]) -> tuple:
        utilisation = r.queue_len / r.max_concurrency
        cost = wait[r.replica_id] - saved.get(r.replica_id, 0.0)
        return (self._stale(r), cost, utilisation, -r.free_pages, self._rng.random())
