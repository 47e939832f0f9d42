"""The tenant API: admins create tenants and issue keys; tenants register, list, get and delete
their own adapters, register new versions under a name, roll back and run canaries (plus
vLLM's load/unload aliases). Three module-level routers (`tenants`,
`adapters`, `vllm`) whose handlers take the API's collaborators from `app.state.tenant_api`
(`TenantAPI`); `mount` installs them into an app (the ingress, or `create_app` to run the API
alone).

Status codes: 201 created; 400 unreadable input; 401 no or unknown key; 403 wrong kind of key
(a tenant key on an admin route, or the reverse); 404 unknown name, including another
tenant's adapter (names never leak across tenants); 409 name taken, or "quota of N adapters
reached" (409, not 429: retrying does not help until an adapter is deleted); 413 over a size
limit; 415 neither multipart nor JSON; 422 an adapter the server does not accept (rank,
targets, shapes, dtype, options) or a malformed request body; 429 the tenant's upload
slots are all in flight; 503 etcd unreachable on a write, or the staging budget in use. The service raises domain errors (common/errors.py); `api_errors.py` maps them. A
refusal leaves etcd and the artifact root as they were.
"""

# No `from __future__ import annotations`: FastAPI resolves the handlers' annotations, and
# the Annotated dependencies must be objects, not strings.
import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Request, Response, Security
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ConfigDict, Field, SecretStr

from loraplex.adapter_format import AdapterLimits, shown
from loraplex.checkpoint_shape import ModelShape
from loraplex.errors import Unacceptable
from loraplex.registry import paths, uploads
from loraplex.registry.admission import UploadAdmission
from loraplex.registry.api_errors import RegistryRoute, responses
from loraplex.registry.api_schemas import (
    REGISTRATION_BODY,
    REPLACEMENT_BODY,
    AdapterDetail,
    AdapterList,
    CanaryRequest,
    KeyRequest,
    LoadLoRAAdapterRequest,
    RegisterByPath,
    ReplaceByPath,
    RollbackRequest,
    TenantCreate,
    TenantDeleted,
    TenantList,
    TenantView,
    TenantWithKey,
    UnloadLoRAAdapterRequest,
    VersionList,
)
from loraplex.registry.archives import ArchiveLimits
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.auth import Authenticator, Grant
from loraplex.registry.isolation import run_isolated
from loraplex.registry.models import (
    DIGEST_PATTERN,
    Adapter,
    AdapterVersion,
    Canary,
    Tenant,
    TenantLimits,
)
from loraplex.registry.request_body import BodyTimeouts, read_capped
from loraplex.registry.service import RegistryService, collect_garbage_every
from loraplex.registry.settings import RegistrySettings
from loraplex.registry.store import EtcdSettings, RegistryStore
from loraplex.registry.watch import RegistryWatcher

__all__ = ["RegistryAPISettings", "TenantAPI", "collecting_garbage", "create_app", "mount"]

log = logging.getLogger(__name__)


class RegistryAPISettings(RegistrySettings, AdapterLimits):
    """Operator settings of the tenant API: the limits (registry/settings.py), the admin key
    and the base model adapters are checked against."""

    model_config = ConfigDict(extra="forbid")

    admin_key: SecretStr = Field(
        min_length=16,
        description="Bearer token of the administrator (creates tenants, issues keys).",
    )
    base_model_id: str = Field(
        min_length=1, description="Id of the served base model, written into every record."
    )
    base_model: ModelShape = Field(
        description="Dimensions of the base model that adapter tensor shapes are checked against."
    )
    max_archive_members: int = Field(
        8, ge=2, le=1024, description="Most tar entries read from an uploaded archive."
    )
    staging_dir: str | None = Field(
        None,
        description="Where uploads are staged and validated before they are stored; the "
        "system temp folder if unset. Never inside the artifact root.",
    )
    visibility_timeout_s: float = Field(
        5.0,
        ge=0,
        le=60,
        description="How long a write waits for the local watcher to show it, so a read "
        "after a write on the same ingress sees it.",
    )


