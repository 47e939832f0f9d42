"""What the ingress's handlers use: `IngressContext`, at `app.state.ingress`, and the FastAPI
dependencies that read it (`Ingress`) or read it and authenticate the caller (`Caller`)."""

# No `from __future__ import annotations`: FastAPI resolves the dependencies' annotations.
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from loraplex.registry.api import RegistryAPISettings
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.auth import Authenticator
from loraplex.registry.store import RegistryStore
from loraplex.registry.watch import RegistryWatcher
from loraplex.replica.protocol import Backend
from loraplex.replica.tokenizer import Tokenizer
from loraplex.router.metrics import IngressMetrics


@dataclass(frozen=True, slots=True)
class RegistryHandles:
    """The registry objects the ingress reads and its tenant API writes. The app owns their
    lifecycle: it starts the watcher at startup and stops watcher and store at shutdown, so
    pass them unstarted (etcd clients belong to the event loop that serves the app)."""

    store: RegistryStore
    watcher: RegistryWatcher | None  # None: every lookup reads etcd
    artifacts: ArtifactStore
    settings: RegistryAPISettings


@dataclass(frozen=True, slots=True)
class IngressContext:
    """backend        where generation requests go
    tokenizer      the base model's (prompts and chat templates)
    base_model_id  the `model` that names the base model; it shadows an adapter so named
    registry       None: anyone may use the base model (no key), there are no adapters
    auth           the registry's key check (None without a registry)
    started        creation time of the model cards (Unix seconds)"""

    backend: Backend
    tokenizer: Tokenizer
    base_model_id: str
    max_model_len: int
    registry: RegistryHandles | None
    auth: Authenticator | None
    metrics: IngressMetrics
    started: int


async def ingress_context(request: Request) -> IngressContext:
    # async: FastAPI runs a plain `def` dependency on a worker thread, a hop per request
    return request.app.state.ingress


Ingress = Annotated[IngressContext, Depends(ingress_context)]


@dataclass(frozen=True, slots=True)
class Call:
    """An authenticated inference call: the ingress, and the caller's tenant (None when
    serving without a registry)."""

    ingress: IngressContext
    tenant: str | None


async def authenticated(request: Request) -> Call:
    """Raises the registry's Unauthenticated or Forbidden. One dependency for both (each
    dependency costs every request a resolution)."""
    ingress: IngressContext = request.app.state.ingress
    if ingress.auth is None:
        return Call(ingress, None)
    tenant = await ingress.auth.require_tenant(request.headers.get("authorization"))
    return Call(ingress, tenant.name)


Caller = Annotated[Call, Depends(authenticated)]
