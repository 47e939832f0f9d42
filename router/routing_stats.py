"""What a replica tells the router: the routing-stats contract and its parsed form.

Routing-stats contract. Each replica deployment returns from `record_routing_stats` a dict
with these keys (`RoutingStats`); a missing key counts as empty or 0, so a replica that has
not published yet is routable:

    device_adapters   list[str]  adapters resident in the device pool
    host_adapters     list[str]  adapters with a host copy, not on the device (the engine's
                                 own host tier: a copy its budget dropped is not in it)
    loading_adapters  list[str]  adapters being loaded towards the device, or read from the
                                 store (those not in host_adapters are store reads)
    queue_len         int        requests the replica holds (waiting for a read, queued,
                                 running)
    adapter_queue     dict[str, int]  those requests per adapter (optional)
    queued_prefill_tokens int    prompt tokens its engine has yet to prefill (waiting
                                 requests', and what is left of running ones'; optional)
    running           int        its engine's batch rows (optional)
    waiting_for_pages int        waiting requests its engine's last step held back because
                                 the pool had no pages for them (a running one preempted,
                                 or admission stopped there); not those held back by the
                                 step's token budget or max_num_seqs, or that arrived since
                                 (optional)
    step_token_budget int        prompt tokens one step of its engine prefills at most
                                 (`max_num_batched_tokens`; optional)
    batch_adapters    list[str]  the distinct adapters of its engine's running batch
                                 (optional)
    max_loras_per_batch int      adapters its engine runs in one batch at most: at that
                                 many, a request of another adapter waits for one of
                                 theirs to leave, whatever the free slots (optional; 0 or
                                 missing: no cap)
    store_reads_queued int       store reads in flight: loading adapters without a host copy
    store_read_s      float      measured: mean time of one store read (optional)
    read_queue_s      float      when the reads in flight are expected to be done, seconds
                                 from recorded_at (optional, with store_read_s)
    max_concurrency   int        batch slots (missing or 0 counts as 1)
    free_pages        int        free pages of the unified pool
    num_pages         int        pages in the pool (optional; for `loraplex status`)
    recorded_at       float      wall-clock time the replica recorded them (optional)
    requests_total    int        requests the replica has received (optional): with queue_len,
                                 those it has finished, whose rate prices its queue
    busy_cost_s       float      measured: TTFT each running request adds (optional)
    host_load_cost_s  float      measured: what bringing an adapter in from the host tier
                                 costs, its load and its segment in the batch (optional)
    prefill_token_cost_s  float  measured: prefill time per prompt token (optional)
    prefix_block_size int        tokens per cached KV block; absent: no prefix cache
    prefix_share_base bool       base-model blocks are shared across tenants (optional)

`ReplicaStats.from_routing_stats(replica_id, stats, age_s)` turns one into policy input;
`age_s` is the stats' age (the Ray router computes it from `recorded_at`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict


class RoutingStats(TypedDict, total=False):
    device_adapters: list[str]
    host_adapters: list[str]
    loading_adapters: list[str]
    queue_len: int
    adapter_queue: dict[str, int]
    queued_prefill_tokens: int
    running: int
    waiting_for_pages: int
    step_token_budget: int
    batch_adapters: list[str]
    max_loras_per_batch: int
    store_reads_queued: int
    store_read_s: float
    read_queue_s: float
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
    adapter_queue: Mapping[str, int] = field(default_factory=dict)  # requests per adapter
    queued_prefill_tokens: int = 0
    # the engine's batch rows and the waiting requests its last step held back for want of
    # pages, when it recorded these stats; None: not published
    running: int | None = None
    waiting_for_pages: int = 0
    step_token_budget: int = 0  # 0: not published
    batch_adapters: frozenset[str] = frozenset()  # the running batch's distinct adapters
    max_loras_per_batch: int = 0  # 0: no cap published
    store_reads_queued: int = 0
    store_read_s: float | None = None  # measured by the replica; None: not yet
    read_queue_s: float = 0.0
    # requests it had finished when it recorded these stats (requests_total - queue_len) and
    # the queue it held then: `queue_len` is replaced by the router's own, fresher count
    requests_finished: int = 0
    held: int = 0

    def __post_init__(self):
        if (
            self.queue_len < 0
            or self.queued_prefill_tokens < 0
            or self.max_concurrency < 1
            or not self.stats_age_s >= 0
        ):
            raise ValueError(
                f"replica {self.replica_id!r}: need queue_len >= 0, queued_prefill_tokens >= 0, "
                f"max_concurrency >= 1 and stats_age_s >= 0, got {self.queue_len}, "
                f"{self.queued_prefill_tokens}, {self.max_concurrency}, {self.stats_age_s}"
            )
        if self.prefix_block_size < 0:
            raise ValueError(f"replica {self.replica_id!r}: prefix_block_size must be >= 0")
        for name in ("busy_cost_s", "host_load_cost_s", "prefill_token_cost_s", "store_read_s"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise ValueError(f"replica {self.replica_id!r}: {name} must be >= 0, got {value}")

    @classmethod
    def from_routing_stats(
        cls, replica_id: str, stats: Mapping[str, Any], age_s: float = 0.0
    ) -> ReplicaStats:
        queue_len = int(stats.get("queue_len") or 0)
        return cls(
            replica_id=replica_id,
            device_adapters=frozenset(stats.get("device_adapters") or ()),
            host_adapters=frozenset(stats.get("host_adapters") or ()),
            loading_adapters=frozenset(stats.get("loading_adapters") or ()),
            queue_len=queue_len,
            max_concurrency=max(1, int(stats.get("max_concurrency") or 0)),
            free_pages=int(stats.get("free_pages") or 0),
            stats_age_s=age_s,
            busy_cost_s=_optional_float(stats.get("busy_cost_s")),
            host_load_cost_s=_optional_float(stats.get("host_load_cost_s")),
            prefill_token_cost_s=_optional_float(stats.get("prefill_token_cost_s")),
            prefix_block_size=int(stats.get("prefix_block_size") or 0),
            prefix_share_base=bool(stats.get("prefix_share_base")),
            adapter_queue=dict(stats.get("adapter_queue") or {}),
            queued_prefill_tokens=int(stats.get("queued_prefill_tokens") or 0),
            running=None if stats.get("running") is None else int(stats["running"]),
            waiting_for_pages=int(stats.get("waiting_for_pages") or 0),
            step_token_budget=int(stats.get("step_token_budget") or 0),
            batch_adapters=frozenset(stats.get("batch_adapters") or ()),
            max_loras_per_batch=int(stats.get("max_loras_per_batch") or 0),
            store_reads_queued=int(stats.get("store_reads_queued") or 0),
            store_read_s=_optional_float(stats.get("store_read_s")),
            read_queue_s=float(stats.get("read_queue_s") or 0.0),
            requests_finished=max(0, int(stats.get("requests_total") or 0) - queue_len),
            held=queue_len,
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
