"""What the ingress's handlers use: `IngressContext`, at `app.state.ingress`, and the FastAPI
dependencies that read it (`Ingress`) or read it and authenticate the caller (`Caller`)."""

# No `from __future__ import annotations`: FastAPI resolves the dependencies' annotations.
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from loraplex.json_process import JsonProcess
from loraplex.registry.api import RegistryAPISettings
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.auth import Authenticator
from loraplex.registry.models import TenantLimits
from loraplex.registry.store import RegistryStore
from loraplex.registry.view import RegistryView, registry_view
from loraplex.registry.watch import RegistryWatcher
from loraplex.replica.protocol import Backend
from loraplex.replica.tokenizer import Tokenizer
from loraplex.router.limits import IngressLimits
from loraplex.router.metrics import IngressMetrics
from loraplex.router.tenant_limiter import TenantLimiter


@dataclass(frozen=True, slots=True)
class RegistryHandles:
    """The registry objects the ingress reads and its tenant API writes. The app owns their
    lifecycle: it starts the watcher at startup and stops watcher and store at shutdown, so
    pass them unstarted (etcd clients belong to the event loop that serves the app)."""

    store: RegistryStore
    watcher: RegistryWatcher | None  # None: every lookup reads etcd
    artifacts: ArtifactStore
    settings: RegistryAPISettings
    # what the ingress reads: the watcher's snapshot, or etcd without a watcher
    view: RegistryView = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "view", registry_view(self.watcher, self.store))


@dataclass(frozen=True, slots=True)
class IngressContext:
    """backend        where generation requests go
    tokenizer      the base model's (prompts and chat templates)
    base_model_id  the `model` that names the base model; it shadows an adapter so named
    registry       None: anyone may use the base model (no key), there are no adapters
    auth           the registry's key check (None without a registry)
    limits         caps on bodies and prompts, and the tenants' default limits
    limiter        each tenant's requests in flight and token bucket at this ingress
    metrics_keys   sha256 digests of the keys /metrics accepts (empty: /metrics is open)
    started        creation time of the model cards (Unix seconds)
    json_parser    where large bodies are parsed: a child process, arrays capped at the
                   context window (or the messages' limit, if larger)"""

    backend: Backend
    tokenizer: Tokenizer
    base_model_id: str
    max_model_len: int
    registry: RegistryHandles | None
    auth: Authenticator | None
    metrics: IngressMetrics
    started: int
    limits: IngressLimits
    limiter: TenantLimiter
    metrics_keys: frozenset[str]
    json_parser: JsonProcess


async def ingress_context(request: Request) -> IngressContext:
    # async: FastAPI runs a plain `def` dependency on a worker thread, a hop per request
    return request.app.state.ingress


Ingress = Annotated[IngressContext, Depends(ingress_context)]


@dataclass(frozen=True, slots=True)
class Call:
    """An authenticated inference call: the ingress, and the caller's tenant and its record's
    limits (None when serving without a registry)."""

    ingress: IngressContext
    tenant: str | None
    limits: TenantLimits | None = None


async def authenticate(request: Request) -> Call:
    """The caller, from the Authorization header alone; raises the registry's
    Unauthenticated or Forbidden."""
    ingress: IngressContext = request.app.state.ingress
    if ingress.auth is None:
        return Call(ingress, None)
    tenant = await ingress.auth.require_tenant(request.headers.get("authorization"))
    return Call(ingress, tenant.name, tenant.limits)


async def authenticated(request: Request) -> Call:
    """The caller that `OpenAIRoute` authenticated before the body was read (or, on a route
    without that check, authenticated now). One dependency for both kinds of refusal (each
    dependency costs every request a resolution)."""
    call = getattr(request.state, "call", None)
    return call if call is not None else await authenticate(request)


Caller = Annotated[Call, Depends(authenticated)]
