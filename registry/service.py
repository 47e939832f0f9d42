"""What the tenant API does to etcd and the artifact store: registration, versions, deletion,
tenants and keys. Reads come from the watcher's snapshot when there is one, else from etcd.

Registration order: the staged adapter is validated, stored as an artifact (content-addressed,
atomic), then its records are written in one etcd transaction. A record is therefore only
ever written for a complete artifact; an artifact whose record was refused is released again.

Versions (registry/models.py): registering under a taken name (`put`) adds a version and
moves the alias to it; `rollback` moves the alias to a retained version; a canary sends a
share of requests to a second one. Each is one transaction comparing the alias's revision,
retried when another change won the race. Moving the alias ends a canary. A name keeps its
`versions_kept` newest versions (and always those it serves); older ones are deleted in the
transaction that adds one, and their artifacts released unless another record uses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from loraplex.adapter_format import shown, validate_adapter_dir
from loraplex.checkpoint_shape import ModelShape
from loraplex.errors import (
    AlreadyExists,
    Conflict,
    NotFound,
    OwnerChanged,
    RegistryUnavailable,
    RevisionConflict,
    Unacceptable,
    Unauthenticated,
)
from loraplex.registry.artifacts import ArtifactStore, StoredArtifact
from loraplex.registry.auth import Grant, new_api_key
from loraplex.registry.isolation import WorkLimits, run_isolated
from loraplex.registry.models import (
    Adapter,
    AdapterRecord,
    AdapterVersion,
    Canary,
    Tenant,
    TenantLimits,
)
from loraplex.registry.store import RegistryStore
from loraplex.registry.view import registry_view
from loraplex.registry.watch import RegistryWatcher

log = logging.getLogger(__name__)

_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_KEY_UPDATE_ATTEMPTS = 5
_ALIAS_ATTEMPTS = 5


class ServiceSettings(Protocol):
    """What the service reads of the tenant API's settings (`RegistryAPISettings`)."""

    @property
    def base_model_id(self) -> str: ...
    @property
    def base_model(self) -> ModelShape: ...
    @property
    def max_lora_rank(self) -> int: ...
    @property
    def max_adapter_bytes(self) -> int: ...
    @property
    def visibility_timeout_s(self) -> float: ...
    @property
    def versions_kept(self) -> int: ...
    def work_limits(self) -> WorkLimits: ...


