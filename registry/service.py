"""What the tenant API does to etcd and the artifact store: registration, deletion, tenants
and keys. Reads come from the watcher's snapshot when there is one, else from etcd.

Registration order: the staged adapter is validated, stored as an artifact (content-addressed,
atomic), then its record is created in one etcd transaction. A record is therefore only ever
written for a complete artifact; an artifact whose record was refused is released again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from loraplex.registry.artifacts import ArtifactStore, StoredArtifact
from loraplex.registry.auth import new_api_key, watched_tenants
from loraplex.registry.errors import (
    AlreadyExists,
    Conflict,
    NotFound,
    RegistryUnavailable,
    RevisionConflict,
    Unauthenticated,
)
from loraplex.registry.isolation import WorkLimits, run_isolated
from loraplex.registry.models import AdapterRecord, Tenant, TenantLimits
from loraplex.registry.store import RegistryStore
from loraplex.registry.validation import BaseModelShape, validate_adapter_dir
from loraplex.registry.watch import RegistryWatcher

_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_KEY_UPDATE_ATTEMPTS = 5


async def resolve_adapter(
    source: RegistryWatcher | RegistryStore, tenant: str, name: str
) -> AdapterRecord | None:
    """The adapter `name` of `tenant`, or None. Names are scoped by tenant: another tenant's
    adapter of the same name is never returned. Reads the watcher's snapshot (request paths)
    or etcd (tools)."""
    if isinstance(source, RegistryWatcher):
        return source.adapter(tenant, name)
    return await source.get_adapter(tenant, name)


class ServiceSettings(Protocol):
    """What the service reads of the tenant API's settings (`RegistryAPISettings`)."""

    @property
    def base_model_id(self) -> str: ...
    @property
    def base_model(self) -> BaseModelShape: ...
    @property
    def max_lora_rank(self) -> int: ...
    @property
    def max_adapter_bytes(self) -> int: ...
    @property
    def visibility_timeout_s(self) -> float: ...
    def work_limits(self) -> WorkLimits: ...


