"""Bearer-token authentication for the tenant API: one admin key, and per-tenant API keys
that are stored only as sha256 hex digests in the tenant's etcd record."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.errors import Forbidden, Unauthenticated
from loraplex.registry.models import Tenant
from loraplex.registry.view import watched_tenants

if TYPE_CHECKING:
    from loraplex.registry.store import RegistryStore
    from loraplex.registry.watch import RegistryWatcher

API_KEY_PREFIX = "lpx_"


def new_api_key() -> tuple[str, str]:
    """(key, sha256 hex of the key). 256 random bits: a digest lookup needs no salt or
    slow hash, and leaks nothing useful through timing."""
    key = API_KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hash_api_key(key)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_token(authorization: str | None) -> str:
    """The key of an `Authorization: Bearer <key>` header's value."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
    return token.strip()


@dataclass(frozen=True)
class Grant:
    """What a tenant key authorised: the tenant record as it was and the key's digest. A
    write that commits later (an upload) holds the grant and commits only while the same
    tenant (the same `created_revision`) still holds that key."""

    tenant: Tenant
    key_hash: str

    def holds(self, current: Tenant | None) -> bool:
        """Whether `current` (the tenant's record now) still honours this grant."""
        return (
            current is not None
            and current.created_revision == self.tenant.created_revision
            and self.key_hash in current.api_key_hashes
        )


class Authenticator:
    """Maps a bearer token to the admin or to a tenant.

    With a watcher, tenants come from its snapshot (no etcd round trip per request, and keys
    keep working while etcd is down); the digest index is rebuilt when the snapshot's
    revision moves. Without one, every request reads the tenants from the store."""

    def __init__(
        self, admin_key: str, store: RegistryStore, watcher: RegistryWatcher | None
    ) -> None:
        self._admin_digest = hash_api_key(admin_key)
        self._store = store
        self._watcher = watcher
        self._index: dict[str, str] = {}
        self._index_revision = -1

    def is_admin(self, token: str) -> bool:
        # Equal-length digests compared in constant time: timing reveals nothing of the key.
        return hmac.compare_digest(hash_api_key(token), self._admin_digest)

    async def require_admin(self, authorization: str | None) -> None:
        """Passes for the admin key (the value of the Authorization header)."""
        token = bearer_token(authorization)
        if self.is_admin(token):
            return
        if await self._tenant_of(hash_api_key(token)) is not None:
            raise Forbidden("this route needs the admin key; a tenant key was sent")
        raise Unauthenticated("invalid API key")

    async def require_key(self, authorization: str | None) -> None:
        """Passes for the admin key or any tenant's key: the check that needs no route."""
        token = bearer_token(authorization)
        if not self.is_admin(token) and await self._tenant_of(hash_api_key(token)) is None:
            raise Unauthenticated("invalid API key")

    async def require_tenant(self, authorization: str | None) -> Tenant:
        """The tenant whose key the Authorization header's value carries."""
        return (await self.require_grant(authorization)).tenant

    async def require_grant(self, authorization: str | None) -> Grant:
        """The tenant whose key the Authorization header's value carries, with the key."""
        token = bearer_token(authorization)
        digest = hash_api_key(token)
        tenant = await self._tenant_of(digest)
        if tenant is not None:
            return Grant(tenant, digest)
        if self.is_admin(token):
            raise Forbidden("this route needs a tenant API key; the admin key owns no adapters")
        raise Unauthenticated("invalid API key")

    async def _tenant_of(self, digest: str) -> Tenant | None:
        if self._watcher is None:
            tenants = await self._store.list_tenants()
            return next((t for t in tenants if digest in t.api_key_hashes), None)
        if self._index_revision != self._watcher.revision:
            self._index_revision = self._watcher.revision
            self._index = {
                key_hash: tenant.name
                for tenant in watched_tenants(self._watcher)
                for key_hash in tenant.api_key_hashes
            }
        name = self._index.get(digest)
        return None if name is None else self._watcher.tenant(name)