class RegistryService:
    """The tenant API's operations. Refusals are common/errors.py's domain errors."""

    def __init__(
        self,
        store: RegistryStore,
        watcher: RegistryWatcher | None,
        artifacts: ArtifactStore,
        settings: ServiceSettings,
    ) -> None:
        self.store = store
        self.watcher = watcher
        self.view = registry_view(watcher, store)  # reads; writes go to the store
        self.artifacts = artifacts
        self.settings = settings

    # reads

    async def adapters(self, tenant: str) -> list[Adapter]:
        return [await self._joined(record) for record in await self.view.adapters(tenant)]

    async def adapter(self, tenant: str, name: str) -> Adapter:
        record = await self.view.adapter(tenant, name)
        if record is None:
            raise NotFound(f"adapter {shown(name)} not found")
        return await self._joined(record)

    async def _joined(self, record: AdapterRecord) -> Adapter:
        """The alias with the version it names (written before it: always there)."""
        versions = await self.view.versions(record.tenant, record.name)
        return Adapter.of(record, _find(versions, record.name, record.version))

    async def versions(self, tenant: str, name: str) -> list[AdapterVersion]:
        """The adapter's retained versions, newest first; NotFound for an unknown name."""
        await self.adapter(tenant, name)
        return (await self.view.versions(tenant, name))[::-1]

    async def version(self, tenant: str, name: str, version: str) -> AdapterVersion:
        for found in await self.versions(tenant, name):
            if found.version == version:
                return found
        raise _version_not_found(name, version)

    async def tenants(self) -> list[Tenant]:
        return sorted(await self.view.tenants(), key=lambda t: t.name)

    # adapters

    async def register(self, grant: Grant, name: str, pinned: bool, staged: Path) -> Adapter:
        """Register the adapter folder `staged` (outside the artifact root) as the new name
        `name`; Conflict if it is taken. Commits only while `grant` holds (Unauthenticated
        if its key was revoked or its tenant deleted meanwhile; nothing is written)."""
        tenant = grant.tenant
        if await self.store.get_adapter(tenant.name, name) is not None:
            raise Conflict(f"adapter {shown(name)} already exists")
        await self._check_quota(tenant)
        version, stored = await self._store_version(tenant, name, staged)
        for _ in range(_ALIAS_ATTEMPTS):
            try:
                created = await self._create(grant, version, pinned, stored, staged)
                return Adapter.of(created, version)
            except AlreadyExists:
                raise Conflict(f"adapter {shown(name)} already exists") from None
            except OwnerChanged:
                continue
        raise _tenant_changed_meanwhile(tenant.name)

    async def put(
        self, grant: Grant, name: str, pinned: bool | None, staged: Path
    ) -> tuple[Adapter, bool]:
        """Register `staged` under `name`: a new name (True), or a new version of it that the
        alias moves to (False; the same content as a retained version moves the alias back
        to that one, the current content changes nothing). `pinned` None keeps the name's.
        Commits only while `grant` holds, as `register`."""
        tenant = grant.tenant
        if await self.store.get_adapter(tenant.name, name) is None:
            await self._check_quota(tenant)
        version, stored = await self._store_version(tenant, name, staged)
        for _ in range(_ALIAS_ATTEMPTS):
            current = await self.store.get_adapter(tenant.name, name)
            if current is None:
                try:
                    created = await self._create(grant, version, bool(pinned), stored, staged)
                    return Adapter.of(created, version), True
                except (AlreadyExists, OwnerChanged):
                    continue
            try:
                owner_revision = await self._authorised(grant, stored)
                moved = await self._move_to(current, version, pinned, owner_revision)
            except RevisionConflict:  # the alias or the tenant's record changed: read again
                continue
            await self._ensure_stored(stored, staged)
            await self._await_revision(moved.updated_revision)
            return await self._joined(moved), False
        await self.release(stored.path)
        raise _changed_meanwhile(name)

    async def _authorised(self, grant: Grant, stored: StoredArtifact) -> int:
        """The revision of the tenant's record now, which a write compares, if `grant`
        still holds; else `stored` is released and Unauthenticated raised. An upload can
        take minutes: the tenant may have been deleted (and a new one of the same name
        created) or the key revoked since it began, and it must not commit into the new
        tenant or under a revoked key."""
        current = await self.store.get_tenant(grant.tenant.name)
        if current is None or not grant.holds(current):
            await self.release(stored.path)
            raise Unauthenticated(
                "the API key this upload began with was revoked, or its tenant deleted, "
                "before the upload committed; nothing was registered"
            )
        return current.updated_revision

    async def _store_version(
        self, tenant: Tenant, name: str, staged: Path
    ) -> tuple[AdapterVersion, StoredArtifact]:
        """Validate `staged` (in a worker process: untrusted headers and JSON) and store its
        artifact; the version it makes."""
        settings = self.settings
        summary = await run_isolated(
            settings.work_limits(),
            validate_adapter_dir,
            staged,
            settings.base_model,
            settings.max_lora_rank,
            settings.max_adapter_bytes,
        )
        stored = await asyncio.to_thread(self.artifacts.put_dir, staged)
        version = AdapterVersion(
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
            version=stored.digest,
        )
        return version, stored

    async def _create(
        self,
        grant: Grant,
        version: AdapterVersion,
        pinned: bool,
        stored: StoredArtifact,
        staged: Path,
    ) -> AdapterRecord:
        """Create the name at its first version, while `grant` holds. AlreadyExists if it was
        taken meanwhile, OwnerChanged if the tenant's record moved between the check and the
        commit (its artifact is released in both: the caller may retry with the same staged
        folder)."""
        owner_revision = await self._authorised(grant, stored)
        record = AdapterRecord.naming(version, pinned)
        try:
            created = await self.store.create_adapter(
                record, version, owner_revision=owner_revision
            )
        except (AlreadyExists, OwnerChanged):
            await self.release(stored.path)
            raise
        except NotFound:
            await self.release(stored.path)
            raise Unauthenticated(f"tenant {grant.tenant.name!r} no longer exists") from None
        # RegistryUnavailable propagates and keeps the artifact: a timed-out
        # transaction may still have committed, and gc reclaims the artifact if it did not.
        await self._enforce_quota(grant.tenant, created)
        await self._ensure_stored(stored, staged)
        await self._await_revision(created.updated_revision)
        return created

    async def _move_to(
        self,
        current: AdapterRecord,
        version: AdapterVersion,
        pinned: bool | None,
        owner_revision: int,
    ) -> AdapterRecord:
        """Point `current` at `version` (new, or retained: then it keeps its record),
        pruning the oldest versions past `versions_kept` (never the one it moves to or the
        one it served), while the tenant's record is at `owner_revision`. RevisionConflict
        if the alias changed, OwnerChanged if the tenant's record did."""
        pinned = current.pinned if pinned is None else pinned
        if version.version == current.version and current.canary is None:
            if pinned == current.pinned:
                return current
            return await self.store.update_adapter(
                current.model_copy(update={"pinned": pinned}),
                current.updated_revision,
                owner_revision=owner_revision,
            )
        retained = await self.store.list_versions(current.tenant, current.name)
        existing = next((v for v in retained if v.version == version.version), None)
        target = existing or version
        kept = retained if existing else [*retained, version]
        # the version it served stays too, so a rollback after a bad push is always possible
        drop = self._beyond_retention(kept, keep={target.version, current.version})
        alias = current.pointing_to(target).model_copy(update={"pinned": pinned})
        moved = await self.store.move_adapter(
            alias,
            current.updated_revision,
            add=[] if existing else [version],
            drop=[v.version for v in drop],
            owner_revision=owner_revision,
        )
        for gone in drop:
            await self.release(gone.artifact)
        return moved

    def _beyond_retention(
        self, versions: list[AdapterVersion], keep: set[str]
    ) -> list[AdapterVersion]:
        """The oldest versions past `versions_kept`, never one in `keep`."""
        excess = len(versions) - self.settings.versions_kept
        return [v for v in versions if v.version not in keep][: max(0, excess)]

    async def rollback(self, tenant: str, name: str, version: str | None) -> Adapter:
        """Move the alias to the retained `version` (None: the one registered before the
        current one), ending any canary."""
        for _ in range(_ALIAS_ATTEMPTS):
            current = await self._current(tenant, name)
            retained = await self.store.list_versions(current.tenant, current.name)
            if version is None:
                position = next(i for i, v in enumerate(retained) if v.version == current.version)
                if position == 0:
                    raise Conflict(
                        f"adapter {shown(name)} has no version older than its current one to roll "
                        f"back to; name a version"
                    )
                target = retained[position - 1]
            else:
                target = _find(retained, name, version)
            if target.version == current.version and current.canary is None:
                return Adapter.of(current, target)
            try:
                moved = await self.store.move_adapter(
                    current.pointing_to(target),
                    current.updated_revision,
                    require=[target.version],
                )
            except RevisionConflict:
                continue
            except NotFound as e:
                raise NotFound(f"{e.message}; it may have been deleted meanwhile") from None
            await self._await_revision(moved.updated_revision)
            return Adapter.of(moved, target)
        raise _changed_meanwhile(name)

    async def set_canary(self, tenant: str, name: str, canary: Canary | None) -> Adapter:
        """Send `canary.weight` of the name's requests to `canary.version` (a retained version
        other than the current one); None ends the canary."""
        for _ in range(_ALIAS_ATTEMPTS):
            current = await self._current(tenant, name)
            if canary is not None:
                _find(
                    await self.store.list_versions(current.tenant, current.name),
                    name,
                    canary.version,
                )
                if canary.version == current.version:
                    raise Unacceptable(
                        f"version {canary.version} is adapter {shown(name)}'s current version; a "
                        "canary needs another of its versions"
                    )
            if current.canary == canary:
                return await self._joined(current)
            require = [] if canary is None else [canary.version]
            try:
                moved = await self.store.move_adapter(
                    current.model_copy(update={"canary": canary}),
                    current.updated_revision,
                    require=require,
                )
            except RevisionConflict:
                continue
            await self._await_revision(moved.updated_revision)
            return await self._joined(moved)
        raise _changed_meanwhile(name)

    async def delete_version(self, tenant: str, name: str, version: str) -> AdapterVersion:
        """Delete a retained version the alias does not serve (Conflict if it does)."""
        for _ in range(_ALIAS_ATTEMPTS):
            current = await self._current(tenant, name)
            target = _find(await self.store.list_versions(tenant, name), name, version)
            if version in current.targets:
                role = "current version" if version == current.version else "canary"
                raise Conflict(
                    f"version {version} is adapter {shown(name)}'s {role}; move the alias or end "
                    "the canary first"
                )
            try:
                moved = await self.store.move_adapter(
                    current, current.updated_revision, drop=[version], require=[version]
                )
            except RevisionConflict:
                continue
            await self.release(target.artifact)
            await self._await_revision(moved.updated_revision)
            return target
        raise _changed_meanwhile(name)

    async def _current(self, tenant: str, name: str) -> AdapterRecord:
        """The alias as etcd holds it now (a compare-and-set needs its revision)."""
        current = await self.store.get_adapter(tenant, name)
        if current is None:
            raise NotFound(f"adapter {shown(name)} not found")
        return current

    async def _check_quota(self, tenant: Tenant) -> None:
        if len(await self.store.list_adapters(tenant.name)) >= tenant.adapter_quota:
            raise _quota_reached(tenant)

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

    async def delete(self, tenant: str, name: str) -> Adapter:
        """Delete the name and every version of it; the name as it was."""
        try:
            record, versions = await self.store.delete_adapter_and_versions(tenant, name)
        except NotFound:
            raise NotFound(f"adapter {shown(name)} not found") from None
        for artifact in sorted({v.artifact for v in versions}):
            await self.release(artifact)
        await self._await_gone(lambda w: w.adapter(tenant, name))
        return Adapter.of(record, _find(versions, name, record.version))

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
        return artifact in await self.store.referenced_artifacts()

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
                raise NotFound(f"tenant {shown(name)} not found")
            try:
                updated = await self.store.update_tenant(
                    tenant.model_copy(update=change(tenant)), tenant.updated_revision
                )
            except RevisionConflict:
                continue
            await self._await_revision(updated.updated_revision)
            return updated
        raise Conflict(
            f"tenant {shown(name)} changed {_KEY_UPDATE_ATTEMPTS} times meanwhile; retry"
        )

    async def delete_tenant(self, name: str) -> list[AdapterRecord]:
        """Delete the tenant and its adapters (one transaction); returns the adapters."""
        adapters = await self.store.list_adapters(name)
        versions = [
            v for record in adapters for v in await self.store.list_versions(name, record.name)
        ]
        await self.store.delete_tenant(name)
        for artifact in sorted({v.artifact for v in versions}):
            await self.release(artifact)
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


