"""Adapter-affinity replica selection: a pure policy over the replicas' routing stats.

The Ray Serve `RequestRouter`, the simulator and the tests drive this one object: `choose`
ranks replicas for a request and `observe` feeds the per-adapter request-rate estimate. It
imports nothing of Ray and reads time only through the injected clock.

Routing-stats contract. Each replica deployment returns from `record_routing_stats` a dict
with these keys (`RoutingStats`); a missing key counts as empty or 0, so a replica that has
not published yet is routable:

    device_adapters   list[str]  adapters resident in the device pool
    host_adapters     list[str]  adapters in the host tier, not on the device
    loading_adapters  list[str]  adapters being loaded towards the device
    queue_len         int        waiting + running requests
    max_concurrency   int        batch slots (missing or 0 counts as 1)
    free_pages        int        free pages of the unified pool
    num_pages         int        pages in the pool (optional; for `loraplex status`)
    recorded_at       float      wall-clock time the replica recorded them (optional)
    busy_cost_s       float      measured: TTFT each running request adds (optional)
    host_load_cost_s  float      measured: what bringing an adapter in from the host tier
                                 costs, its load and its segment in the batch (optional)
    prefill_token_cost_s  float  measured: prefill time per prompt token (optional)
    prefix_block_size int        tokens per cached KV block; absent: no prefix cache
    prefix_share_base bool       base-model blocks are shared across tenants (optional)

Adapters are named by version (`tenant/name@version`, replica/protocol.py): residency,
rates and placements are per version, while an adapter's consistent-hash home is per name,
so a name's new version goes where its old one was.

Measured costs (`use_measured_costs`) are pooled: every replica is judged by the mean of
what the replicas publish, the configured cost while none has. Replicas of one deployment
run on the same hardware, so their differences are noise, and per-replica noise would
decide ties that belong to the adapter's walk (and make a new replica, not yet measured,
look dearer or cheaper than the rest).

`ReplicaStats.from_routing_stats(replica_id, stats, age_s)` turns one into policy input;
`age_s` is the stats' age (the Ray router computes it from `recorded_at`).
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, TypedDict

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from loraplex.replica.protocol import adapter_name
from loraplex.router.prefix_affinity import PrefixIndex
from loraplex.settings import FORBID_EXTRA


class RoutingStats(TypedDict, total=False):
    device_adapters: list[str]
    host_adapters: list[str]
    loading_adapters: list[str]
    queue_len: int
    max_concurrency: int
    free_pages: int
    busy_cost_s: float
    host_load_cost_s: float
    prefill_token_cost_s: float
    prefix_block_size: int
    prefix_share_base: bool


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    replica_id: str
    device_adapters: frozenset[str] = frozenset()
    host_adapters: frozenset[str] = frozenset()
    loading_adapters: frozenset[str] = frozenset()
    queue_len: int = 0  # waiting + running requests
    max_concurrency: int = 1  # batch slots
    free_pages: int = 0
    stats_age_s: float = 0.0  # age of these stats when the router read them
    busy_cost_s: float | None = None  # measured by the replica; None: not yet
    host_load_cost_s: float | None = None
    prefill_token_cost_s: float | None = None
    prefix_block_size: int = 0  # 0: no prefix cache
    prefix_share_base: bool = False

    def __post_init__(self):
        if self.queue_len < 0 or self.max_concurrency < 1 or not self.stats_age_s >= 0:
            raise ValueError(
                f"replica {self.replica_id!r}: need queue_len >= 0, max_concurrency >= 1 and "
                f"stats_age_s >= 0, got {self.queue_len}, {self.max_concurrency}, {self.stats_age_s}"
            )
        if self.prefix_block_size < 0:
            raise ValueError(f"replica {self.replica_id!r}: prefix_block_size must be >= 0")
        for name in ("busy_cost_s", "host_load_cost_s", "prefill_token_cost_s"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise ValueError(f"replica {self.replica_id!r}: {name} must be >= 0, got {value}")

    @classmethod
    def from_routing_stats(
        cls, replica_id: str, stats: Mapping[str, Any], age_s: float = 0.0
    ) -> ReplicaStats:
        return cls(
            replica_id=replica_id,
            device_adapters=frozenset(stats.get("device_adapters") or ()),
            host_adapters=frozenset(stats.get("host_adapters") or ()),
            loading_adapters=frozenset(stats.get("loading_adapters") or ()),
            queue_len=int(stats.get("queue_len") or 0),
            max_concurrency=max(1, int(stats.get("max_concurrency") or 0)),
            free_pages=int(stats.get("free_pages") or 0),
            stats_age_s=age_s,
            busy_cost_s=_optional_float(stats.get("busy_cost_s")),
            host_load_cost_s=_optional_float(stats.get("host_load_cost_s")),
            prefill_token_cost_s=_optional_float(stats.get("prefill_token_cost_s")),
            prefix_block_size=int(stats.get("prefix_block_size") or 0),
            prefix_share_base=bool(stats.get("prefix_share_base")),
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


class Affinity(IntEnum):
    """How well a replica suits an adapter; lower is better."""

    DEVICE = 0  # resident in the device pool
    LOADING = 1  # being loaded, or just sent a request of it (its stats do not show it yet)
    EXTRA_HOME = 2  # not on the device, taken as another home of a hot adapter
    COLD = 3  # not on the device, within the bounded load and the bounded adapter count
    CROWDED = 4  # not on the device, within the bounded load, holding more than its share
    # of adapters or of their request rate
    OVER_BOUND = 5  # not on the device, above the bounded load


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
        2.0, gt=0, le=3600, description="Mean time a request holds a batch slot, seconds."
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
    hot_rate_per_replica: float = Field(
        8.0, gt=0, le=1e6, description="Requests/s of one adapter that one replica absorbs."
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
        "replica's prefix cache saves (replicas' measurements replace it as for busy_cost_s).",
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
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seeds tie-breaks between replicas.")

    @model_validator(mode="after")
    def _host_below_cold(self) -> AffinityConfig:
        if self.host_load_cost_s > self.load_cost_s:
            raise ValueError(
                f"host_load_cost_s ({self.host_load_cost_s:g}) must not exceed load_cost_s "
                f"({self.load_cost_s:g}): a host-tier load is a part of a cold load"
            )
        return self


def walk_order(adapter: str, replica_ids: Sequence[str]) -> list[str]:
    """The adapter's consistent-hash walk: replicas by descending hash(name, replica)
    (rendezvous hashing), the name being the adapter's without its version. The first is the adapter's home. Removing a replica changes the
    home only of the adapters it was home to, and adding one takes only the adapters it
    now outranks: ~1/N either way. A hot home's overflow goes to each adapter's own next
    replica, so it spreads over all others instead of piling onto one ring neighbour.
    blake2b, not hash(): every router process must agree on the walk."""

    name = adapter_name(adapter)

    def weight(replica_id: str) -> bytes:
        key = f"{name}\0{replica_id}".encode()
        return hashlib.blake2b(key, digest_size=8).digest()

    return sorted(
        replica_ids, key=lambda replica_id: (weight(replica_id), replica_id), reverse=True
    )


class AffinityPolicy:
    """Ranks replicas for a request from their `ReplicaStats`.

    Adapter request, adapter `a`, n replicas. For every replica r:

        wait(r)  = max(0, queue_len - max_concurrency + 1) / max_concurrency * request_time_s
                   + queue_len * busy_cost_s
                   (seconds until a batch slot frees: slots free at max_concurrency per
                   request_time_s; 0 while one is free, since continuous batching admits
                   at the next step. busy_cost_s is what each request already there adds
                   to the steps a new one waits through: about 0 on a GPU, whose decode
                   step time hardly grows with the batch, but a compute-bound CPU step
                   grows with every sequence in it)
        load(r)  = 0 on device or for an extra home | host_load_cost_s loading or in the
                   host tier | load_cost_s otherwise (read from the artifact store)
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
                   loaded replica always is. A replica with a free batch slot is
                   always within it: continuous batching admits the request at the
                   next step, so taking it delays no one, and leaving the adapter's
                   home then would only load the adapter twice)
        held(r)  = adapters on r's device or loading there, with those this router sent
                   r a request of since r's stats were recorded
        share    = ceil(c_adapters * (sum of held + 1) / n)    (the same bound over
                   adapters: a cold adapter skips a home holding >= share adapters,
                   so the hash's imbalance never makes one replica's pool evict while
                   another's has room; the aggregate pool of n replicas then holds
                   about n times one replica's working set)
        heat(r)  = sum of rate(b) over b in held(r): the request rate its adapters draw
        crowded  = held(r) >= share, or heat(r) > c * (sum of heat) / n: a replica whose
                   adapters already draw more than their share of the traffic takes no
                   new one while another replica can, so popular adapters placed on one
                   replica early do not also get the tail's requests

    Warm means on the device or loading there. Every other replica needs a load, from the
    host tier or the artifact store, and is placed by the bounds above: a replica whose
    host tier holds the adapter is only cheaper to load on, not warm: a replica keeps in
    its host tier every adapter it has served (pinned ones from the start), so under a
    router that spreads requests the host tiers fill with every adapter.

    Placements. `observe(a, replica_id)` records that a request of `a` went to the
    replica. Until the replica publishes stats newer than that, it counts as loading `a`:
    stats are a period old, and without this a burst of one cold adapter would each be
    judged against stats that do not show the first of them.

    Hot adapters: k(a) = min(n, max(1, ceil(rate(a) / hot_rate_per_replica))), with
    rate(a) the decayed count of `observe(a)` calls over rate_window_s. If a is warm on w
    replicas with 1 <= w < k(a), the first k(a) - w other replicas within the bound
    (uncrowded first, then along a's walk) are extra homes: their load cost is waived
    because it amortises over the adapter's rate: a warm replica keeps a tie, so it loses
    to an idle extra home only once it has no free slot.

    Order: ascending (stale, ttft, affinity, position on a's walk), stale meaning
    stats_age_s > stale_after_s. Among fresh replicas, a warm one is passed over only when
    another's wait plus its load cost is strictly lower (equal estimates go to affinity),
    and a cold adapter goes to the first replica on its walk within both bounds.

    Base-model request: ascending (stale, wait - saved, queue_len / max_concurrency,
    -free_pages, a draw from the seeded RNG), so equally loaded replicas share base traffic
    and a shared prefix goes where it is cached while that is cheaper than waiting.

    Prefix and adapter affinity are one cost: a prefix hit saves its prefill time, an
    adapter hit saves a load, and whichever replica's total is lowest wins. The prompt's
    keys (`choose(..., prefix=keys)`, `observe(..., prefix=keys)`) are those of
    `protocol.extend_block_keys`, computed by the caller with the replicas' block size.

    Every replica is returned, best first; no replicas gives []. The caller tries them in
    order and applies its own back-pressure. Call `observe` once per routed request.
    """

    def __init__(
        self,
        config: AffinityConfig,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.clock = clock
        self._rng = random.Random(config.seed)
        self._counts: dict[str, tuple[float, float]] = {}  # adapter -> (decayed count, at)
        self._placed: dict[str, dict[str, float]] = {}  # replica -> {adapter: sent at}
        self.prefixes = PrefixIndex(config.prefix_index_keys, config.prefix_ttl_s)

    def observe(
        self, adapter: str | None, replica_id: str | None = None, prefix: Sequence[bytes] = ()
    ) -> None:
        """Count one request of `adapter` now, sent to `replica_id` when given, its prompt
        starting with the blocks `prefix`; base-model requests' rates are not tracked."""
        now = self.clock()
        if prefix and replica_id is not None:
            self.prefixes.record(prefix[: self.config.prefix_blocks], replica_id, now)
        if adapter is None:
            return
        self._counts[adapter] = (self._count(adapter, now) + 1.0, now)
        if replica_id is not None:
            placed = self._placed.setdefault(replica_id, {})
            for old in [a for a, at in placed.items() if now - at > self.config.stale_after_s]:
                del placed[old]  # stats fresher than this have long arrived
            placed[adapter] = now

    def rate(self, adapter: str) -> float:
        """Requests/s of `adapter`: for a steady rate the count settles at rate *
        rate_window_s, so count / rate_window_s estimates it."""
        return self._count(adapter, self.clock()) / self.config.rate_window_s

    def max_replicas(self, adapter: str) -> int:
        """k(adapter): how many replicas the adapter may be warm on before it stops spreading."""
        return max(1, math.ceil(self.rate(adapter) / self.config.hot_rate_per_replica))

    def choose(
        self,
        adapter: str | None,
        replicas: Sequence[ReplicaStats],
        prefix: Sequence[bytes] = (),
    ) -> list[str]:
        ids = [r.replica_id for r in replicas]
        assert len(set(ids)) == len(ids), f"duplicate replica ids in {ids}"
        if not replicas:
            return []
        busy = self._pooled([r.busy_cost_s for r in replicas], self.config.busy_cost_s)
        saved = self._prefill_saved(replicas, prefix)
        if adapter is None:
            return [
                r.replica_id for r in sorted(replicas, key=lambda r: self._base_key(r, busy, saved))
            ]

        n = len(replicas)
        walk = walk_order(adapter, ids)
        position = {replica_id: i for i, replica_id in enumerate(walk)}
        by_id = {r.replica_id: r for r in replicas}
        capacity = math.ceil(
            self.config.bounded_load_c * (sum(r.queue_len for r in replicas) + 1) / n - 1e-9
        )
        now = self.clock()
        held = {r.replica_id: self._held(r, now) for r in replicas}
        share = math.ceil(
            self.config.bounded_adapters_c * (sum(map(len, held.values())) + 1) / n - 1e-9
        )
        host = self._pooled([r.host_load_cost_s for r in replicas], self.config.host_load_cost_s)

        warm: dict[str, Affinity] = {}
        for r in replicas:
            if adapter in r.device_adapters:
                warm[r.replica_id] = Affinity.DEVICE
            elif adapter in held[r.replica_id]:
                warm[r.replica_id] = Affinity.LOADING
        spare = min(n, self.max_replicas(adapter)) - len(warm) if warm else 0

        def in_bound(r: ReplicaStats) -> bool:
            return r.queue_len < max(capacity, r.max_concurrency)

        heat = {rid: sum(self._count(b, now) for b in bs) for rid, bs in held.items()}
        hot_share = self.config.bounded_load_c * sum(heat.values()) / n

        def crowded(replica_id: str) -> bool:
            return len(held[replica_id]) >= share or heat[replica_id] > hot_share

        cold_in_bound = sorted(
            (rid for rid in walk if rid not in warm and in_bound(by_id[rid])), key=crowded
        )
        extra_homes = set(cold_in_bound[: max(0, spare)])

        def affinity(r: ReplicaStats) -> Affinity:
            if r.replica_id in warm:
                return warm[r.replica_id]
            if r.replica_id in extra_homes:
                return Affinity.EXTRA_HOME
            if not in_bound(r):
                return Affinity.OVER_BOUND
            return Affinity.CROWDED if crowded(r.replica_id) else Affinity.COLD

        def load_s(r: ReplicaStats, a: Affinity) -> float:
            if a in (Affinity.DEVICE, Affinity.EXTRA_HOME):
                return 0.0
            if a is Affinity.LOADING or adapter in r.host_adapters:
                return host
            return self.config.load_cost_s - self.config.host_load_cost_s + host  # + the read

        def key(r: ReplicaStats) -> tuple:
            a = affinity(r)
            return (
                self._stale(r),
                self._wait_s(r, busy) + load_s(r, a) - saved.get(r.replica_id, 0.0),
                a,
                position[r.replica_id],
            )

        return [r.replica_id for r in sorted(replicas, key=key)]

    def _prefill_saved(
        self, replicas: Sequence[ReplicaStats], prefix: Sequence[bytes]
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
        per_token = self._pooled(
            [r.prefill_token_cost_s for r in replicas], self.config.prefill_token_cost_s
        )
        blocks = {r.replica_id: r.prefix_block_size for r in replicas}
        return {rid: n * blocks[rid] * per_token for rid, n in matched.items()}

    def _held(self, r: ReplicaStats, now: float) -> frozenset[str]:
        """Adapters on r's device or loading there, and those sent to r since its stats."""
        recorded_at = now - r.stats_age_s
        placed = self._placed.get(r.replica_id, {})
        since = {a for a, at in placed.items() if at > recorded_at}
        return r.device_adapters | r.loading_adapters | since

    def _count(self, adapter: str, now: float) -> float:
        count, at = self._counts.get(adapter, (0.0, now))
        return count * math.exp(-max(0.0, now - at) / self.config.rate_window_s)

    def _wait_s(self, r: ReplicaStats, busy_cost_s: float) -> float:
        queued_behind = max(0, r.queue_len - r.max_concurrency + 1)
        slot = queued_behind / r.max_concurrency * self.config.request_time_s
        return slot + r.queue_len * busy_cost_s

    def _pooled(self, published: Sequence[float | None], configured: float) -> float:
        """The mean of the replicas' measured costs, or the configured cost."""
        measured = [c for c in published if c is not None]
        if not measured or not self.config.use_measured_costs:
            return configured
        return sum(measured) / len(measured)

    def _stale(self, r: ReplicaStats) -> bool:
        return r.stats_age_s > self.config.stale_after_s

    def _base_key(self, r: ReplicaStats, busy_cost_s: float, saved: dict[str, float]) -> tuple:
        utilisation = r.queue_len / r.max_concurrency
        cost = self._wait_s(r, busy_cost_s) - saved.get(r.replica_id, 0.0)
        return (self._stale(r), cost, utilisation, -r.free_pages, self._rng.random())
