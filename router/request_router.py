"""AffinityPolicy as a Ray Serve request router.

Ray Serve asks `choose_replicas` for ranks of candidate replicas and sends the request to
the first rank with a replica below its `max_ongoing_requests` (probing queue lengths when
its cache has none), moving to the next rank when a rank is full, and backing off when
every rank is. This class only translates: each replica's published routing stats
(`record_routing_stats` of replica/deployment.py) become `ReplicaStats`, the policy ranks
them, and every replica becomes a rank of its own, best first, except those Serve already
knows to be full: last, two of them at random in one rank (`ranks_by_room`). Each choice
waits for one turn of the event loop first, so that Serve has counted the requests already
placed (`yield_before_choosing`).

The adapter is the request's `multiplexed_model_id` ("" for the base model), set by the
caller through `handle.options(multiplexed_model_id=...)`: a version id,
`tenant/name@version`. The prompt's prefix keys are computed here, in the ingress's process,
from the request (`GenerateRequest`: token ids, adapter version, tenant) and the block size
the replicas publish, with the replicas' own key function (`protocol.extend_block_keys`),
once per request.

No FIFOMixin: it hands the replica chosen for one request to whichever request is first in
the queue, which would send adapter A's pick to adapter B. Serve's default matching keeps
each choice with the request it was made for.

`routing_snapshot(top_n)` reports what the routers of this process know of each adapter
(its rate and homes), and `placement_counts()` how many adapter requests went to a replica
of each affinity and tier (`Placement`: how many were sent where the adapter must be read
from the store, and why): the ingress's /metrics shows both.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from loraplex.replica.protocol import adapter_version, extend_block_keys, prefix_root
from loraplex.router import live_routers
from loraplex.router.policy import AffinityConfig, AffinityPolicy, Placement
from loraplex.router.routing_stats import ReplicaStats

_MEMO = 1024  # requests whose prefix keys and placements are kept between choosing and routing
_RNG = random.Random()  # the pair of full replicas probed (`ranks_by_room`)

if TYPE_CHECKING:
    from ray.serve._private.replica_result import ReplicaResult


class AffinityRequestRouter(RequestRouter):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.policy = AffinityPolicy(AffinityConfig())
        self.wall_clock: Callable[[], float] = time.time  # compares with `recorded_at`
        # Parsed stats per replica, kept while its published dict is the same object: the
        # policy then sees the same adapter sets and reuses what it derived from them.
        self._parsed: dict[str, tuple[dict[str, Any], ReplicaStats]] = {}
        live_routers.add(self)
        self._prefixes: collections.OrderedDict[str, tuple[bytes, ...]] = collections.OrderedDict()
        # Each pending request's replicas as its last choice judged them, until it is routed
        self._placements: collections.OrderedDict[str, dict[str, Placement]] = (
            collections.OrderedDict()
        )
        # Sends to replicas, and those a replica accepted: the difference, once nothing is in
        # flight, is how many it turned away (at max_ongoing_requests).
        self.sends = 0
        self.accepted = 0

    def initialize_state(self, **config: Any) -> None:
        """`request_router_kwargs`: AffinityConfig fields."""
        self.policy = AffinityPolicy(AffinityConfig(**config))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every rank was tried once: let Serve back off before asking again.
            pending_request.routing_context.should_backoff = True
        # Let the requests already given a replica be sent before choosing again: Serve
        # counts a send in its queue-length cache only when the request's own task resumes,
        # and a routing task that never yields hands every pending request to the same
        # replica with room (see `yield_before_choosing`).
        await yield_before_choosing()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        stats = [self._replica_stats(r) for r in candidate_replicas]
        prefix = self._prefix(pending_request, stats)
        placements: dict[str, Placement] = {}
        ranked = self.policy.choose(_adapter(pending_request), stats, prefix, placements=placements)
        if pending_request is not None and placements:
            _remember(self._placements, pending_request.metadata.request_id, placements)
        return ranks_by_room(
            [by_id[replica_id] for replica_id in ranked], self.replica_queue_len_cache.get
        )

    def on_send_request(self, replica_id: ReplicaID) -> None:
        self.sends += 1
        super().on_send_request(replica_id)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self.accepted += 1
        request_id = pending_request.metadata.request_id
        prefix = self._prefixes.pop(request_id, ())
        placement = self._placements.pop(request_id, {}).get(replica_id.unique_id)
        self.policy.observe(
            _adapter(pending_request),
            replica_id.unique_id,
            prefix,
            _prompt_tokens(pending_request),
            placement,
        )

    def _prefix(
        self, pending_request: PendingRequest | None, stats: Sequence[ReplicaStats]
    ) -> tuple[bytes, ...]:
        """The keys of the request's first `prefix_blocks` full KV blocks as the replicas
        key them (empty without a prefix cache on them, or for a request of another form)."""
        request = _request_of(pending_request)
        if pending_request is None or request is None or "prompt_token_ids" not in request:
            return ()
        request_id = pending_request.metadata.request_id
        if request_id in self._prefixes:
            return self._prefixes[request_id]
        published = [s for s in stats if s.prefix_block_size]
        if not published:
            return ()
        block_size, share_base = published[0].prefix_block_size, published[0].prefix_share_base
        keys = prompt_prefix_keys(request, block_size, share_base, self.policy.config.prefix_blocks)
        _remember(self._prefixes, request_id, keys)
        return keys

    def _replica_stats(self, replica: RunningReplica) -> ReplicaStats:
        replica_id = replica.replica_id.unique_id
        published = replica.routing_stats or {}
        recorded_at = published.get("recorded_at")
        age = 0.0 if recorded_at is None else max(0.0, self.wall_clock() - recorded_at)
        cached = self._parsed.get(replica_id)
        if cached is not None and cached[0] is published:
            stats = replace(cached[1], stats_age_s=age)
        else:
            stats = ReplicaStats.from_routing_stats(replica_id, published, age)
            self._parsed[replica_id] = (published, stats)
        # Serve's own count of requests this router sent and the replica has not finished
        # is fresher than the published queue (a period old); prefer it when cached.
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return stats if queue_len is None else replace(stats, queue_len=queue_len)


async def yield_before_choosing() -> None:
    """One turn of the event loop. Serve's routing task gives a chosen replica to a request
    by resolving its future (ray/serve/_private/request_router/request_router.py,
    `_fulfill_pending_requests`), and only the request's own task, once it resumes, sends
    it and adds it to the queue-length cache (router.py, `_route_and_send_request_once`,
    `on_send_request`). Without a turn in between, the routing task goes on to the next
    pending request with the cache as it was: in a burst, every pending request went to
    the one replica the cache showed with room, and all but its free slots were turned
    away and routed again. On the router bench's LoRA-capacity burst (480 requests, 3
    replicas at max_ongoing_requests 32) that was 5,500-6,130 sends turned away, 12 a
    request (Serve's power of two: 530-900), and 14-16 completions a second against its
    23-34; with the turn, 1,110-1,310 turned away and 19-24 a second. Ray's own routers
    choose a random pair, which spreads the same herd over replicas; ranks ordered by
    room put it all on one."""
    await asyncio.sleep(0)


def ranks_by_room(
    ranked: list[RunningReplica],
    queue_len: Callable[[ReplicaID], int | None],
    rng: random.Random | None = None,
) -> list[list[RunningReplica]]:
    """Serve's ranks from the policy's order: each replica a rank of its own, best first,
    but those Serve's queue-length cache says are full (at `max_ongoing_requests`) last and
    together, two of them at random when more are full. Serve probes a full replica before
    sending to it, and each rank it finds full raises the next probe's deadline (0.1 s,
    doubling up to 1 s, ray/serve/_private/request_router/request_router.py,
    `_probe_queue_lens`): with a rank each, a saturated fleet of N was probed one replica
    after another, N deadlines an attempt, each a round trip to a busy replica; in one rank
    they are probed at once, as Ray's own routers' ranks are, and Serve takes the least
    loaded with room. All of them in that rank sent every routing task probing at once to
    the same least loaded one, where all but the first were turned away; a random pair, as
    Serve's power of two draws, spreads them (the LoRA-capacity burst's sends turned away:
    1,110-1,310 with every full replica in the rank, 650-720 with a pair)."""
    room, full = [], []
    for replica in ranked:
        held = queue_len(replica.replica_id)
        (full if held is not None and held >= replica.max_ongoing_requests else room).append(
            replica
        )
    if len(full) > 2:
        full = (rng or _RNG).sample(full, 2)
    return [[replica] for replica in room] + ([full] if full else [])


def prompt_prefix_keys(
    request: dict[str, Any], block_size: int, share_base: bool, max_blocks: int
) -> tuple[bytes, ...]:
    """The keys of a `GenerateRequest`'s first `max_blocks` full KV blocks, as a replica
    whose prefix cache has `block_size` and `share_base` keys them: the replica's own key
    functions (replica/prefix_keys.py, through protocol.py), rooted at the request's adapter
    version, tenant and cache_salt."""
    version = adapter_version(request.get("adapter"))
    root = prefix_root(
        version, request.get("tenant"), request.get("cache_salt"), share_base=share_base
    )
    tokens = request["prompt_token_ids"]
    n = min(len(tokens) // block_size, max_blocks)
    return tuple(extend_block_keys([], root, tokens, block_size, n))


def _remember(memo: collections.OrderedDict, request_id: str, value: Any) -> None:
    """Keep `value` for a pending request until it is routed, the newest `_MEMO` at most."""
    memo[request_id] = value
    memo.move_to_end(request_id)
    while len(memo) > _MEMO:
        memo.popitem(last=False)


def _request_of(pending_request: PendingRequest | None) -> dict | None:
    """The generate request a pending call carries (None for a call of another form)."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, dict) else None


def _prompt_tokens(pending_request: PendingRequest) -> int:
    """The request's prompt length (0 for a request of another form)."""
    request = _request_of(pending_request)
    return len(request.get("prompt_token_ids") or ()) if request is not None else 0


def _adapter(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    return pending_request.metadata.multiplexed_model_id or None