def _find(versions: list[AdapterVersion], name: str, version: str) -> AdapterVersion:
    for found in versions:
        if found.version == version:
            return found
    raise _version_not_found(name, version)


def _version_not_found(name: str, version: str) -> NotFound:
    return NotFound(
        f"version {version} of adapter {shown(name)} not found (deleted, or never registered)"
    )


def _changed_meanwhile(name: str) -> Conflict:
    return Conflict(f"adapter {shown(name)} changed {_ALIAS_ATTEMPTS} times meanwhile; retry")


def _tenant_changed_meanwhile(tenant: str) -> Conflict:
    return Conflict(f"tenant {tenant!r} changed {_ALIAS_ATTEMPTS} times meanwhile; retry")


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
    referenced = {a.removeprefix("sha256/") for a in await store.referenced_artifacts()}
    return await asyncio.to_thread(artifacts.gc, referenced, min_age_s=min_age_s)


async def collect_garbage_every(
    store: RegistryStore, artifacts: ArtifactStore, interval_s: float, min_age_s: float
) -> None:
    """`collect_garbage` every `interval_s` until cancelled; a round etcd cannot answer is
    skipped (the next one tries again)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            removed = await collect_garbage(store, artifacts, min_age_s=min_age_s)
        except RegistryUnavailable as e:
            log.warning("artifact gc skipped: %s", e)
            continue
        except Exception:  # a bug must not end the loop: the next round tries again
            log.exception("artifact gc failed")
            continue
        if removed:
            log.info("artifact gc removed %d unreferenced artifacts: %s", len(removed), removed)
