"""Prometheus metrics of one ingress app, in a registry of its own (never the process-global
one): several apps in one process, or tests, do not collide.

Request side (measured here): HTTP answers by route template and status, requests and tokens
per tenant, time to first token, time between tokens, end-to-end latency. Replica side (each
replica's `stats()`, which the /metrics route asks of the backend at scrape time and hands to
`set_replicas`): unified-pool pages by kind, adapters per tier, adapter-cache hits, misses,
loads and evictions, requests waiting and running, preemptions, per replica. Router side
(read at scrape time from `routing`, when given): each adapter's request rate and homes as
the affinity router sees them, for the top adapters by rate only, the rest summed under
adapter="other", so the label set stays bounded however many adapters there are; and (from
`placements`) the adapter requests it routed by the affinity and tier of the replica each
went to (tier="store": sent where the adapter had to be read from the artifact store).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from loraplex.router.policy import AdapterHomes, Placement

# What `IngressMetrics(routing=...)` calls: the top adapters and the rest, or None.
RoutingSource = Callable[[], "tuple[list[AdapterHomes], AdapterHomes] | None"]
# What `IngressMetrics(placements=...)` calls: adapter requests routed, by placement.
PlacementSource = Callable[[], "Mapping[Placement, int]"]

ANONYMOUS = "anonymous"  # tenant label of requests served without a registry

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
_POOL_PAGE_KINDS = ("free", "kv", "adapter", "cached", "pinned")
_CACHE_EVENTS = {"hits": "hit", "misses": "miss", "loads": "load", "evictions": "eviction"}


class IngressMetrics:
    def __init__(
        self, routing: RoutingSource | None = None, placements: PlacementSource | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "loraplex_http_requests",
            "HTTP requests answered, by route template, method and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "loraplex_tenant_requests",
            "Generation requests sent to a replica, by tenant.",
            ["tenant"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "loraplex_prompt_tokens",
            "Prompt tokens of generation requests.",
            ["tenant"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "loraplex_completion_tokens", "Tokens generated.", ["tenant"], registry=r
        )
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds",
            "From the request's arrival at the ingress to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tbt = Histogram(
            "loraplex_time_between_tokens_seconds",
            "Gap between consecutive generated tokens of one request.",
            buckets=_TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "loraplex_request_latency_seconds",
            "From the request's arrival at the ingress to its last token (or its abort).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._replicas = _ReplicaStats()
        r.register(self._replicas)
        if routing is not None:
            r.register(_AdapterHomes(routing))
        if placements is not None:
            r.register(_Placements(placements))

    def set_replicas(self, stats: Mapping[str, Mapping], resumed: int = 0) -> None:
        """Show these replicas' stats (`Backend.replica_stats()`: replica id -> the engine's
        `stats()` plus `tiers`) until the next call; a replica not in `stats` is not shown.
        `resumed`: the backend's count of streams resumed after their replica died."""
        self._replicas.latest = dict(stats)
        self._replicas.resumed = resumed

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Time to first token, time between tokens, end-to-end latency and generated tokens of
    one request, from the chunks the ingress receives."""

    def __init__(self, metrics: IngressMetrics, tenant: str, arrival: float) -> None:
        self.metrics, self.tenant, self.arrival = metrics, tenant, arrival
        self.last_token_at: float | None = None
        self.completion_tokens = 0
        self._done = False

    def saw(self, new_tokens: int, completion_tokens: int) -> None:
        self.completion_tokens = completion_tokens
        if not new_tokens:
            return
        now = time.monotonic()
        if self.last_token_at is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:  # a chunk may carry several tokens: spread its gap over them
            for _ in range(new_tokens):
                self.metrics.tbt.observe((now - self.last_token_at) / new_tokens)
        self.last_token_at = now

    def done(self) -> None:
        """The request ended (finished, failed or aborted); later calls do nothing."""
        if self._done:
            return
        self._done = True
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.completion_tokens.labels(self.tenant).inc(self.completion_tokens)


class _ReplicaStats(Collector):
    """Exposes the replicas' stats given last, at scrape time. The engine's cache and
    preemption counts are cumulative, so they are exported as counters."""

    def __init__(self) -> None:
        self.latest: dict[str, Mapping] = {}
        self.resumed = 0

    def collect(self) -> Iterator[Metric]:
        reporting = GaugeMetricFamily(
            "loraplex_replicas_reporting", "Replicas whose stats this scrape shows."
        )
        pages = GaugeMetricFamily(
            "loraplex_pool_pages",
            "Unified-pool pages by use (free + kv + adapter + cached = total; cached: idle "
            "prefix-cache blocks; pinned: adapter pages "
            "a running request holds).",
            labels=["replica", "kind"],
        )
        adapters = GaugeMetricFamily(
            "loraplex_replica_adapters",
            "Adapters per tier: device (in the pool), host (in host memory only), loading.",
            labels=["replica", "tier"],
        )
        cache = CounterMetricFamily(
            "loraplex_adapter_cache_events",
            "Adapter-cache lookups and loads (device tier).",
            labels=["replica", "event"],
        )
        queue = GaugeMetricFamily(
            "loraplex_replica_requests",
            "Requests in a replica's engine.",
            labels=["replica", "state"],
        )
        preemptions = CounterMetricFamily(
            "loraplex_replica_preemptions",
            "Requests preempted (their KV freed, to be recomputed) for want of KV pages.",
            labels=["replica"],
        )
        steps = CounterMetricFamily(
            "loraplex_engine_steps",
            "Forward passes a replica's engine ran (a step with no request is not one).",
            labels=["replica"],
        )
        busy = CounterMetricFamily(
            "loraplex_engine_step_seconds",
            "Seconds a replica's engine spent in its forward passes: its rate is the share of "
            "the time the engine is busy, and that over the steps' rate is the mean step.",
            labels=["replica"],
        )
        resumes = CounterMetricFamily(
            "loraplex_stream_resumes",
            "Streams this ingress resumed on another replica after theirs died mid-stream.",
        )
        resumes.add_metric([], self.resumed)
        reporting.add_metric([], len(self.latest))
        for replica, stats in sorted(self.latest.items()):
            pool = stats["pool"]
            for kind in _POOL_PAGE_KINDS:
                pages.add_metric([replica, kind], pool[f"{kind}_pages"])
            pages.add_metric([replica, "total"], pool["num_pages"])
            for tier, ids in stats["tiers"].items():
                adapters.add_metric([replica, tier], len(ids))
            for field, event in _CACHE_EVENTS.items():
                cache.add_metric([replica, event], stats["adapters"][field])
            for state in ("waiting", "running"):
                queue.add_metric([replica, state], stats[state])
            preemptions.add_metric([replica], stats["preemptions"])
            steps.add_metric([replica], stats["steps"])
            busy.add_metric([replica], stats["step_seconds"])
        yield from (reporting, resumes, pages, adapters, cache, queue, preemptions, steps, busy)


class _AdapterHomes(Collector):
    """Each top adapter's request rate and homes, from the router at scrape time."""

    def __init__(self, routing: RoutingSource) -> None:
        self.routing = routing

    def collect(self) -> Iterator[Metric]:
        rate = GaugeMetricFamily(
            "loraplex_adapter_request_rate",
            "Requests/s of an adapter as the router estimates it (top adapters; the rest "
            'summed as adapter="other").',
            labels=["adapter"],
        )
        count = GaugeMetricFamily(
            "loraplex_adapter_homes",
            'Replicas an adapter is routed to (for "other": replicas any of the rest is on).',
            labels=["adapter"],
        )
        home = GaugeMetricFamily(
            "loraplex_adapter_home",
            "1 for each replica that is a home of a top adapter.",
            labels=["adapter", "replica"],
        )
        snapshot = self.routing()
        if snapshot is not None:
            top, other = snapshot
            for entry in [*top, other]:
                rate.add_metric([entry.adapter], entry.rate_per_s)
                count.add_metric([entry.adapter], len(entry.homes))
            for entry in top:
                for replica in entry.homes:
                    home.add_metric([entry.adapter, replica], 1)
        yield from (rate, count, home)