@dataclass(frozen=True, slots=True)
class TenantAPI:
    """What the tenant API's handlers use, at `app.state.tenant_api` (set by `mount`)."""

    service: RegistryService
    auth: Authenticator
    settings: RegistryAPISettings
    archive_limits: ArchiveLimits
    admission: UploadAdmission

    @classmethod
    def of(
        cls,
        store: RegistryStore,
        watcher: RegistryWatcher | None,
        artifacts: ArtifactStore,
        settings: RegistryAPISettings,
    ) -> "TenantAPI":
        return cls(
            service=RegistryService(store, watcher, artifacts, settings),
            auth=Authenticator(settings.admin_key.get_secret_value(), store, watcher),
            settings=settings,
            archive_limits=ArchiveLimits(settings.max_archive_members, settings.max_adapter_bytes),
            admission=UploadAdmission(
                settings.max_uploads_per_tenant,
                settings.staging_max_bytes,
                settings.staging_tenant_share,
                watcher,
            ),
        )


async def tenant_api(request: Request) -> TenantAPI:
    # async: FastAPI runs a plain `def` dependency on a worker thread, a hop per request
    return request.app.state.tenant_api


API = Annotated[TenantAPI, Depends(tenant_api)]
# Declares the scheme in OpenAPI; the Authenticator reads the header itself.
Bearer = Annotated[
    HTTPAuthorizationCredentials | None,
    Security(HTTPBearer(auto_error=False, description="The admin key or a tenant API key.")),
]


async def require_admin(request: Request, api: API, _: Bearer) -> None:
    await api.auth.require_admin(request.headers.get("authorization"))


async def require_tenant(request: Request, api: API, _: Bearer) -> Tenant:
    return await api.auth.require_tenant(request.headers.get("authorization"))


async def require_grant(request: Request, api: API, _: Bearer) -> Grant:
    return await api.auth.require_grant(request.headers.get("authorization"))


Owner = Annotated[Tenant, Depends(require_tenant)]
# An upload commits only while the key it began with still holds (registry/service.py).
Granted = Annotated[Grant, Depends(require_grant)]


class TenantAPIRoute(RegistryRoute):
    """Every route of the tenant API needs a key: a caller without a valid one gets 401 before
    anything of its body is read, and a declared (JSON) body is then read under
    MAX_JSON_BYTES. The route's own dependencies check the kind of key (403)."""

    async def admit(self, request: Request) -> None:
        api: TenantAPI = request.app.state.tenant_api
        await api.auth.require_key(request.headers.get("authorization"))
        if self.body_field is not None:
            await read_capped(
                request,
                uploads.MAX_JSON_BYTES,
                "JSON bodies of the tenant API",
                body_timeouts(api.settings),
            )


# ---------------------------------------------------------------- tenants (admin)

tenants = APIRouter(
    route_class=TenantAPIRoute, tags=["tenants (admin)"], dependencies=[Depends(require_admin)]
)


@tenants.post(
    "/v1/tenants", status_code=201, responses=responses(400, 401, 403, 405, 409, 413, 503)
)
async def create_tenant(body: TenantCreate, api: API) -> TenantWithKey:
    """Create a tenant and its first API key (shown only in this response)."""
    created, key = await api.service.create_tenant(body.name, body.adapter_quota, body.limits)
    return TenantWithKey(tenant=TenantView.of(created), api_key=key)


@tenants.get("/v1/tenants", responses=responses(401, 403, 405))
async def list_tenants(api: API) -> TenantList:
    return TenantList(tenants=[TenantView.of(t) for t in await api.service.tenants()])


@tenants.delete("/v1/tenants/{name}", responses=responses(401, 403, 404, 405, 503))
async def delete_tenant(name: str, api: API) -> TenantDeleted:
    """Delete a tenant and all its adapters (one etcd transaction)."""
    adapters = await api.service.delete_tenant(name)
    api.admission.revoke(name, None)  # its uploads in flight here (elsewhere: the watchers)
    return TenantDeleted(name=name, adapters_deleted=[r.name for r in adapters])


