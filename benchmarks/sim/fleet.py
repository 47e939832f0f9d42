"""The fleet simulator: N replicas (benchmarks/sim/fleet_replica.py, each the replica
simulator with a stated GPU profile) behind one Serve router, in simulated time.

Routers:
    affinity   the real AffinityPolicy (router/policy.py) as AffinityRequestRouter drives it:
               ranks from the replicas' routing stats, each replica its own rank, the first
               below max_ongoing_requests taken; queue lengths are the router's own count,
               as Serve's cache gives it. The stats are what a replica deployment publishes
               (the same function, replica/routing_report.py) at Serve's cadence: its
               controller, looping every CONTROL_LOOP_S, calls a replica's
               record_routing_stats once stats_period_s x U(0.9, 1.1) has passed since the
               last call (ray/serve/_private/deployment_state.py
               `_should_record_routing_stats`) and collects the result at its next loop,
               then pushes it to the routers (stats_delay_s more); their age at the router
               is what the policy is told
    pow2       Ray Serve's default router (benchmarks/peers/ray_routers.py) over sync replicas,
               which report no model ids: power of two on queue length
    multiplex  the same router over `@serve.multiplexed` replicas, whose model ids reach
               the router 0.1 s (the push interval) + model_ids_delay_s after they change

Serve's machinery shared by all three: at most min(50, 2N) requests are being routed at a
time, the rest wait in order; a round that finds no replica below max_ongoing_requests is
retried at once, then after Ray's backoff (0.025 s doubling to 0.5 s).

Warm-up: requests with rid < `measured_from` are served (they warm caches, host tiers and
the routers' estimates) but not reported, and the counters are those of the measured
window, from the first measured arrival on.

Failover (kill_at_s): as router/serve_backend.py does, the replica's streams that had
begun resume on another replica (routed again, their prompt and the tokens already streamed
computed again, then the rest generated; their TTFT stays the first token's), its other
requests go back to the router as new calls; Serve starts a replacement after
replace_after_s. Every request finishes; runs are deterministic per seed.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field, replace

import numpy as np

from loraplex.benchmarks.peers.ray_routers import (
    MAX_ROUTING_TASKS,
    PUSH_MODEL_IDS_INTERVAL_S,
    RayRouterModel,
    RaySettings,
    RoutingContext,
)
from loraplex.benchmarks.sim.fleet_replica import FleetReplica, StoreModel
from loraplex.benchmarks.sim.replica import System
from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest
from loraplex.replica.demand import DEMAND_TAU_S, AdapterDemand
from loraplex.router.policy import AffinityConfig, AffinityPolicy, Placement
from loraplex.router.routing_stats import ReplicaStats

ROUTERS = ("affinity", "pow2", "multiplex")
CONTROL_LOOP_S = 0.1  # Serve's controller loop (RAY_SERVE_CONTROL_LOOP_INTERVAL_S)
_STATS_EVENTS = ("publish", "deliver")  # recur while other events or requests remain


@dataclass(frozen=True, slots=True)
class FleetSetup:
    profile: object  # RooflineProfile or LinearProfile
    num_replicas: int
    system: System  # scheduler and device cache; cache.host_bytes: the sync host tier
    store: StoreModel
    affinity: AffinityConfig
    max_ongoing_requests: int
    models_per_replica: int  # multiplex: max_num_models_per_replica
    stats_period_s: float = 1.0
    stats_delay_s: float = 0.0
    model_ids_delay_s: float = 0.05
    kill_at_s: float | None = None
    replace_after_s: float = 30.0
    max_len: int = 4096
    seed: int = 0
    # what the serving path adds to a first token without the replicas' CPU (Ray's handle
    # and actor hops, the client's loop), as measured samples: each request draws one
    # (fleet/validation.py `path_latency`); () adds nothing
    path_s: tuple[float, ...] = ()

    def __post_init__(self):
        if self.num_replicas < 1 or self.max_ongoing_requests < 1 or self.models_per_replica < 1:
            raise ValueError(
                "num_replicas, max_ongoing_requests and models_per_replica must be >= 1"
            )
        if self.stats_period_s <= 0 or self.stats_delay_s < 0:
            raise ValueError("stats_period_s must be > 0 and stats_delay_s >= 0")
        if any(not s >= 0 for s in self.path_s):
            raise ValueError("path_s must be latencies >= 0")


@dataclass(slots=True, eq=False)
class Pending:
    request: SimRequest
    ctx: RoutingContext
    next_try: float | None = None  # None: not being routed yet (beyond the task cap)
    predicted_held: bool = False  # the router's view had its adapter where it sent it


@dataclass(slots=True)
class FleetRun:
    router: str
    arrival: np.ndarray  # per completed request
    ttft: np.ndarray
    e2e: np.ndarray
    replica: list[str]
    adapter: list[str]
    streams_failed: int
    streams_resumed: int
    retried: int
    requests: int
    distinct_adapters: int
    counters: dict
    adapters_held: int = 0  # distinct adapters on the devices and host tiers at the end
    replicas: dict[str, dict] = field(default_factory=dict)
    duration_s: float = 0.0
    # per completed request, as ttft: when it left the router for a replica (its last
    # routing, for a resumed stream), and affinity's estimate of its TTFT there (NaN for
    # Ray's routers, which estimate none)
    routed_at: np.ndarray = field(default_factory=lambda: np.zeros(0))
    estimated_ttft: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def with_path(self, path_s: tuple[float, ...], seed: int) -> FleetRun:
        """This run with what the real path adds (`FleetSetup.path_s`): a draw per completed
        request from `path_s`, in request order (the same draws for every router), added to
        its first token and its end; the run itself where there are no samples. The path
        waits on nothing the replicas do, so a replay can take several paths from one run."""
        if not path_s:
            return self
        path = np.random.default_rng(seed).choice(path_s, len(self.ttft))
        finish = self.arrival + self.e2e + path
        return replace(
            self,
            ttft=self.ttft + path,
            e2e=self.e2e + path,
            duration_s=float(finish.max() - self.arrival.min()) if len(finish) else 0.0,
        )

    def summary(self) -> dict:
        pct = (lambda q: float(np.percentile(self.ttft, q))) if len(self.ttft) else (lambda q: None)
        return {
            "requests": self.requests,
            "completed": len(self.ttft),
            "streams_failed": self.streams_failed,
            "streams_resumed": self.streams_resumed,
            "retried": self.retried,
            "p50_ttft_s": pct(50),
            "p99_ttft_s": pct(99),
            "mean_ttft_s": float(self.ttft.mean()) if len(self.ttft) else None,
            "throughput_rps": len(self.ttft) / self.duration_s if self.duration_s else 0.0,
            "distinct_adapters": self.distinct_adapters,
            "distinct_adapters_held": self.adapters_held,
            "placement_miss_rate": (
                self.counters["placement_misses"] / self.counters["predicted_held"]
                if self.counters.get("predicted_held")
                else None
            ),
            **self.counters,
        }


class FleetSim:
    recurring = _STATS_EVENTS  # events that recur only while there is other work
    demand_window_s = DEMAND_TAU_S  # the replicas' demand memory (replica/demand.py)

    def __init__(
        self,
        router: str,
        requests: list[SimRequest],
        catalog: dict[str, AdapterSpec],
        setup: FleetSetup,
        measured_from: int = 0,
    ):
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        self.router = router
        self.requests = requests
        self.catalog = catalog
        self.setup = setup
        self.now = 0.0
        self.rng = random.Random(setup.seed)
        self.events: list[tuple] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._work = 0  # events in the heap other than _STATS_EVENTS
        self.replicas: dict[str, FleetReplica] = {}
        self.dead: list[FleetReplica] = []
        self.draining: dict[str, FleetReplica] = {}  # routed no more, finishing (scaling.py)
        self.pending: list[Pending] = []
        self.stats: dict[str, tuple[float, ReplicaStats]] = {}  # affinity's view
        self.model_ids: dict[str, frozenset[str]] = {}  # Ray's view
        self.policy = AffinityPolicy(
            dataclasses.replace(setup.affinity, seed=setup.seed), clock=lambda: self.now
        )
        self.ray = RayRouterModel(RaySettings(setup.max_ongoing_requests), seed=setup.seed)
        self.failed_streams = 0  # none: streams resume (kept for the bench's key)
        self.resumed_streams = 0
        self.first_token: dict[int, float] = {}  # resumed streams: their first token's time
        self.retried = 0
        self.routed = 0
        self.measured_from = measured_from
        self.baseline: dict[str, dict] = {}  # counters when the measured window began
        self.routed_at: dict[int, float] = {}  # rid -> when it was last sent to a replica
        self.estimated: dict[int, float] = {}  # rid -> affinity's TTFT estimate there

    # -- running

    def run(self) -> FleetRun:
        for _ in range(self.setup.num_replicas):
            self._start_replica()
        measured = [r for r in self.requests if r.rid >= self.measured_from]
        if measured:  # before the arrivals at the same time
            self._push(min(r.arrival for r in measured), "mark", None)
        for req in self.requests:
            self._push(req.arrival, "arrive", req)
        if self.setup.kill_at_s is not None:
            self._push(self.setup.kill_at_s, "kill", None)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if kind not in self.recurring:
                self._work -= 1
            for replica in [*self.replicas.values(), *self.draining.values()]:
                replica.advance_until(t)
            self.now = t
            getattr(self, f"_on_{kind}")(payload)
        for replica in [*self.replicas.values(), *self.draining.values()]:
            replica.advance_until(math.inf)
        return self._result()

    def _push(self, t: float, kind: str, payload) -> None:
        if kind not in self.recurring:
            self._work += 1
        heapq.heappush(self.events, (t, next(self._seq), kind, payload))

    def _start_replica(self) -> None:
        rid = f"replica-{next(self._ids)}"
        multiplex = self.router == "multiplex"
        system = self.setup.system
        if multiplex:  # the LRU bounds what a multiplexed replica holds, not a host budget
            system = replace(system, cache=replace(system.cache, host_bytes=None))
        replica = FleetReplica(
            rid,
            self.setup.profile,
            system,
            self.setup.max_len,
            self.setup.store,
            self.catalog,
            models_per_replica=self.setup.models_per_replica if multiplex else None,
            demand=AdapterDemand(self.now, self.demand_window_s),
        )
        replica.clock.now = self.now
        replica.sim.cache.reread_window_s = self.demand_window_s  # as the deployment sets it
        self.replicas[rid] = replica
        self.model_ids[rid] = frozenset()
        if self.router != "pow2":
            period = self.period
            self._push(self.now + self.rng.uniform(0, period), "publish", rid)

    @property
    def period(self) -> float:
        return (
            PUSH_MODEL_IDS_INTERVAL_S if self.router == "multiplex" else self.setup.stats_period_s
        )

    # -- events

    def _on_arrive(self, req: SimRequest) -> None:
        ctx = RoutingContext(req.adapter, self.now)
        self.pending.append(Pending(req, ctx))
        self._start_routing()

    def _on_try(self, item: tuple[Pending, float]) -> None:
        pending, at = item
        if pending.next_try == at and pending in self.pending:
            self._attempt(pending)
            self._start_routing()

    def _on_publish(self, rid: str) -> None:
        replica = self.replicas.get(rid)
        if replica is None:
            return
        if self.router == "affinity":
            delay = CONTROL_LOOP_S + self.setup.stats_delay_s
            payload = (rid, self.now, replica.routing_stats())
            jittered = self.period * self.rng.uniform(0.9, 1.1)
            period = math.ceil(jittered / CONTROL_LOOP_S - 1e-9) * CONTROL_LOOP_S
        else:
            delay = self.setup.model_ids_delay_s
            payload = (rid, self.now, replica.model_ids())
            period = self.period
        self._push(self.now + delay, "deliver", payload)
        if self._work or self.pending or any(r.in_flight for r in self.replicas.values()):
            self._push(self.now + period, "publish", rid)

    def _on_deliver(self, payload) -> None:
        rid, recorded_at, published = payload
        if rid not in self.replicas:
            return
        if self.router == "affinity":
            self.stats[rid] = (recorded_at, ReplicaStats.from_routing_stats(rid, published))
        else:
            self.model_ids[rid] = published

    def _on_kill(self, _) -> None:
        # its own draw: the same replica dies whichever router runs
        victim = random.Random(self.setup.seed).choice(sorted(self.replicas))
        replica = self.replicas.pop(victim)
        self.stats.pop(victim, None)
        self.model_ids.pop(victim, None)
        self._fail(replica)
        self._push(self.now + self.setup.replace_after_s, "replace", None)
        self._start_routing()

    def _fail(self, replica: FleetReplica) -> None:
        """The replica stops with requests on it: begun streams resume elsewhere, the rest
        are retried (router/serve_backend.py)."""
        self.dead.append(replica)
        started, retry = replica.kill()
        self.retried += len(retry)
        for req, first_token, streamed in started:
            self.first_token.setdefault(req.rid, first_token)
            self.resumed_streams += 1
            rest = dataclasses.replace(
                req,
                arrival=self.now,
                prompt=req.prompt + streamed,
                output=req.output - streamed,
                max_tokens=max(1, req.max_tokens - streamed),
            )
            self.pending.append(Pending(rest, RoutingContext(req.adapter, self.now)))
        for req in retry:
            self.pending.append(Pending(req, RoutingContext(req.adapter, self.now)))

    def _on_mark(self, _) -> None:
        self.baseline = {rid: r.counters() for rid, r in self.replicas.items()}

    def _on_replace(self, _) -> None:
        self._start_replica()
        self._start_routing()

    # -- routing

    def _start_routing(self) -> None:
        """Routing tasks for the oldest pending requests that have none (Serve's cap)."""
        tasks = min(MAX_ROUTING_TASKS, 2 * max(1, len(self.replicas)))
        while True:  # a request routed frees its task for the next one waiting
            fresh = next((p for p in self.pending[:tasks] if p.next_try is None), None)
            if fresh is None:
                return
            fresh.next_try = self.now
            self._attempt(fresh)

    def _attempt(self, pending: Pending) -> None:
        while pending in self.pending:
            if not self.replicas:  # Serve waits for a replica
                self._retry(pending, self.now + self.setup.replace_after_s)
                return
            if self.router == "affinity":
                replica = self._affinity_round(pending)
                target = pending
            else:
                replica, target = self._ray_round(pending)
                if replica is None:
                    return
            if replica is None:
                pending.ctx.failed_rounds += 1
                if pending.ctx.failed_rounds == 1:
                    pending.ctx.failed_rounds += 1  # the immediate retry finds the same
                backoff = self.ray.backoff_s(pending.ctx.failed_rounds - 2)
                self._retry(pending, self.now + backoff)
                return
            self.pending.remove(target)
            self.routed += 1
            self.routed_at[target.request.rid] = self.now
            if self.router != "affinity":
                adapter = target.request.adapter
                target.predicted_held = adapter in self.model_ids.get(replica, frozenset())
            self.replicas[replica].admit(target.request, target.predicted_held)

    def _retry(self, pending: Pending, at: float) -> None:
        pending.next_try = at
        self._push(at, "try", (pending, at))

    def _affinity_round(self, pending: Pending) -> str | None:
        views = []
        for rid, replica in self.replicas.items():
            recorded_at, stats = self.stats.get(rid, (self.now, ReplicaStats(rid)))
            age = max(0.0, self.now - recorded_at)
            views.append(replace(stats, stats_age_s=age, queue_len=replica.in_flight))
        adapter = pending.request.adapter
        estimates: dict[str, float] = {}
        placements: dict[str, Placement] = {}
        for rid in self.policy.choose(adapter, views, estimates=estimates, placements=placements):
            if self.replicas[rid].in_flight < self.setup.max_ongoing_requests:
                self.policy.observe(
                    adapter,
                    rid,
                    prompt_tokens=pending.request.prompt,
                    placement=placements.get(rid),
                )
                self.estimated[pending.request.rid] = estimates[rid]
                seen = self.stats.get(rid)
                pending.predicted_held = seen is not None and (
                    adapter in seen[1].device_adapters or adapter in seen[1].host_adapters
                )
                return rid
        return None

    def _ray_round(self, pending: Pending) -> tuple[str | None, Pending]:
        queue = {rid: r.in_flight for rid, r in self.replicas.items()}
        view = {rid: self.model_ids.get(rid, frozenset()) for rid in self.replicas}
        result = self.ray.route(pending.ctx, self.now, view, queue)
        if result.replica is None:
            self._retry(pending, result.retry_at)
            return None, pending
        model = pending.request.adapter
        target = next(
            (p for p in self.pending if model is not None and p.request.adapter == model), pending
        )  # FIFOMixin: the oldest pending request of the model gets the replica
        return result.replica, target

    # -- results

    def _every_replica(self) -> list[FleetReplica]:
        return [*self.replicas.values(), *self.draining.values(), *self.dead]

    def _result(self) -> FleetRun:
        records = [r for rep in self._every_replica() for r in rep.sim.done]
        by_rid = {r.request.rid: r for r in records}
        original = {req.rid: req for req in self.requests}
        lost = len(self.requests) - len(by_rid) - self.failed_streams
        assert lost == 0, f"{lost} requests neither finished nor failed their stream"
        done = sorted(
            (r for r in by_rid.values() if r.request.rid >= self.measured_from),
            key=lambda r: r.request.rid,
        )
        measured = [r for r in self.requests if r.rid >= self.measured_from]
        arrival = np.array([original[r.request.rid].arrival for r in done])
        first = np.array([self.first_token.get(r.request.rid, r.first_token) for r in done])
        finish = np.array([r.finish for r in done])
        where = {}
        for rep in self._every_replica():
            for r in rep.sim.done:
                where[r.request.rid] = rep.replica_id
        counters: dict = {}
        per_replica = {}
        for rep in self._every_replica():
            before = self.baseline.get(rep.replica_id, {})
            c = {k: v - before.get(k, 0) for k, v in rep.counters().items()}
            per_replica[rep.replica_id] = c
            for k, v in c.items():
                counters[k] = counters.get(k, 0) + v
        return FleetRun(
            router=self.router,
            arrival=arrival,
            ttft=first - arrival,
            e2e=finish - arrival,
            replica=[where[r.request.rid] for r in done],
            adapter=[original[r.request.rid].adapter for r in done],
            streams_failed=self.failed_streams,
            streams_resumed=self.resumed_streams,
            retried=self.retried,
            requests=len(measured),
            distinct_adapters=len({r.adapter for r in measured}),
            counters=counters,
            adapters_held=len(set().union(*(r.held() for r in self.replicas.values()))),
            replicas=per_replica,
            duration_s=float(finish.max() - arrival.min()) if len(done) else 0.0,
            routed_at=np.array([self.routed_at.get(r.request.rid, np.nan) for r in done]),
            estimated_ttft=np.array([self.estimated.get(r.request.rid, np.nan) for r in done]),
        ).with_path(self.setup.path_s, self.setup.seed)


def simulate_fleet(
    router: str,
    requests: list[SimRequest],
    catalog: dict[str, AdapterSpec],
    setup: FleetSetup,
    measured_from: int = 0,
) -> FleetRun:
    return FleetSim(router, requests, catalog, setup, measured_from).run()