class _Placements(Collector):
    """The router's adapter requests by where it sent them, at scrape time."""

    def __init__(self, placements: PlacementSource) -> None:
        self.placements = placements

    def collect(self) -> Iterator[Metric]:
        routed = CounterMetricFamily(
            "loraplex_router_placements",
            "Adapter requests the affinity router sent, by the replica's affinity as it judged "
            "it and the tier the replica held the adapter in (store: held nowhere, read from "
            "the artifact store).",
            labels=["affinity", "tier"],
        )
        for placement, n in sorted(self.placements().items()):
            routed.add_metric([placement.affinity.name.lower(), placement.tier], n)
        yield routed


CLIENT_CLOSED_REQUEST = 499


class HTTPMetricsMiddleware:
    """Counts every answered HTTP request by route template (`other` for unmatched paths,
    so scanners cannot blow up the label set), method and status. A request whose client
    left before any answer is counted as 499 (nginx's "client closed request"), not 500: a
    tenant who gives up on its own stalled uploads must not fire the operator's 5xx
    alerts."""

    def __init__(self, app: ASGIApp, metrics: IngressMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        except (asyncio.CancelledError, ClientDisconnect):
            if status is None:
                status = CLIENT_CLOSED_REQUEST
            raise
        finally:
            route = scope.get("route")
            template = route.path if isinstance(route, Route | Mount) else "other"
            answered = 500 if status is None else status
            self.metrics.http_requests.labels(template, scope["method"], str(answered)).inc()
