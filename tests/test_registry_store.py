"""RegistryStore against a real etcd: transactions, revisions, and etcd being down."""

from __future__ import annotations

import asyncio
import time

import pytest
from etcd_server import (  # noqa: F401 (fixtures)
    EtcdServer,
    etcd_server_fixture,
    shared_etcd_server_fixture,
)
from pydantic import ValidationError

from loraplex.net import free_port
from loraplex.registry.models import (
    AdapterRecord,
    AdapterVersion,
    Tenant,
    adapter_key,
    decode,
    encode,
    parse_key,
    tenant_key,
    version_key,
)
from loraplex.registry.store import (
    AlreadyExists,
    EtcdSettings,
    NotFound,
    RegistryStore,
    RegistryUnavailable,
    RevisionConflict,
)

SHA = "ab" * 32


def version_of(tenant: str, name: str, **overrides) -> AdapterVersion:
    fields = dict(
        name=name,
        tenant=tenant,
        base_model="demo/base",
        rank=8,
        alpha=16.0,
        target_modules=["q_proj", "v_proj"],
        dtype="bfloat16",
        size_bytes=1024,
        sha256=SHA,
        artifact=f"sha256/ab/{SHA}",
        version=SHA,
    )
    return AdapterVersion(**(fields | overrides))


def record(tenant: str, name: str, **overrides) -> AdapterRecord:
    return AdapterRecord(**(dict(name=name, tenant=tenant, version=SHA) | overrides))


async def create(store: RegistryStore, tenant: str, name: str, **overrides) -> AdapterRecord:
    """A name at its first version, as the tenant API writes it."""
    version = version_of(tenant, name, **overrides)
    return await store.create_adapter(AdapterRecord.naming(version), version)


# models (no etcd)


def test_keys_round_trip():
    assert tenant_key("acme") == "/loraplex/v1/tenants/acme"
    assert adapter_key("acme", "sql.v2") == "/loraplex/v1/adapters/acme/sql.v2"
    assert parse_key(tenant_key("acme")) == ("tenant", "acme", None, None)
    assert parse_key(adapter_key("acme", "sql.v2")) == ("adapter", "acme", "sql.v2", None)
    assert version_key("acme", "sql", SHA) == f"/loraplex/v1/versions/acme/sql/{SHA}"
    assert parse_key(version_key("acme", "sql", SHA)) == ("version", "acme", "sql", SHA)
    for bad in (
        "/loraplex/v1/adapters/acme",
        "/loraplex/v1/tenants/",
        "/other/x",
        "/loraplex/v1/adapters/a/b/c",
        "/loraplex/v1/versions/a/b",
        "/loraplex/v1/versions/a/b/c/d",
    ):
        with pytest.raises(ValueError):
            parse_key(bad)


def test_models_validate_and_store_without_revisions():
    with pytest.raises(ValidationError, match="pattern"):
        record("acme", "Bad/Name")
    with pytest.raises(ValidationError, match="artifact"):
        version_of("acme", "x", artifact="../../etc/passwd")
    with pytest.raises(ValidationError):
        version_of("acme", "x", sha256="not-a-digest")
    with pytest.raises(ValidationError, match="extra"):  # an alias names a version, no more
        record("acme", "x", rank=8)
    with pytest.raises(ValidationError, match="sha256 hex"):
        Tenant(name="acme", api_key_hashes=["secret"])
    rec = record("acme", "x", created_revision=5, updated_revision=7)
    assert b"revision" not in encode(rec)
    back = decode(adapter_key("acme", "x"), encode(rec), created_revision=5, updated_revision=7)
    assert back == rec
    with pytest.raises(ValueError, match="holds adapter"):
        decode(adapter_key("other", "x"), encode(rec), created_revision=1, updated_revision=1)
    assert AdapterRecord.model_json_schema()["examples"]


# against etcd


@pytest.mark.etcd
def test_tenant_and_adapter_lifecycle(shared_etcd_server: EtcdServer):
    async def body():
        async with RegistryStore(shared_etcd_server.settings()) as store:
            with pytest.raises(NotFound, match="tenant 'life' not found"):
                await create(store, "life", "a")
            tenant = await store.create_tenant(Tenant(name="life"))
            assert tenant.created_revision == tenant.updated_revision > 0
            with pytest.raises(AlreadyExists):
                await store.create_tenant(Tenant(name="life"))
            assert await store.get_tenant("life") == tenant

            created = await create(store, "life", "a")
            assert created.created_revision > tenant.updated_revision
            assert await store.get_adapter("life", "a") == created

            updated = await store.update_adapter(
                created.model_copy(update={"pinned": True}), created.updated_revision
            )
            assert updated.updated_revision > created.updated_revision
            assert updated.created_revision == created.created_revision
            assert await store.get_adapter("life", "a") == updated

            deleted = await store.delete_adapter("life", "a")
            assert deleted == updated
            assert await store.get_adapter("life", "a") is None
            with pytest.raises(NotFound, match="life/a"):
                await store.delete_adapter("life", "a")
            with pytest.raises(NotFound):
                await store.update_adapter(updated, updated.updated_revision)

    asyncio.run(body())


