"""Async etcd store of tenants and adapter records.

Every write is one etcd transaction: create-if-absent compares create_revision == 0,
updates compare mod_revision with the revision the caller read, and deleting a tenant
deletes its adapters in the same transaction. An adapter's alias and its versions change
together: every write of a version also writes the alias and compares its revision, so
a caller that read the alias at revision R knows the versions have not changed since. Returned models carry the revision the write
committed at, which a caller can hand to `RegistryWatcher.wait_for_revision`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import aetcd
from aetcd.utils import prefix_range_end

from loraplex.errors import (
    AlreadyExists,
    NotFound,
    OwnerChanged,
    RegistryUnavailable,
    RevisionConflict,
)

from .etcd_client import EtcdConnection, EtcdSettings
from .models import (
    ADAPTERS_PREFIX,
    PREFIX,
    TENANTS_PREFIX,
    VERSIONS_PREFIX,
    AdapterRecord,
    AdapterVersion,
    RegistryValue,
    Tenant,
    adapter_key,
    adapter_versions_prefix,
    decode,
    encode,
    key_of,
    tenant_adapters_prefix,
    tenant_key,
    tenant_versions_prefix,
    version_key,
)

__all__ = [
    "AlreadyExists",
    "EtcdSettings",
    "NotFound",
    "OwnerChanged",
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
        """Deletes the tenant and all its adapters and their versions in one transaction."""
        key = tenant_key(name).encode()
        succeeded, _ = await self._txn(
            lambda tx: (
                [tx.version(key) > 0],
                [
                    tx.delete(key),
                    tx.delete(*_prefix_range(tenant_adapters_prefix(name))),
                    tx.delete(*_prefix_range(tenant_versions_prefix(name))),
                ],
                [],
            )
        )
        if not succeeded:
            raise NotFound(f"tenant {name!r} not found")

    # adapters

    async def create_adapter(
        self,
        rec: AdapterRecord,
        first: AdapterVersion,
        *,
        owner_revision: int | None = None,
    ) -> AdapterRecord:
        """Create-if-absent, with its first version `first` (the one `rec` names); the
        tenant must exist in the same transaction (so an adapter never outlives a concurrent
        delete_tenant), and with `owner_revision` its record must still be at that revision
        (OwnerChanged if not: the write was authorised against another record)."""
        assert first.version == rec.version, "an alias starts at its first version"
        key, owner = key_of(rec).encode(), tenant_key(rec.tenant).encode()
        succeeded, responses = await self._txn(
            lambda tx: (
                [tx.create(key) == 0, *_owner_compare(tx, owner, owner_revision)],
                # the version first: a watcher applies a transaction's events in its
                # order, so whoever sees the alias already holds the version it names
                [tx.put(key_of(first).encode(), encode(first)), tx.put(key, encode(rec))],
                [tx.get(owner), tx.get(key)],
            )
        )
        if succeeded:
            return _committed(rec, responses[0].response_put.header.revision)
        tenant, existing = responses
        _check_owner(tenant, rec.tenant, owner_revision)
        assert existing
        raise AlreadyExists(f"adapter {rec.name!r} already exists for tenant {rec.tenant!r}")

    async def update_adapter(
        self, rec: AdapterRecord, expected_revision: int, *, owner_revision: int | None = None
    ) -> AdapterRecord:
        """Rewrite the alias (pinned, canary) as `rec`; its versions stay as they are. With
        `owner_revision`, only while the tenant's record is at that revision (OwnerChanged)."""
        return await self.move_adapter(rec, expected_revision, owner_revision=owner_revision)

    async def move_adapter(
        self,
        rec: AdapterRecord,
        expected_revision: int,
        *,
        add: Sequence[AdapterVersion] = (),
        drop: Sequence[str] = (),
        require: Sequence[str] = (),
        owner_revision: int | None = None,
    ) -> AdapterRecord:
        """Write the alias `rec` (the version it points to, its canary) in one transaction
        that compares the alias's revision with `expected_revision`: store the new versions
        `add`, delete the versions `drop` and require the versions `require` to exist; with
        `owner_revision`, the tenant's record must be at that revision too. NotFound if the
        alias is gone or a required version is (naming it), RevisionConflict if the alias
        changed, OwnerChanged if the tenant's record did; then nothing was written."""
        what = f"adapter {rec.tenant}/{rec.name}"
        key, owner = key_of(rec).encode(), tenant_key(rec.tenant).encode()
        required = [version_key(rec.tenant, rec.name, v).encode() for v in require]
        owned = owner_revision is not None

        def build(tx):
            compare = [tx.version(key) > 0, tx.mod(key) == expected_revision]
            compare += [tx.version(k) > 0 for k in required]
            compare += _owner_compare(tx, owner, owner_revision) if owned else []
            # new versions before the alias that names them (create_adapter says why)
            success = [tx.put(key_of(v).encode(), encode(v)) for v in add]
            success += [tx.put(key, encode(rec))]
            success += [tx.delete(version_key(rec.tenant, rec.name, v).encode()) for v in drop]
            failure = [tx.get(owner)] if owned else []
            return compare, success, failure + [tx.get(key)] + [tx.get(k) for k in required]

        succeeded, responses = await self._txn(build)
        if succeeded:
            revision = responses[0].response_put.header.revision
            return rec.model_copy(update={"updated_revision": revision})
        if owned:
            _check_owner(responses[0], rec.tenant, owner_revision)
            responses = responses[1:]
        current, *versions = responses
        if not current:
            raise NotFound(f"{what} not found")
        _, kv = current[0]
        if kv.mod_revision != expected_revision:
            raise RevisionConflict(
                f"{what} changed: expected revision {expected_revision}, it is at "
                f"{kv.mod_revision}; read it again and retry"
            )
        missing = [v for v, found in zip(require, versions, strict=True) if not found]
        raise NotFound(f"version {missing[0]} of adapter {rec.name!r} not found")

    async def delete_adapter(self, tenant: str, name: str) -> AdapterRecord:
        """Deletes the alias and its versions; returns the alias as it was."""
        record, _ = await self.delete_adapter_and_versions(tenant, name)
        return record

    async def delete_adapter_and_versions(
        self, tenant: str, name: str
    ) -> tuple[AdapterRecord, list[AdapterVersion]]:
        """Deletes the alias and every version of it in one transaction; returns them as
        they were."""
        key = adapter_key(tenant, name).encode()
        succeeded, responses = await self._txn(
            lambda tx: (
                [tx.version(key) > 0],
                [
                    tx.delete(key, prev_kv=True),
                    tx.delete(*_prefix_range(adapter_versions_prefix(tenant, name)), prev_kv=True),
                ],
                [],
            )
        )
        if not succeeded:
            raise NotFound(f"adapter {tenant}/{name} not found")
        alias, versions = (r.response_delete_range.prev_kvs for r in responses)
        record = decode_kv(alias[0])
        assert isinstance(record, AdapterRecord), f"{key!r} held an unreadable value"
        deleted = [v for v in map(decode_kv, versions) if isinstance(v, AdapterVersion)]
        return record, deleted

    async def list_versions(self, tenant: str, name: str) -> list[AdapterVersion]:
        """The versions of one adapter, oldest first."""
        values, _ = await self._call(
            lambda c: read_prefix(c, adapter_versions_prefix(tenant, name))
        )
        versions = [v for v in values.values() if isinstance(v, AdapterVersion)]
        return sorted(versions, key=lambda v: v.created_revision)

    async def referenced_artifacts(self) -> set[str]:
        """Artifacts some retained version refers to (every alias names one of them)."""
        values, _ = await self._call(functools.partial(_read_prefix_of, VERSIONS_PREFIX))
        return {v.artifact for v in values.values() if isinstance(v, AdapterVersion)}

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


def _owner_compare(tx, owner: bytes, owner_revision: int | None) -> list:
    """The tenant exists; with `owner_revision`, its record is still at that revision."""
    if owner_revision is None:
        return [tx.version(owner) > 0]
    return [tx.mod(owner) == owner_revision]


def _check_owner(found: list, tenant: str, owner_revision: int | None) -> None:
    """After a failed transaction: NotFound if the tenant is gone, OwnerChanged if its record
    is not at `owner_revision` (when given); else the tenant was not why it failed."""
    if not found:
        raise NotFound(f"tenant {tenant!r} not found")
    _, kv = found[0]
    if owner_revision is not None and kv.mod_revision != owner_revision:
        raise OwnerChanged(
            f"tenant {tenant!r} changed: authorised at revision {owner_revision}, it is at "
            f"{kv.mod_revision}"
        )


def _committed(value: V, revision: int) -> V:
    return value.model_copy(update={"created_revision": revision, "updated_revision": revision})


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    start = prefix.encode()
    return start, prefix_range_end(start)


async def _read_prefix_of(
    prefix: str, client: aetcd.Client
) -> tuple[dict[str, RegistryValue], int]:
    return await read_prefix(client, prefix)
