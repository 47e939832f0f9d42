"""Ray Serve 2.60's request routing as a pure model, for the fleet simulator and the replay
test. Written from Ray's source (paths under `ray/serve/`), not copied from it:

- `_private/request_router/pow_2_router.py`, `PowerOfTwoChoicesRequestRouter.choose_replicas`:
  a request with a multiplexed model id takes its candidates from `apply_multiplex_routing`,
  others all replicas; then two distinct candidates uniformly at random (one if there is
  one), one rank.
- `_private/request_router/request_router.py`:
  `MultiplexMixin.apply_multiplex_routing`: while the request is younger than the matching
  timeout (drawn uniformly from [t, 2t) at every call, t =
  RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S = 1 s) the candidates are the replicas
  reporting the model id; on the first try only, a model no replica reports and no
  concurrent request has already fallen back for goes to the replicas holding the fewest
  models, and every later try within the timeout (the holders were full) goes there too.
  After the timeout: the fewest-models replicas once, then every replica.
  `_get_replica_ids_with_fewest_multiplexed_models`: ties included.
  `_select_from_candidate_replicas`: the candidate with the lowest queue length among those
  below `max_ongoing_requests` (first wins ties); none: this round failed.
  `_choose_replicas_with_backoff`: after a failed round, the first retry is immediate, then
  sleeps initial_backoff_s * multiplier ** k (0.025 s, x2, at most 0.5 s).
  `_fulfill_pending_requests`, `FIFOMixin._fulfill_next_pending_request`: at most
  min(50, 2 x replicas) routing tasks; a replica found is given to the oldest pending
  request with the same model id (FIFO among base-model requests).
- `multiplex.py`, `_ModelMultiplexWrapper.load_model`: a per-replica LRU of at most
  `max_num_models_per_replica` models; a hit moves the model to the back; a miss waits for
  the replica's one load lock, evicts the least recently used model if the replica is
  full (even one whose requests still run), then loads. Loading models are reported
  with the loaded ones (`_get_loading_and_loaded_model_ids`), pushed to the controller
  every PUSH_MULTIPLEXED_MODEL_IDS_INTERVAL_S = 0.1 s when they changed, and from there to
  the routers.

What the model takes as given: the queue length of each replica is exact. The router's
queue-length cache (`ReplicaQueueLengthCache`) counts what it sent minus what finished and
is corrected by every probe and rejection, so with one router it is exact; a replica then
never rejects what the router picked, and the rejection path (`router.py`,
`_route_and_send_request_once`) is not modelled. Locality preferences are off (one node).
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MATCHING_TIMEOUT_S = 1.0  # RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S
PUSH_MODEL_IDS_INTERVAL_S = 0.1  # PUSH_MULTIPLEXED_MODEL_IDS_INTERVAL_S
MAX_ROUTING_TASKS = 50  # RequestRouter.max_num_routing_tasks_cap
# How Ray Serve LLM deploys an LLMServer: `DEFAULT_MAX_ONGOING_REQUESTS` (1e9, env
# RAY_SERVE_LLM_DEFAULT_MAX_ONGOING_REQUESTS) in ray/llm/_internal/serve/constants.py, set by
# `DEFAULT_DEPLOYMENT_OPTIONS` in builder_llm_server.py (`build_llm_deployment`): the engine
# queues and Serve only forwards. A bench that caps it holds requests back in the handle,
# where no engine can batch them.
SERVE_LLM_MAX_ONGOING_REQUESTS = 10**9


@dataclass(frozen=True, slots=True)
class RaySettings:
    max_ongoing_requests: int = 5  # Serve's deployment default; Serve LLM's is 1e9
    matching_timeout_s: float = MATCHING_TIMEOUT_S
    initial_backoff_s: float = 0.025  # RAY_SERVE_ROUTER_RETRY_INITIAL_BACKOFF_S
    backoff_multiplier: float = 2.0  # RAY_SERVE_ROUTER_RETRY_BACKOFF_MULTIPLIER
    max_backoff_s: float = 0.5  # RAY_SERVE_ROUTER_RETRY_MAX_BACKOFF_S

    def __post_init__(self):
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")


@dataclass(slots=True)
class RoutingContext:
    """Ray's `RequestRoutingContext` of one pending request, kept across its tries."""

    model_id: str | None
    created_at: float
    start_matching: float | None = None
    tried_first: bool = False
    tried_fewest: bool = False
    failed_rounds: int = 0


@dataclass(slots=True)
class RoundResult:
    """One call of `RayRouterModel.route`: the replica found, or when to try again; and
    the candidates of the round that decided (for the replay test: a choice is
    deterministic when only one candidate was below max_ongoing_requests)."""

    replica: str | None
    retry_at: float | None
    candidates: frozenset[str] = frozenset()
    eligible: frozenset[str] = frozenset()