@tenants.put(
    "/v1/tenants/{name}/limits", responses=responses(400, 401, 403, 404, 405, 409, 413, 503)
)
async def set_tenant_limits(name: str, body: TenantLimits, api: API) -> TenantView:
    """Replace a tenant's limits (requests in flight, tokens per minute; null: the
    operator's default). Every ingress applies them once its watcher sees the change."""
    return TenantView.of(await api.service.set_limits(name, body))


@tenants.post(
    "/v1/tenants/{name}/keys",
    status_code=201,
    responses=responses(400, 401, 403, 404, 405, 413, 503),
)
async def issue_key(name: str, api: API, body: KeyRequest | None = None) -> TenantWithKey:
    """Issue another API key (shown only in this response), optionally revoking the others."""
    updated, key = await api.service.issue_key(name, (body or KeyRequest()).revoke_existing)
    api.admission.revoke(name, updated)  # uploads in flight here under a revoked key
    return TenantWithKey(tenant=TenantView.of(updated), api_key=key)


# ---------------------------------------------------------------- a tenant's adapters

adapters = APIRouter(route_class=TenantAPIRoute, tags=["adapters"])


@adapters.post(
    "/v1/adapters",
    status_code=201,
    openapi_extra=REGISTRATION_BODY,
    responses=responses(400, 401, 403, 405, 409, 413, 415, 422, 429, 503),
)
async def register_adapter(request: Request, grant: Granted, api: API) -> Adapter:
    """Register a PEFT LoRA adapter: a multipart upload (files `adapter_config` and
    `adapter_model`, or one `archive` tar.gz) or JSON `{name, path}` naming a folder under
    an allowed root. Everything is validated before anything is written."""
    async with _received(request, grant, api, None) as (name, pinned, staged):
        return await api.service.register(grant, name, bool(pinned), staged)


@adapters.put(
    "/v1/adapters/{name}",
    openapi_extra=REPLACEMENT_BODY,
    responses={
        **responses(400, 401, 403, 405, 409, 413, 415, 422, 429, 503),
        201: {"model": Adapter, "description": "A new name, at its first version."},
    },
)
async def put_adapter(
    name: str, request: Request, response: Response, grant: Granted, api: API
) -> Adapter:
    """Register new content under `name` (bodies as for `POST /v1/adapters`; `name` in the
    body, if sent, must be this one): a new version that the alias moves to in one etcd
    transaction (200), or the name itself if it is new (201). Requests already resolved
    finish on the version they began with; content equal to a retained version moves the
    alias back to it, and the current content changes nothing. Ends any canary."""
    uploads.check_name(name)
    async with _received(request, grant, api, name) as (_, pinned, staged):
        record, created = await api.service.put(grant, name, pinned, staged)
    response.status_code = 201 if created else 200
    return record


@asynccontextmanager
async def _received(
    request: Request, grant: Grant, api: TenantAPI, path_name: str | None
) -> AsyncIterator[tuple[str, bool | None, FilePath]]:
    """The registration body staged as a PEFT folder: (name, pinned or None if unsent,
    folder), under the tenant's upload slot and the staging budget, cancelled (401) if the
    grant is revoked before the folder is handed over to be committed. `path_name`: the
    name the route's path gives (a body may repeat it), None when the body must name it."""
    owner = grant.tenant
    settings = api.settings
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in ("multipart/form-data", "application/json"):
        raise HTTPException(
            415, "send multipart/form-data (an upload) or application/json ({name, path})"
        )
    with api.admission.admit(grant) as staging_bytes:
        async with uploads.staging(settings.staging_dir) as work:
            staged = work / "adapter"
            pinned: bool | None
            path: str | None = None  # registration by path
            if content_type == "multipart/form-data":
                form = await uploads.receive_multipart(
                    request,
                    work,
                    settings.max_upload_bytes,
                    staging_bytes,
                    body_timeouts(settings),
                )
                if path_name is None or "name" in form.fields:
                    name = uploads.form_name(form)
                else:
                    name = path_name
                pinned = uploads.form_optional_bool(form, "pinned")
                if "archive" in form.files:
                    staging_bytes.take(settings.max_adapter_bytes)
                await run_isolated(
                    settings.work_limits(),
                    uploads.assemble_upload,
                    form.files,
                    form.filenames,
                    staged,
                    api.archive_limits,
                )
            elif path_name is None:
                body = await uploads.read_json(request, RegisterByPath, body_timeouts(settings))
                name, pinned, path = body.name, body.pinned, body.path
            else:
                replacement = await uploads.read_json(
                    request, ReplaceByPath, body_timeouts(settings)
                )
                name, pinned, path = path_name, replacement.pinned, replacement.path
            if path_name is not None and name != path_name:
                raise Unacceptable(
                    f"the body names adapter {shown(name)}, the path {shown(path_name)}; "
                    "send one name"
                )
            if path is not None:
                staging_bytes.take(settings.max_adapter_bytes)
                await _copy_from_path(api, path, owner.name, staged)
            staging_bytes.commit()
            yield name, pinned, staged