@pytest.mark.etcd
def test_concurrent_creates_of_one_name_one_wins(shared_etcd_server: EtcdServer):
    async def body():
        settings = shared_etcd_server.settings()
        async with RegistryStore(settings) as a, RegistryStore(settings) as b:
            await a.create_tenant(Tenant(name="race"))
            for round_ in range(20):
                name = f"adapter-{round_}"
                results = await asyncio.gather(
                    create(a, "race", name, rank=4),
                    create(b, "race", name, rank=8),
                    return_exceptions=True,
                )
                winners = [r for r in results if isinstance(r, AdapterRecord)]
                losers = [r for r in results if isinstance(r, AlreadyExists)]
                assert len(winners) == 1 and len(losers) == 1, results
                assert await a.get_adapter("race", name) == winners[0]

    asyncio.run(body())


@pytest.mark.etcd
def test_stale_revision_conflicts_and_changes_nothing(shared_etcd_server: EtcdServer):
    async def body():
        async with RegistryStore(shared_etcd_server.settings()) as store:
            tenant = await store.create_tenant(Tenant(name="cas", adapter_quota=5))
            first = await create(store, "cas", "a")
            second = await store.update_adapter(
                first.model_copy(update={"pinned": True}), first.updated_revision
            )
            with pytest.raises(RevisionConflict, match=f"at {second.updated_revision}"):
                await store.update_adapter(
                    first.model_copy(update={"pinned": False}), first.updated_revision
                )
            assert await store.get_adapter("cas", "a") == second

            raised = await store.update_tenant(
                tenant.model_copy(update={"adapter_quota": 9}), tenant.updated_revision
            )
            with pytest.raises(RevisionConflict):
                await store.update_tenant(
                    tenant.model_copy(update={"adapter_quota": 1}), tenant.updated_revision
                )
            assert (await store.get_tenant("cas")).adapter_quota == raised.adapter_quota == 9
            with pytest.raises(NotFound):  # a compare-and-set never creates
                await store.update_tenant(Tenant(name="cas-missing"), 0)
            assert await store.get_tenant("cas-missing") is None

    asyncio.run(body())


@pytest.mark.etcd
def test_delete_tenant_takes_its_adapters_and_only_them(shared_etcd_server: EtcdServer):
    async def body():
        async with RegistryStore(shared_etcd_server.settings()) as store:
            for tenant in ("del", "del2"):  # "del2" shares the prefix "del"
                await store.create_tenant(Tenant(name=tenant))
                for name in ("x", "y", "z"):
                    await create(store, tenant, name)
            assert [r.name for r in await store.list_adapters("del")] == ["x", "y", "z"]
            everything_before, revision_before = await store.read_all()

            await store.delete_tenant("del")

            everything_after, revision_after = await store.read_all()
            removed = everything_before.keys() - everything_after.keys()
            assert removed == {tenant_key("del")} | {adapter_key("del", n) for n in "xyz"} | {
                version_key("del", n, SHA) for n in "xyz"
            }
            assert revision_after == revision_before + 1  # one transaction
            assert await store.list_adapters("del") == []
            assert [r.name for r in await store.list_adapters("del2")] == ["x", "y", "z"]
            with pytest.raises(NotFound):
                await store.delete_tenant("del")
            names = {(r.tenant, r.name) for r in await store.list_adapters()}
            assert {("del2", "x"), ("del2", "y"), ("del2", "z")} <= names
            assert "del2" in {t.name for t in await store.list_tenants()}

    asyncio.run(body())


@pytest.mark.etcd
def test_etcd_down_raises_unavailable_within_timeout(etcd_server: EtcdServer):
    async def body():
        timeout = 1.0
        async with RegistryStore(etcd_server.settings(timeout_s=timeout)) as store:
            await store.create_tenant(Tenant(name="down"))
            etcd_server.stop(kill=True)
            calls = [
                lambda: store.get_tenant("down"),
                lambda: create(store, "down", "a"),
                lambda: store.list_adapters(),
                lambda: store.delete_tenant("down"),
            ]
            for call in calls:
                started = time.monotonic()
                with pytest.raises(RegistryUnavailable, match=etcd_server.endpoint):
                    await call()
                assert time.monotonic() - started < timeout + 0.5

            etcd_server.start()  # the same store recovers by itself
            assert (await store.get_tenant("down")).name == "down"

    asyncio.run(body())


