"""The tenant API: admins create tenants and issue keys; tenants register, list, get and delete
their own adapters (plus vLLM's load/unload aliases). A FastAPI router the ingress mounts, and
`create_app` to run it alone.

Status codes: 201 created; 400 unreadable input; 401 no or unknown key; 403 wrong kind of key
(a tenant key on an admin route, or the reverse); 404 unknown name, including another
tenant's adapter (names never leak across tenants); 409 name taken, or "quota of N adapters
reached" (409, not 429: retrying does not help until an adapter is deleted); 413 over a size
limit; 415 neither multipart nor JSON; 422 an adapter the server does not accept (rank,
targets, shapes, dtype, options) or a malformed request body; 503 etcd unreachable on a
write. A refusal leaves etcd and the artifact root as they were.
"""

# No `from __future__ import annotations`: the routes' Annotated dependencies are local names,
# which FastAPI could not resolve from strings.
import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response, Security
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from loraplex.registry import uploads
from loraplex.registry.archives import ArchiveLimits
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.auth import Authenticator
from loraplex.registry.models import NAME_PATTERN, AdapterRecord, Tenant
from loraplex.registry.service import RegistryService, resolve_adapter
from loraplex.registry.settings import AdapterLimits, RegistrySettings
from loraplex.registry.store import EtcdSettings, RegistryStore, RegistryUnavailable
from loraplex.registry.validation import CONFIG_FILE, WEIGHTS_FILE, AdapterRejected, BaseModelShape
from loraplex.registry.watch import RegistryWatcher

__all__ = ["RegistryAPISettings", "create_app", "resolve_adapter", "tenant_api"]


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
    base_model: BaseModelShape = Field(
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


# ---------------------------------------------------------------- request and response bodies


class TenantCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"name": "acme", "adapter_quota": 50}]}
    )

    name: str = Field(pattern=NAME_PATTERN, description="Tenant name (a-z 0-9 . _ -, max 63).")
    adapter_quota: int = Field(100, ge=0, le=1_000_000, description="Most adapters at once.")


class TenantView(BaseModel):
    name: str
    adapter_quota: int
    created_at: float
    api_keys: int = Field(description="Number of valid API keys (the keys are not stored).")

    @classmethod
    def of(cls, tenant: Tenant) -> "TenantView":
        return cls(
            name=tenant.name,
            adapter_quota=tenant.adapter_quota,
            created_at=tenant.created_at,
            api_keys=len(tenant.api_key_hashes),
        )


class TenantWithKey(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "tenant": {
                        "name": "acme",
                        "adapter_quota": 50,
                        "created_at": 1767225600.0,
                        "api_keys": 1,
                    },
                    "api_key": "lpx_q3V0nJ9tXc3l1cK8bqgk0m8mYQ0JQe3c1Vj9r0h2yGk",
                }
            ]
        }
    )

    tenant: TenantView
    api_key: str = Field(description="The new key. Shown once: only its sha256 is stored.")


class KeyRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"revoke_existing": True}]}
    )

    revoke_existing: bool = Field(False, description="Invalidate the tenant's other keys.")


class TenantList(BaseModel):
    tenants: list[TenantView]


class TenantDeleted(BaseModel):
    name: str
    adapters_deleted: list[str]


class RegisterByPath(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"name": "sql-helper", "path": "/mnt/adapters/sql-helper", "pinned": False}
            ]
        },
    )

    name: str = Field(pattern=NAME_PATTERN, description="Adapter name, unique per tenant.")
    path: str = Field(description="Absolute path of a PEFT adapter folder under an allowed root.")
    pinned: bool = Field(False, description="Keep resident on replicas even when cold.")


class AdapterList(BaseModel):
    adapters: list[AdapterRecord]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's request body; `load_inplace` (replace weights under a live name) is refused."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"lora_name": "sql-helper", "lora_path": "/mnt/adapters/sql-helper"}]
        }
    )

    lora_name: str = Field(pattern=NAME_PATTERN)
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"lora_name": "sql-helper"}]})

    lora_name: str
    lora_int_id: int | None = None