@adapters.get("/v1/adapters", responses=responses(401, 403, 405))
async def list_adapters(owner: Owner, api: API) -> AdapterList:
    """The caller's adapters, sorted by name."""
    return AdapterList(adapters=await api.service.adapters(owner.name))


@adapters.get("/v1/adapters/{name}", responses=responses(401, 403, 404, 405))
async def get_adapter(name: str, owner: Owner, api: API) -> AdapterDetail:
    """The adapter: the version it serves (its fields), any canary, and its retained
    versions, newest first."""
    record = await api.service.adapter(owner.name, name)
    return AdapterDetail.listing(record, await api.service.versions(owner.name, name))


@adapters.delete("/v1/adapters/{name}", responses=responses(401, 403, 404, 405, 503))
async def delete_adapter(name: str, owner: Owner, api: API) -> Adapter:
    """Delete one of the caller's adapters; returns the record as it was."""
    return await api.service.delete(owner.name, name)


# ---------------------------------------------------------------- versions of one name

Version = Annotated[
    str,
    Path(pattern=DIGEST_PATTERN, description="A version: 64 lowercase hex digits (sha256)."),
]


@adapters.get("/v1/adapters/{name}/versions", responses=responses(401, 403, 404, 405))
async def list_versions(name: str, owner: Owner, api: API) -> VersionList:
    return VersionList(versions=await api.service.versions(owner.name, name))


@adapters.get(
    "/v1/adapters/{name}/versions/{version}", responses=responses(401, 403, 404, 405, 422)
)
async def get_version(name: str, version: Version, owner: Owner, api: API) -> AdapterVersion:
    return await api.service.version(owner.name, name, version)


@adapters.delete(
    "/v1/adapters/{name}/versions/{version}",
    responses=responses(401, 403, 404, 405, 409, 422, 503),
)
async def delete_version(name: str, version: Version, owner: Owner, api: API) -> AdapterVersion:
    """Delete a retained version; 409 for the version the name serves or its canary."""
    return await api.service.delete_version(owner.name, name, version)


@adapters.post(
    "/v1/adapters/{name}/rollback",
    responses=responses(400, 401, 403, 404, 405, 409, 413, 422, 503),
)
async def rollback(
    name: str, owner: Owner, api: API, body: RollbackRequest | None = None
) -> Adapter:
    """Move the alias to a retained version (by default the one registered before the
    current one), in one etcd transaction; ends any canary. New requests get that version
    at once; requests in flight finish on theirs."""
    version = (body or RollbackRequest()).version
    return await api.service.rollback(owner.name, name, version)


@adapters.put(
    "/v1/adapters/{name}/canary", responses=responses(400, 401, 403, 404, 405, 409, 413, 422, 503)
)
async def set_canary(name: str, body: CanaryRequest, owner: Owner, api: API) -> Adapter:
    """Serve `weight` of the name's requests with another retained version. Which version a
    request gets depends only on its id, so it is the same on every ingress."""
    canary = Canary(version=body.version, weight=body.weight)
    return await api.service.set_canary(owner.name, name, canary)


@adapters.delete("/v1/adapters/{name}/canary", responses=responses(401, 403, 404, 405, 409, 503))
async def end_canary(name: str, owner: Owner, api: API) -> Adapter:
    """Serve every request with the current version again."""
    return await api.service.set_canary(owner.name, name, None)