class RayRouterModel:
    """PowerOfTwoChoicesRequestRouter (with its MultiplexMixin) deciding for one request.

    `model_ids[r]`: the model ids replica r reported, as the router last heard them
    (empty for a deployment without `@serve.multiplexed`: then every request is plain
    power of two). `queue_len[r]`: requests in flight on r."""

    def __init__(self, settings: RaySettings, seed: int = 0):
        self.settings = settings
        self.rng = random.Random(seed)
        self.fallback_match: set[str] = set()  # `_multiplexed_model_id_fallback_match`

    def route(
        self,
        ctx: RoutingContext,
        now: float,
        model_ids: Mapping[str, frozenset[str]],
        queue_len: Mapping[str, int],
    ) -> RoundResult:
        """Rounds at `now` until one finds a replica or Ray would sleep before the next."""
        while True:
            candidates = self._candidates(ctx, now, model_ids)
            chosen = self._two_choices(candidates)
            eligible = [r for r in chosen if queue_len[r] < self.settings.max_ongoing_requests]
            if eligible:
                best = min(eligible, key=lambda r: queue_len[r])  # first of the lowest wins
                return RoundResult(
                    best, None, frozenset(candidates), self._ties(candidates, queue_len)
                )
            ctx.failed_rounds += 1
            if ctx.failed_rounds > 1:
                return RoundResult(None, now + self.backoff_s(ctx.failed_rounds - 2))

    def backoff_s(self, attempt: int) -> float:
        s = self.settings
        return min(s.initial_backoff_s * s.backoff_multiplier**attempt, s.max_backoff_s)

    def _ties(self, candidates: Sequence[str], queue_len: Mapping[str, int]) -> frozenset[str]:
        """Replicas the round could have picked, over every draw of the two choices: one
        below the cap that some other candidate does not beat (at the cap, or a queue at
        least as long: equal queues go to whichever was drawn first)."""
        cap = self.settings.max_ongoing_requests
        below = [r for r in candidates if queue_len[r] < cap]
        if len(candidates) == 1:
            return frozenset(below)
        return frozenset(
            r
            for r in below
            if any(
                s != r and (queue_len[s] >= cap or queue_len[s] >= queue_len[r]) for s in candidates
            )
        )

    def _candidates(
        self, ctx: RoutingContext, now: float, model_ids: Mapping[str, frozenset[str]]
    ) -> list[str]:
        """`apply_multiplex_routing` (every replica for base-model requests)."""
        everyone = list(model_ids)
        model = ctx.model_id
        if not model:
            return everyone
        if ctx.start_matching is None:
            ctx.start_matching = now
        timeout = self.rng.uniform(
            self.settings.matching_timeout_s, 2 * self.settings.matching_timeout_s
        )
        if now - ctx.start_matching < timeout:
            holders = [r for r in everyone if model in model_ids[r]]
            if (not holders and model not in self.fallback_match) or ctx.tried_first:
                holders = _fewest_models(model_ids)
                self.fallback_match.add(model)
            elif holders:
                self.fallback_match.discard(model)
            ctx.tried_first = True
            return holders
        if not ctx.tried_fewest:
            ctx.tried_fewest = True
            return _fewest_models(model_ids)
        return everyone

    def _two_choices(self, candidates: list[str]) -> list[str]:
        n = len(candidates)
        if n <= 1:
            return list(candidates)
        if n == 2:
            return candidates if self.rng.getrandbits(1) else candidates[::-1]
        i = self.rng.randrange(n)
        j = self.rng.randrange(n - 1)
        return [candidates[i], candidates[j + (j >= i)]]


def _fewest_models(model_ids: Mapping[str, frozenset[str]]) -> list[str]:
    fewest = min((len(m) for m in model_ids.values()), default=0)
    return [r for r, m in model_ids.items() if len(m) == fewest]


class PendingQueue:
    """The router's pending requests (`_pending_requests_to_route`) and its capped
    routing tasks: the oldest `tasks` requests are being routed, the rest wait their
    turn. `fulfil` hands a replica found for one request to the oldest pending request
    of the same model id (FIFOMixin)."""

    def __init__(self, num_replicas: int):
        self.tasks = min(MAX_ROUTING_TASKS, 2 * max(1, num_replicas))
        self.pending: deque[object] = deque()

    def routable(self) -> list[object]:
        return list(self.pending)[: self.tasks]

    def add(self, request: object) -> None:
        self.pending.append(request)

    def fulfil(self, routed: object, model_id: str | None, model_of) -> object:
        """Remove and return the request that gets the replica found for `routed`."""
        for request in self.pending:
            if model_id and model_of(request) == model_id:
                self.pending.remove(request)
                return request
        self.pending.remove(routed)
        return routed


@dataclass(slots=True)
class MultiplexLRU:
    """One replica's `_ModelMultiplexWrapper`: the models it holds in LRU order, the one
    load lock and the models waiting for it."""

    capacity: int  # max_num_models_per_replica; <= 0: unbounded
    models: OrderedDict[str, None] = field(default_factory=OrderedDict)
    loading: str | None = None  # the model holding the load lock
    waiting: deque[str] = field(default_factory=deque)  # misses queued on the lock

    def reported(self) -> frozenset[str]:
        """`_get_loading_and_loaded_model_ids`."""
        return (
            frozenset(self.models)
            | frozenset(self.waiting)
            | ({self.loading} if self.loading else frozenset())
        )

    def use(self, model: str) -> bool:
        """A request for `model` arrives: True if loaded (moved to the back, a hit), else
        it is queued for the load lock (once per model)."""
        if model in self.models:
            self.models.move_to_end(model)
            return True
        if model != self.loading and model not in self.waiting:
            self.waiting.append(model)
        return False

    def start_next_load(self) -> tuple[str, str | None] | None:
        """Take the lock for the next waiting model: (model, evicted LRU model or None);
        None if the lock is held or nothing waits."""
        if self.loading is not None or not self.waiting:
            return None
        model = self.waiting.popleft()
        evicted = None
        if 0 < self.capacity <= len(self.models):
            evicted, _ = self.models.popitem(last=False)
        self.loading = model
        return model, evicted

    def loaded(self, model: str) -> None:
        assert self.loading == model, f"{model} finished loading but {self.loading} held the lock"
        self.loading = None
        self.models[model] = None
