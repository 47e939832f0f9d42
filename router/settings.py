"""The router's settings: the YAML config's `router:` section.

The affinity policy's own settings are `AffinityConfig`'s (router/policy.py, each declared
there once); this adds how replicas publish the stats it routes on and the ingress's wait
for a first token. `affinity_kwargs` is what the Ray request router is given
(`request_router_kwargs`).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from pydantic import Field
from pydantic.dataclasses import dataclass

from loraplex.router.policy import AffinityConfig
from loraplex.settings import FORBID_EXTRA


@dataclass(frozen=True, slots=True, config=FORBID_EXTRA)
class RouterSettings(AffinityConfig):
    """The adapter-affinity request router (router/policy.py AffinityConfig), how often
    replicas publish the stats it routes on, the ingress's first-token deadline and how many
    adapters /metrics shows one by one."""

    stats_period_s: float = Field(
        1.0, gt=0, le=600, description="How often each replica publishes its routing stats."
    )
    stats_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Deadline of one routing-stats call."
    )
    metrics_top_adapters: int = Field(
        20,
        ge=0,
        le=1000,
        description="Adapters shown one by one in /metrics and `loraplex status` (the "
        "busiest); the rest are summed as one.",
    )
    first_chunk_timeout_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="Longest wait for a request's first token (queueing, routing, adapter "
        "load); past it the client gets 503 instead of waiting on a cluster with no replica.",
    )

    def affinity_kwargs(self) -> dict[str, Any]:
        """AffinityConfig's fields: the router's `request_router_kwargs`."""
        return {f.name: getattr(self, f.name) for f in fields(AffinityConfig)}
