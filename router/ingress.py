"""The HTTP ingress: one FastAPI app of OpenAI-compatible inference over any `Backend`
(router/inference.py), the registry's tenant API (registry/api.py), `/metrics` and
`/health` (router/operations.py). Each route module is a module-level router whose handlers
read their collaborators from `app.state` (router/context.py); this file assembles them.

A request ends in the backend as soon as its client is gone: closing the backend's stream
aborts it (for streams whatever way the response ends, for whole answers between chunks).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from loraplex.json_process import JsonProcess
from loraplex.registry import api as tenant_api
from loraplex.registry.auth import Authenticator, hash_api_key
from loraplex.replica.protocol import Backend
from loraplex.replica.tokenizer import Tokenizer
from loraplex.router import inference, operations
from loraplex.router.context import IngressContext, RegistryHandles
from loraplex.router.limits import IngressLimits
from loraplex.router.metrics import (
    HTTPMetricsMiddleware,
    IngressMetrics,
    PlacementSource,
    RoutingSource,
)
from loraplex.router.tenant_limiter import Ledger, TenantLimiter

__all__ = ["RegistryHandles", "build_ingress"]


def build_ingress(
    backend: Backend,
    tokenizer: Tokenizer,
    *,
    base_model_id: str,
    max_model_len: int,
    registry: RegistryHandles | None,
    routing: RoutingSource | None = None,
    placements: PlacementSource | None = None,
    limits: IngressLimits | None = None,
    metrics_key: str | None = None,
    ledger: Ledger | None = None,
) -> FastAPI:
    """The ingress app; `app.state.metrics` is its `IngressMetrics`. Without a registry,
    anyone may use the base model (no key needed) and there is no tenant API. An adapter
    named like the base model is shadowed by it. `routing`: the router's view of each
    adapter's rate and homes, and `placements` its requests by where it sent them, for
    /metrics. `/metrics` answers the bearer of `metrics_key` or of the admin key; with
    neither (no registry), anyone. `ledger`: the tenants' limits shared by every ingress of
    the cluster (None: this ingress alone)."""
    metrics = IngressMetrics(routing, placements)
    limits = limits or IngressLimits()
    auth = None
    metrics_keys = {hash_api_key(metrics_key)} if metrics_key else set()
    if registry is not None:
        admin_key = registry.settings.admin_key.get_secret_value()
        auth = Authenticator(admin_key, registry.store, registry.watcher)
        metrics_keys.add(hash_api_key(admin_key))
    app = FastAPI(
        title="loraplex",
        summary="OpenAI-compatible serving of one base model and many tenants' LoRA adapters.",
        version="1",
        lifespan=_lifespan,
    )
    app.state.ingress = IngressContext(
        backend=backend,
        tokenizer=tokenizer,
        base_model_id=base_model_id,
        max_model_len=max_model_len,
        registry=registry,
        auth=auth,
        metrics=metrics,
        started=int(time.time()),
        limits=limits,
        limiter=TenantLimiter(ledger, sync_s=limits.tenant_ledger_sync_s),
        metrics_keys=frozenset(metrics_keys),
        json_parser=JsonProcess(
            max(max_model_len, limits.max_messages),
            " (this model's context window, or limits.max_messages if larger)",
        ),
    )
    app.state.metrics = metrics
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    app.include_router(inference.router)
    if registry is not None:
        r = registry
        tenant_api.mount(app, r.store, r.watcher, r.artifacts, r.settings)
    app.include_router(operations.router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Starts the registry's watcher and the limiter's reports to the ledger; stops them
    and closes the store at shutdown."""
    ingress = app.state.ingress
    registry = ingress.registry
    watcher = registry.watcher if registry is not None else None
    if watcher is not None:
        await watcher.start()
    reports = asyncio.create_task(ingress.limiter.run(), name="tenant-ledger-reports")
    try:
        yield
    finally:
        reports.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reports
        await ingress.json_parser.close()
        if registry is not None:
            if watcher is not None:
                await watcher.stop()
            await registry.store.close()
