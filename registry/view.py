"""What the tenant API and the ingress read of the registry, from one source chosen when they
are wired: the watcher's snapshot (no etcd round trip per request, and reads go on while etcd
is down) or, without a watcher (tools, tests), etcd itself. Readers hold a `RegistryView`
and never ask which one they have."""

from __future__ import annotations

from typing import Protocol

from loraplex.registry.models import AdapterRecord, AdapterVersion, Tenant
from loraplex.registry.store import RegistryStore
from loraplex.registry.watch import RegistryWatcher


class RegistryView(Protocol):
    async def adapter(self, tenant: str, name: str) -> AdapterRecord | None:
        """The adapter `name` of `tenant`, or None: names are scoped by tenant, so another
        tenant's adapter of the same name is never returned."""
        ...

    async def adapters(self, tenant: str) -> list[AdapterRecord]:
        """The tenant's adapters, sorted by name."""
        ...

    async def versions(self, tenant: str, name: str) -> list[AdapterVersion]:
        """The retained versions of one adapter, oldest first."""
        ...

    async def tenants(self) -> list[Tenant]: ...


class WatchedView:
    """Reads the watcher's snapshot."""

    def __init__(self, watcher: RegistryWatcher) -> None:
        self.watcher = watcher

    async def adapter(self, tenant: str, name: str) -> AdapterRecord | None:
        return self.watcher.adapter(tenant, name)

    async def adapters(self, tenant: str) -> list[AdapterRecord]:
        return self.watcher.adapters(tenant)

    async def versions(self, tenant: str, name: str) -> list[AdapterVersion]:
        return self.watcher.versions(tenant, name)

    async def tenants(self) -> list[Tenant]:
        return watched_tenants(self.watcher)


class StoredView:
    """Reads etcd on every call."""

    def __init__(self, store: RegistryStore) -> None:
        self.store = store

    async def adapter(self, tenant: str, name: str) -> AdapterRecord | None:
        return await self.store.get_adapter(tenant, name)

    async def adapters(self, tenant: str) -> list[AdapterRecord]:
        return await self.store.list_adapters(tenant)

    async def versions(self, tenant: str, name: str) -> list[AdapterVersion]:
        return await self.store.list_versions(tenant, name)

    async def tenants(self) -> list[Tenant]:
        return await self.store.list_tenants()


def registry_view(watcher: RegistryWatcher | None, store: RegistryStore) -> RegistryView:
    """The watcher's snapshot when there is a watcher, else etcd."""
    return StoredView(store) if watcher is None else WatchedView(watcher)


def watched_tenants(watcher: RegistryWatcher) -> list[Tenant]:
    return [value for value in watcher.snapshot.values() if isinstance(value, Tenant)]
