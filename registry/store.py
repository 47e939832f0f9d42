"""Async etcd store of tenants and adapter records.

Every write is one etcd transaction: create-if-absent compares create_revision == 0,
updates compare mod_revision with the revision the caller read, and deleting a tenant
deletes its adapters in the same transaction. Returned models carry the revision the write
committed at, which a caller can hand to `RegistryWatcher.wait_for_revision`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aetcd
from aetcd.utils import prefix_range_end

from .errors import AlreadyExists, NotFound, RegistryUnavailable, RevisionConflict
from .etcd_client import EtcdConnection, EtcdSettings
from .models import (
    ADAPTERS_PREFIX,
    PREFIX,
    TENANTS_PREFIX,
    AdapterRecord,
    RegistryValue,
    Tenant,
    adapter_key,
    decode,
    encode,
    key_of,
    tenant_adapters_prefix,
    tenant_key,
)

__all__ = [
    "AlreadyExists",
    "EtcdSettings",
    "NotFound",
    "RegistryStore",
    "RegistryUnavailable",
    "RevisionConflict",
    "decode_kv",
    "read_prefix",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
V = TypeVar("V", Tenant, AdapterRecord)


def decode_kv(kv) -> RegistryValue | None:
    key = kv.key.decode()
    try:
        return decode(
            key, kv.value, created_revision=kv.create_revision, updated_revision=kv.mod_revision
        )
    except ValueError as e:
        log.warning("skipping unreadable registry key %s: %s", key, e)
        return None


async def read_prefix(client: aetcd.Client, prefix: str) -> tuple[dict[str, RegistryValue], int]:
    """Every readable value under `prefix` (one range read, so one revision) and that revision."""
    result = await client.get_prefix(prefix.encode())
    values = {}
    for kv in result.kvs:
        value = decode_kv(kv)
        if value is not None:
            values[kv.key.decode()] = value
    return values, result.header.revision


class RegistryStore:
    """Tenants and adapters in etcd. Calls raise RegistryUnavailable after at most
    `settings.timeout_s` when etcd cannot be reached."""

    def __init__(self, settings: EtcdSettings):
        self.settings = settings
        self._connection = EtcdConnection(settings)

    async def __aenter__(self) -> RegistryStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect now (RegistryUnavailable if no endpoint answers). Optional: every call
        connects, and reconnects after a failure, by itself."""
        await self._connection.client()

    async def close(self) -> None:
        await self._connection.close()

    # tenants

    async def create_tenant(self, t: Tenant) -> Tenant:
        key = tenant_key(t.name).encode()
        succeeded, responses = await self._txn(
            lambda tx: ([tx.create(key) == 0], [tx.put(key, encode(t))], [])
        )
        if not succeeded:
            raise AlreadyExists(f"tenant {t.name!r} already exists")
        return _committed(t, responses[0].response_put.header.revision)

    async def get_tenant(self, name: str) -> Tenant | None:
        value = await self._get(tenant_key(name))
        assert value is None or isinstance(value, Tenant)
        return value

    async def list_tenants(self) -> list[Tenant]:
        values, _ = await self._call(lambda c: read_prefix(c, TENANTS_PREFIX))
        return [v for v in values.values() if isinstance(v, Tenant)]

    async def update_tenant(self, t: Tenant, expected_revision: int) -> Tenant:
        return await self._update(t, expected_revision, f"tenant {t.name!r}")

    async def delete_tenant(self, name: str) -> None:
        """Deletes the tenant and all its adapters in one transaction."""
        key = tenant_key(name).encode()
        succeeded, _ = await self._txn(
            lambda tx: (
                [tx.version(key) > 0],
                [tx.delete(key), tx.delete(*_prefix_range(tenant_adapters_prefix(name)))],
                [],
            )
        )
        if not succeeded:
            raise NotFound(f"tenant {name!r} not found")

    # adapters

    async def create_adapter(self, rec: AdapterRecord) -> AdapterRecord:
        """Create-if-absent; the tenant must exist in the same transaction (so an adapter
        never outlives a concurrent delete_tenant)."""
        key, owner = key_of(rec).encode(), tenant_key(rec.tenant).encode()
        succeeded, responses = await self._txn(
            lambda tx: (
                [tx.create(key) == 0, tx.version(owner) > 0],
                [tx.put(key, encode(rec))],
                [tx.get(key), tx.get(owner)],
            )
        )
        if succeeded:
            return _committed(rec, responses[0].response_put.header.revision)
        existing, tenant = responses
        if existing:
            raise AlreadyExists(f"adapter {rec.name!r} already exists for tenant {rec.tenant!r}")
        assert not tenant
        raise NotFound(f"tenant {rec.tenant!r} not found")

    async def update_adapter(self, rec: AdapterRecord, expected_revision: int) -> AdapterRecord:
        return await self._update(rec, expected_revision, f"adapter {rec.tenant}/{rec.name}")

    async def delete_adapter(self, tenant: str, name: str) -> AdapterRecord:
        """Deletes and returns the record as it was."""
        key = adapter_key(tenant, name)
        deleted = await self._call(lambda c: c.delete(key.encode(), prev_kv=True))
        if deleted is None:
            raise NotFound(f"adapter {tenant}/{name} not found")
        record = decode_kv(deleted.prev_kv)
        assert isinstance(record, AdapterRecord), f"{key} held an unreadable value"
        return record

    async def get_adapter(self, tenant: str, name: str) -> AdapterRecord | None:
        value = await self._get(adapter_key(tenant, name))
        assert value is None or isinstance(value, AdapterRecord)
        return value

    async def list_adapters(self, tenant: str | None = None) -> list[AdapterRecord]:
        """Sorted by (tenant, name)."""
        prefix = ADAPTERS_PREFIX if tenant is None else tenant_adapters_prefix(tenant)
        values, _ = await self._call(lambda c: read_prefix(c, prefix))
        return [v for v in values.values() if isinstance(v, AdapterRecord)]

    async def read_all(self) -> tuple[dict[str, RegistryValue], int]:
        """Everything under PREFIX, keyed by etcd key, and the revision of that read."""
        return await self._call(lambda c: read_prefix(c, PREFIX + "/"))

    # transactions and error mapping

    async def _update(self, value: V, expected_revision: int, what: str) -> V:
        key = key_of(value).encode()
        succeeded, responses = await self._txn(
            lambda tx: (
                [tx.version(key) > 0, tx.mod(key) == expected_revision],
                [tx.put(key, encode(value))],
                [tx.get(key)],
            )
        )
        if succeeded:
            revision = responses[0].response_put.header.revision
            return value.model_copy(update={"updated_revision": revision})
        (current,) = responses
        if not current:
            raise NotFound(f"{what} not found")
        _, kv = current[0]
        raise RevisionConflict(
            f"{what} changed: expected revision {expected_revision}, it is at "
            f"{kv.mod_revision}; read it again and retry"
        )

    async def _get(self, key: str) -> RegistryValue | None:
        kv = await self._call(lambda c: c.get(key.encode()))
        return None if kv is None else decode_kv(kv)

    async def _txn(self, build: Callable[[aetcd.Transactions], tuple[list, list, list]]):
        """(succeeded, responses) of one transaction; `build(client.transactions)` returns
        (compare, success, failure)."""

        async def run(client: aetcd.Client):
            compare, success, failure = build(client.transactions)
            return await client.transaction(compare=compare, success=success, failure=failure)

        return await self._call(run)

    async def _call(self, request: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        return await self._connection.request(request)


def _committed(value: V, revision: int) -> V:
    return value.model_copy(update={"created_revision": revision, "updated_revision": revision})


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    start = prefix.encode()
    return start, prefix_range_end(start)