_REGISTRATION_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "pattern": NAME_PATTERN},
                        "pinned": {"type": "boolean", "default": False},
                        "adapter_config": {
                            "type": "string",
                            "format": "binary",
                            "description": CONFIG_FILE,
                        },
                        "adapter_model": {
                            "type": "string",
                            "format": "binary",
                            "description": WEIGHTS_FILE,
                        },
                        "archive": {
                            "type": "string",
                            "format": "binary",
                            "description": f"tar.gz of {CONFIG_FILE} and {WEIGHTS_FILE} (instead of the two files)",
                        },
                    },
                },
                "encoding": {"adapter_config": {"contentType": "application/json"}},
            },
            "application/json": {
                "schema": RegisterByPath.model_json_schema(),
                "examples": {
                    "by_path": {"value": {"name": "sql-helper", "path": "/mnt/adapters/sql-helper"}}
                },
            },
        },
    }
}

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {
        "description": "Unreadable input: bad JSON, corrupt safetensors header or archive, forbidden path."
    },
    401: {"description": "Missing or unknown API key."},
    403: {"description": "A key of the wrong kind for this route."},
    404: {
        "description": "No such tenant or adapter (another tenant's adapter is reported the same way)."
    },
    409: {"description": "Name taken, or the tenant's adapter quota is reached."},
    413: {"description": "Over a size limit (upload, adapter, header, archive)."},
    415: {"description": "Neither multipart/form-data nor application/json."},
    422: {
        "description": "Adapter not accepted: rank, targets, tensor names or shapes, dtype, options."
    },
    503: {"description": "etcd unreachable: the write was not made; retry."},
}


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: _ERRORS[code] for code in codes}


# ---------------------------------------------------------------- routes


