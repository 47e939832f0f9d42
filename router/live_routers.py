"""The affinity routers alive in this process, for `/metrics` and `loraplex status`.

Ray Serve pickles a request router's class by value (ray/serve/config.py,
`RequestRouterConfig._serialize_request_router_cls` registers the class's module with
`cloudpickle.register_pickle_by_value`), so the class a deployment handle instantiates
carries its own copy of router/request_router.py's globals: a registry kept there would be
empty in the ingress code that reads it. This module is imported by reference, so every
router of the process registers in the one set below.
"""

from __future__ import annotations

import collections
import weakref
from typing import Protocol

from loraplex.router.policy import AdapterHomes, AffinityPolicy, Placement


class HasPolicy(Protocol):
    policy: AffinityPolicy


_ROUTERS: weakref.WeakSet[HasPolicy] = weakref.WeakSet()


def add(router: HasPolicy) -> None:
    """Count `router` (an `AffinityRequestRouter`) until it is garbage."""
    _ROUTERS.add(router)


def routing_snapshot(top_n: int) -> tuple[list[AdapterHomes], AdapterHomes] | None:
    """The `top_n` adapters by request rate over the affinity routers of this process, each
    with its homes, and the rest as one "other" entry; None while no router exists."""
    routers = list(_ROUTERS)
    if not routers:
        return None
    rates: dict[str, float] = {}
    homes: dict[str, set[str]] = {}
    for router in routers:
        top, other = router.policy.snapshot(top_n)
        for entry in [*top, other]:
            rates[entry.adapter] = rates.get(entry.adapter, 0.0) + entry.rate_per_s
            homes.setdefault(entry.adapter, set()).update(entry.homes)
    ranked = sorted((a for a in rates if a != "other"), key=rates.__getitem__, reverse=True)
    merged = [AdapterHomes(a, rates[a], tuple(sorted(homes[a]))) for a in ranked]
    rest = merged[top_n:]
    other = AdapterHomes(
        "other",
        rates.get("other", 0.0) + sum(e.rate_per_s for e in rest),
        tuple(sorted(homes.get("other", set()).union(*(e.homes for e in rest)))),
    )
    return merged[:top_n], other


def placement_counts() -> dict[Placement, int]:
    """Adapter requests the affinity routers of this process routed, by the `Placement` of
    the replica each went to (`AffinityPolicy.placement_counts`), summed over the routers."""
    total: collections.Counter[Placement] = collections.Counter()
    for router in list(_ROUTERS):
        total.update(router.policy.placement_counts())
    return dict(total)