@pytest.mark.etcd
def test_blackholed_endpoint_times_out_and_next_endpoint_serves(shared_etcd_server: EtcdServer):
    """An endpoint that accepts TCP but never speaks gRPC costs its share of the timeout;
    the store then uses the next endpoint."""
    import socket

    async def body():
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            mute = f"127.0.0.1:{silent.getsockname()[1]}"
            refused = f"127.0.0.1:{free_port()}"

            alone = EtcdSettings(endpoints=[mute], timeout_s=0.5)
            store = RegistryStore(alone)  # not `async with`: that connects, and would raise
            started = time.monotonic()
            results = await asyncio.gather(  # waiting for the connection counts too
                *(store.get_tenant("x") for _ in range(5)), return_exceptions=True
            )
            assert all(isinstance(r, RegistryUnavailable) for r in results), results
            assert time.monotonic() - started < 1.0
            await store.close()

            failover = EtcdSettings(
                endpoints=[refused, mute, shared_etcd_server.endpoint], timeout_s=2.0
            )
            async with RegistryStore(failover) as store:
                await store.create_tenant(Tenant(name="failover"))
                assert (await store.get_tenant("failover")).name == "failover"

    asyncio.run(body())


def test_settings_reject_bad_values():
    with pytest.raises(ValidationError, match="host:port"):
        EtcdSettings(endpoints=["http://etcd:2379"])
    with pytest.raises(ValidationError, match="cert and key"):
        EtcdSettings(cert="/tls/client.pem")
    with pytest.raises(ValidationError, match="username and password"):
        EtcdSettings(username="root")
    assert EtcdSettings(endpoints=["etcd-0.etcd:2379", "[::1]:2379"]).endpoints[1] == "[::1]:2379"


@pytest.mark.etcd
def test_user_password_auth_survives_token_expiry(tmp_path):
    """aetcd logs in once and never renews its token; etcd expires it (here after 1 s idle).
    The store logs in again and resends the refused request."""
    from aetcd import rpc
    from etcd_server import start_etcd

    server = start_etcd(tmp_path / "etcd", extra_args=("--auth-token-ttl", "1"))
    try:

        async def body():
            async with RegistryStore(server.settings()) as admin:
                await admin.create_tenant(Tenant(name="before-auth"))
                client = await admin._connection.client()
                auth = rpc.AuthStub(client.channel)
                await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="s3cret"))
                await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
                await auth.AuthEnable(rpc.AuthEnableRequest())

            settings = EtcdSettings(
                endpoints=[server.endpoint], timeout_s=2.0, username="root", password="s3cret"
            )
            async with RegistryStore(settings) as store:
                assert (await store.get_tenant("before-auth")).name == "before-auth"
                await asyncio.sleep(2.5)  # the token expires
                await store.create_tenant(Tenant(name="after-expiry"))
                assert {t.name for t in await store.list_tenants()} >= {"after-expiry"}

            wrong = settings.model_copy(update={"password": "nope"})
            with pytest.raises(RegistryUnavailable, match="authentication failed"):
                await RegistryStore(wrong).get_tenant("before-auth")
            with pytest.raises(RegistryUnavailable):  # auth is on: anonymous is refused
                await RegistryStore(server.settings()).get_tenant("before-auth")

        asyncio.run(body())
    finally:
        server.stop(kill=True)


@pytest.mark.etcd
def test_mutual_tls(tmp_path):
    from etcd_server import start_etcd, write_test_pki

    pki = write_test_pki(tmp_path / "pki")
    server = start_etcd(tmp_path / "etcd", tls=pki)
    try:

        async def body():
            settings = EtcdSettings(
                endpoints=[server.endpoint],
                timeout_s=2.0,
                ca_cert=str(pki.ca),
                cert=str(pki.client_cert),
                key=str(pki.client_key),
            )
            async with RegistryStore(settings) as store:
                await store.create_tenant(Tenant(name="tls"))
                assert (await store.get_tenant("tls")).name == "tls"
            without_cert = EtcdSettings(
                endpoints=[server.endpoint], timeout_s=1.0, ca_cert=str(pki.ca)
            )
            with pytest.raises(RegistryUnavailable):
                await RegistryStore(without_cert).get_tenant("tls")
            with pytest.raises(RegistryUnavailable):  # plaintext to a TLS port
                await RegistryStore(server.settings(timeout_s=1.0)).get_tenant("tls")

        asyncio.run(body())
    finally:
        server.stop(kill=True)