class RegistryService:
    """The tenant API's operations. Refusals are registry/errors.py's domain errors."""

    def __init__(
        self,
        store: RegistryStore,
        watcher: RegistryWatcher | None,
        artifacts: ArtifactStore,
        settings: ServiceSettings,
    ) -> None:
        self.store = store
        self.watcher = watcher
        self.artifacts = artifacts
        self.settings = settings

    # reads

    async def adapters(self, tenant: str) -> list[AdapterRecord]:
        if self.watcher is not None:
            return self.watcher.adapters(tenant)
        return await self.store.list_adapters(tenant)

    async def adapter(self, tenant: str, name: str) -> AdapterRecord:
        record = await resolve_adapter(self.watcher or self.store, tenant, name)
        if record is None:
            raise NotFound(f"adapter {name!r} not found")
        return record

    async def tenants(self) -> list[Tenant]:
        if self.watcher is not None:
            tenants = watched_tenants(self.watcher)
        else:
            tenants = await self.store.list_tenants()
        return sorted(tenants, key=lambda t: t.name)

    # adapters

    async def register(
        self, tenant: Tenant, name: str, pinned: bool, staged: Path
    ) -> AdapterRecord:
        """Register the adapter folder `staged` (outside the artifact root) as `name`."""
        if await self.store.get_adapter(tenant.name, name) is not None:
            raise Conflict(f"adapter {name!r} already exists")
        if len(await self.store.list_adapters(tenant.name)) >= tenant.adapter_quota:
            raise _quota_reached(tenant)
        settings = self.settings
        summary = await run_isolated(  # untrusted headers and JSON: off this process
            settings.work_limits(),
            validate_adapter_dir,
            staged,
            settings.base_model,
            settings.max_lora_rank,
            settings.max_adapter_bytes,
        )
        stored = await asyncio.to_thread(self.artifacts.put_dir, staged)
        record = AdapterRecord(
            name=name,
            tenant=tenant.name,
            base_model=settings.base_model_id,
            rank=summary.rank,
            alpha=summary.alpha,
            target_modules=list(summary.target_modules),
            use_rslora=summary.use_rslora,
            dtype=_DTYPE_NAMES[summary.dtype],
            size_bytes=summary.weights_bytes,
            sha256=stored.weights_sha256,
            artifact=stored.path,
            pinned=pinned,
        )
        try:
            created = await self.store.create_adapter(record)
        except AlreadyExists:
            await self.release(stored.path)
            raise Conflict(f"adapter {name!r} already exists") from None
        except NotFound:
            await self.release(stored.path)
            raise Unauthenticated(f"tenant {tenant.name!r} no longer exists") from None
        # RegistryUnavailable propagates and keeps the artifact: a timed-out
        # transaction may still have committed, and gc reclaims the artifact if it did not.
        await self._enforce_quota(tenant, created)
        await self._ensure_stored(stored, staged)
        await self._await_revision(created.updated_revision)
        return created

    async def _enforce_quota(self, tenant: Tenant, created: AdapterRecord) -> None:
        """Concurrent registrations can all pass the pre-check: the oldest `quota` records
        stay, and a newer one over the quota undoes itself."""
        records = await self.store.list_adapters(tenant.name)
        kept = sorted(records, key=lambda r: r.created_revision)[: tenant.adapter_quota]
        if all(r.name != created.name for r in kept):
            await self.delete(tenant.name, created.name)
            raise _quota_reached(tenant)

    async def _ensure_stored(self, stored: StoredArtifact, staged: Path) -> None:
        """A concurrent release of the same bytes (a refused registration, a deleted adapter)
        may have removed the artifact before this record committed: store it again."""
        if not await asyncio.to_thread(self.artifacts.exists, stored.digest):
            await asyncio.to_thread(self.artifacts.put_dir, staged)

    async def delete(self, tenant: str, name: str) -> AdapterRecord:
        try:
            record = await self.store.delete_adapter(tenant, name)
        except NotFound:
            raise NotFound(f"adapter {name!r} not found") from None
        await self.release(record.artifact)
        await self._await_gone(lambda w: w.adapter(tenant, name))
        return record

    async def release(self, artifact: str) -> None:
        """Remove an artifact unless a record references it.

        Safe against a registration of the same bytes in flight elsewhere: the artifact is
        detached (one rename), the references are read again, and it is put back if one
        appeared; a registration that commits after that stores it again (`_ensure_stored`).
        When etcd cannot tell, the artifact stays for gc."""
        digest = artifact.removeprefix("sha256/")
        with contextlib.suppress(RegistryUnavailable):
            if await self._referenced(artifact):
                return
            detached = await asyncio.to_thread(self.artifacts.detach, digest)
            if detached is None:
                return
            try:
                keep = await self._referenced(artifact)
            except RegistryUnavailable:
                keep = True
            if keep:
                await asyncio.to_thread(self.artifacts.reattach, detached, digest)
            else:
                await asyncio.to_thread(self.artifacts.purge, detached)

    async def _referenced(self, artifact: str) -> bool:
        return any(r.artifact == artifact for r in await self.store.list_adapters())

    # tenants

    async def create_tenant(
        self, name: str, adapter_quota: int, limits: TenantLimits | None = None
    ) -> tuple[Tenant, str]:
        """The new tenant and its first API key (only the key's hash is stored)."""
        key, key_hash = new_api_key()
        tenant = Tenant(
            name=name,
            adapter_quota=adapter_quota,
            api_key_hashes=[key_hash],
            limits=limits or TenantLimits(),
        )
        created = await self.store.create_tenant(tenant)  # AlreadyExists: the name is taken
        await self._await_revision(created.updated_revision)
        return created, key

    async def issue_key(self, name: str, revoke_existing: bool) -> tuple[Tenant, str]:
        key, key_hash = new_api_key()

        def with_key(tenant: Tenant) -> dict:
            hashes = [key_hash] if revoke_existing else [*tenant.api_key_hashes, key_hash]
            return {"api_key_hashes": hashes}

        return await self._update_tenant(name, with_key), key

    async def set_limits(self, name: str, limits: TenantLimits) -> Tenant:
        """Replace the tenant's limits; every ingress applies them once its watcher has the
        change."""
        return await self._update_tenant(name, lambda _: {"limits": limits})

    async def _update_tenant(self, name: str, change: Callable[[Tenant], dict]) -> Tenant:
        """Compare-and-set `change(tenant)` into the tenant's record, read again on conflict."""
        for _ in range(_KEY_UPDATE_ATTEMPTS):
            tenant = await self.store.get_tenant(name)
            if tenant is None:
                raise NotFound(f"tenant {name!r} not found")
            try:
                updated = await self.store.update_tenant(
                    tenant.model_copy(update=change(tenant)), tenant.updated_revision
                )
            except RevisionConflict:
                continue
            await self._await_revision(updated.updated_revision)
            return updated
        raise Conflict(f"tenant {name!r} changed {_KEY_UPDATE_ATTEMPTS} times meanwhile; retry")

    async def delete_tenant(self, name: str) -> list[AdapterRecord]:
        """Delete the tenant and its adapters (one transaction); returns the adapters."""
        adapters = await self.store.list_adapters(name)
        await self.store.delete_tenant(name)
        for record in adapters:
            await self.release(record.artifact)
        await self._await_gone(lambda w: w.tenant(name))
        return adapters

    # read-your-writes through this ingress's watcher

    async def _await_revision(self, revision: int) -> None:
        if self.watcher is not None:
            await self.watcher.wait_for_revision(revision, self.settings.visibility_timeout_s)

    async def _await_gone(self, lookup: Callable[[RegistryWatcher], object | None]) -> None:
        """Deletes return no revision: poll the snapshot until `lookup` finds nothing."""
        if self.watcher is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.visibility_timeout_s
        while lookup(self.watcher) is not None and loop.time() < deadline:
            await asyncio.sleep(0.005)


def _quota_reached(tenant: Tenant) -> Conflict:
    return Conflict(
        f"quota of {tenant.adapter_quota} adapters reached for tenant {tenant.name!r}; "
        "delete one first",
    )


async def collect_garbage(
    store: RegistryStore, artifacts: ArtifactStore, *, min_age_s: float = 3600.0
) -> list[str]:
    """Remove artifacts no etcd record references (and stale temp folders) older than
    `min_age_s`; returns what was removed. RegistryUnavailable if etcd cannot say."""
    referenced = {r.artifact.removeprefix("sha256/") for r in await store.list_adapters()}
    return await asyncio.to_thread(artifacts.gc, referenced, min_age_s=min_age_s)