# ---------------------------------------------------------------- vLLM's aliases

vllm = APIRouter(
    route_class=TenantAPIRoute,
    tags=["vLLM compatibility"],
    default_response_class=PlainTextResponse,
)


@vllm.post(
    "/v1/load_lora_adapter", responses=responses(400, 401, 403, 405, 409, 413, 422, 429, 503)
)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, grant: Granted, api: API) -> str:
    """vLLM's runtime loading, done as a registration by path: every replica gets it. With
    `load_inplace`, a taken name gets a new version (as `PUT /v1/adapters/{name}`)."""
    owner = grant.tenant
    with api.admission.admit(grant) as staging_bytes:
        async with uploads.staging(api.settings.staging_dir) as work:
            staged = work / "adapter"
            staging_bytes.take(api.settings.max_adapter_bytes)
            await _copy_from_path(api, body.lora_path, owner.name, staged)
            staging_bytes.commit()
            if body.load_inplace:
                await api.service.put(grant, body.lora_name, None, staged)
            else:
                await api.service.register(grant, body.lora_name, False, staged)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@vllm.post("/v1/unload_lora_adapter", responses=responses(400, 401, 403, 404, 405, 413, 503))
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, owner: Owner, api: API) -> str:
    await api.service.delete(owner.name, body.lora_name)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


async def _copy_from_path(api: TenantAPI, path: str, tenant: str, staged: os.PathLike[str]) -> None:
    settings = api.settings
    await run_isolated(
        settings.work_limits(),
        paths.copy_from_path,
        path,
        settings.allowed_roots,
        tenant,
        staged,
        settings.max_adapter_bytes,
    )


# ---------------------------------------------------------------- apps


def mount(
    app: FastAPI,
    store: RegistryStore,
    watcher: RegistryWatcher | None,
    artifacts: ArtifactStore,
    settings: RegistryAPISettings,
) -> None:
    """Serve the tenant API from `app`. The caller owns the lifecycle of store, watcher and
    artifacts. Staging folders that a killed process left are swept first."""
    swept = uploads.sweep_staging(settings.staging_dir)
    if swept:
        log.warning("removed %d staging folders of processes that no longer run", len(swept))
    app.state.tenant_api = TenantAPI.of(store, watcher, artifacts, settings)
    for router in (tenants, adapters, vllm):
        app.include_router(router)


def body_timeouts(settings: RegistryAPISettings) -> BodyTimeouts:
    return BodyTimeouts(settings.body_idle_timeout_s, settings.body_timeout_s)


@asynccontextmanager
async def collecting_garbage(
    store: RegistryStore, artifacts: ArtifactStore, settings: RegistryAPISettings
) -> AsyncIterator[None]:
    """Artifacts no record refers to are removed every `gc_interval_s` while inside (a
    version pruned or deleted while another registration of its bytes raced it, a
    registration whose transaction timed out)."""
    if settings.gc_interval_s == 0:
        yield
        return
    task = asyncio.create_task(
        collect_garbage_every(store, artifacts, settings.gc_interval_s, settings.gc_min_age_s),
        name="loraplex-artifact-gc",
    )
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def create_app(
    settings: RegistryAPISettings,
    etcd: EtcdSettings,
    artifact_root: str | os.PathLike[str],
    *,
    watch: bool = True,
) -> FastAPI:
    """The tenant API alone, with its own store, watcher (unless `watch` is False) and
    artifact store, started and stopped with the app."""
    store = RegistryStore(etcd)
    watcher = RegistryWatcher(etcd) if watch else None
    artifacts = ArtifactStore(artifact_root)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if watcher is not None:
            await watcher.start()
        try:
            async with collecting_garbage(store, artifacts, settings):
                yield
        finally:
            if watcher is not None:
                await watcher.stop()
            await store.close()

    app = FastAPI(
        title="loraplex tenant API",
        summary="Register LoRA adapters once; every replica serves them.",
        version="1",
        lifespan=lifespan,
    )
    mount(app, store, watcher, artifacts, settings)
    app.state.store, app.state.watcher, app.state.artifacts = store, watcher, artifacts
    return app