class _RegistryRoute(APIRoute):
    """Maps the registry's own errors to responses, wherever the router is mounted."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except AdapterRejected as e:
                return JSONResponse({"detail": e.message}, status_code=e.status)
            except RegistryUnavailable as e:
                return JSONResponse(
                    {"detail": f"registry unavailable, nothing was changed; retry later ({e})"},
                    status_code=503,
                    headers={"Retry-After": "5"},
                )

        return handle


def tenant_api(
    store: RegistryStore,
    watcher: RegistryWatcher | None,
    artifacts: ArtifactStore,
    settings: RegistryAPISettings,
) -> APIRouter:
    """The tenant API routes. The caller owns the lifecycle of store, watcher and artifacts."""
    registry = RegistryService(store, watcher, artifacts, settings)
    auth = Authenticator(settings.admin_key.get_secret_value(), store, watcher)
    # Declares the scheme in OpenAPI; the Authenticator reads the header itself.
    Bearer = Annotated[
        HTTPAuthorizationCredentials | None,
        Security(HTTPBearer(auto_error=False, description="The admin key or a tenant API key.")),
    ]
    archive_limits = ArchiveLimits(settings.max_archive_members, settings.max_adapter_bytes)

    async def admin(request: Request, _: Bearer) -> None:
        await auth.require_admin(request)

    async def tenant(request: Request, _: Bearer) -> Tenant:
        return await auth.require_tenant(request)

    Owner = Annotated[Tenant, Depends(tenant)]
    router = APIRouter(route_class=_RegistryRoute)
    admin_route: dict[str, Any] = {"dependencies": [Depends(admin)], "tags": ["tenants (admin)"]}

    @router.post(
        "/v1/tenants", status_code=201, responses=_responses(401, 403, 409, 503), **admin_route
    )
    async def create_tenant(body: TenantCreate) -> TenantWithKey:
        """Create a tenant and its first API key (shown only in this response)."""
        created, key = await registry.create_tenant(body.name, body.adapter_quota)
        return TenantWithKey(tenant=TenantView.of(created), api_key=key)

    @router.get("/v1/tenants", responses=_responses(401, 403), **admin_route)
    async def list_tenants() -> TenantList:
        return TenantList(tenants=[TenantView.of(t) for t in await registry.tenants()])

    @router.delete("/v1/tenants/{name}", responses=_responses(401, 403, 404, 503), **admin_route)
    async def delete_tenant(name: str) -> TenantDeleted:
        """Delete a tenant and all its adapters (one etcd transaction)."""
        adapters = await registry.delete_tenant(name)
        return TenantDeleted(name=name, adapters_deleted=[r.name for r in adapters])

    @router.post(
        "/v1/tenants/{name}/keys",
        status_code=201,
        responses=_responses(401, 403, 404, 503),
        **admin_route,
    )
    async def issue_key(name: str, body: KeyRequest | None = None) -> TenantWithKey:
        """Issue another API key (shown only in this response), optionally revoking the others."""
        updated, key = await registry.issue_key(name, (body or KeyRequest()).revoke_existing)
        return TenantWithKey(tenant=TenantView.of(updated), api_key=key)

    adapter_route: dict[str, Any] = {"tags": ["adapters"]}

    @router.post(
        "/v1/adapters",
        status_code=201,
        openapi_extra=_REGISTRATION_BODY,
        responses=_responses(400, 401, 403, 409, 413, 415, 422, 503),
        **adapter_route,
    )
    async def register_adapter(request: Request, owner: Owner) -> AdapterRecord:
        """Register a PEFT LoRA adapter: a multipart upload (files `adapter_config` and
        `adapter_model`, or one `archive` tar.gz) or JSON `{name, path}` naming a folder under
        an allowed root. Everything is validated before anything is written."""
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        async with uploads.staging(settings.staging_dir) as work:
            staged = work / "adapter"
            if content_type == "multipart/form-data":
                form = await uploads.receive_multipart(request, work, settings.max_upload_bytes)
                name, pinned = uploads.form_name(form), uploads.form_bool(form, "pinned")
                await asyncio.to_thread(uploads.assemble_upload, form, staged, archive_limits)
            elif content_type == "application/json":
                body = await uploads.read_json(request, RegisterByPath)
                name, pinned = body.name, body.pinned
                await _copy_from_path(body.path, staged)
            else:
                raise HTTPException(
                    415, "send multipart/form-data (an upload) or application/json ({name, path})"
                )
            return await registry.register(owner, name, pinned, staged)

    @router.get("/v1/adapters", responses=_responses(401, 403), **adapter_route)
    async def list_adapters(owner: Owner) -> AdapterList:
        """The caller's adapters, sorted by name."""
        return AdapterList(adapters=await registry.adapters(owner.name))

    @router.get("/v1/adapters/{name}", responses=_responses(401, 403, 404), **adapter_route)
    async def get_adapter(name: str, owner: Owner) -> AdapterRecord:
        return await registry.adapter(owner.name, name)

    @router.delete("/v1/adapters/{name}", responses=_responses(401, 403, 404, 503), **adapter_route)
    async def delete_adapter(name: str, owner: Owner) -> AdapterRecord:
        """Delete one of the caller's adapters; returns the record as it was."""
        return await registry.delete(owner.name, name)

    vllm_route: dict[str, Any] = {
        "tags": ["vLLM compatibility"],
        "response_class": PlainTextResponse,
    }

    @router.post(
        "/v1/load_lora_adapter",
        responses=_responses(400, 401, 403, 409, 413, 422, 503),
        **vllm_route,
    )
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, owner: Owner) -> str:
        """vLLM's runtime loading, done as a registration by path: every replica gets it."""
        if body.load_inplace:
            raise AdapterRejected(
                422, "load_inplace is not supported; unload the adapter, then load it again"
            )
        async with uploads.staging(settings.staging_dir) as work:
            staged = work / "adapter"
            await _copy_from_path(body.lora_path, staged)
            await registry.register(owner, body.lora_name, False, staged)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/v1/unload_lora_adapter", responses=_responses(401, 403, 404, 503), **vllm_route)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, owner: Owner) -> str:
        await registry.delete(owner.name, body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    async def _copy_from_path(path: str, staged: Path) -> None:
        await asyncio.to_thread(
            uploads.copy_from_path, path, settings.allowed_roots, staged, settings.max_adapter_bytes
        )

    return router


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
    app.include_router(tenant_api(store, watcher, artifacts, settings))
    app.state.store, app.state.watcher, app.state.artifacts = store, watcher, artifacts
    return app
