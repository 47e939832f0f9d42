"""Adapter versions through the tenant API, against a real etcd: PUT makes a new immutable
version and moves the name to it in one transaction, GET shows the versions, rollback and
canary move the alias, retention prunes the oldest, and every bad input (unknown version,
malformed digest, rollback to a deleted version, another tenant's name) is a clear 4xx that
leaves etcd and the artifact root exactly as they were.

Oracles: the artifact store's own content digest of the uploaded files (a version is that
digest), etcd's keys read directly, and a binomial bound for the canary's share."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd_server import EtcdServer, shared_etcd_server_fixture  # noqa: F401 (fixture)
from fastapi.testclient import TestClient
from test_tenant_api import ADMIN_KEY, Env, api_settings, etcd_state, make_adapter, upload_files

from loraplex.registry.api import create_app
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.models import Adapter, Canary, canary_draw

KEPT = 3


@pytest.fixture(scope="module")
def env(shared_etcd_server: EtcdServer, tmp_path_factory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("versions_api")
    settings = api_settings(tmp, versions_kept=KEPT)
    app = create_app(settings, shared_etcd_server.settings(timeout_s=2.0), tmp / "artifacts")
    with TestClient(app) as client:
        yield Env(client, shared_etcd_server, tmp / "artifacts", tmp, settings)


def digest_of(folder: Path, tmp: Path) -> str:
    """The version the registry must give `folder`: the artifact store's content digest,
    computed by a separate store."""
    return ArtifactStore(tmp / "oracle-store").put_dir(folder).digest


def put(env: Env, headers: dict, route_name: str, folder: Path, **data):
    return env.client.put(
        f"/v1/adapters/{route_name}", data=data, files=upload_files(folder), headers=headers
    )


def version_keys(env: Env, tenant: str, name: str) -> dict[str, bytes]:
    prefix = f"/loraplex/v1/versions/{tenant}/{name}/"
    _, kvs = etcd_state(env.server)
    return {k.removeprefix(prefix): v for k, (_, v) in kvs.items() if k.startswith(prefix)}


@pytest.mark.etcd
def test_put_makes_a_new_version_and_moves_the_name(env: Env):
    tenant = env.new_tenant("put-co")
    one, two = env.adapter_dir("put-1", seed=101), env.adapter_dir("put-2", seed=102, rank=4)
    v1, v2 = digest_of(one, env.tmp), digest_of(two, env.tmp)
    assert v1 != v2

    r = put(env, tenant, "sql", one)  # a new name: created at its first version
    assert r.status_code == 201, r.text
    first = Adapter.model_validate(r.json())
    assert first.version == v1 and first.canary is None

    r = put(env, tenant, "sql", two, pinned="true")
    assert r.status_code == 200, r.text
    moved = Adapter.model_validate(r.json())
    assert (moved.version, moved.rank, moved.pinned) == (v2, 4, True)
    assert moved.artifact == f"sha256/{v2}" and (env.root / moved.artifact).is_dir()
    assert (env.root / first.artifact).is_dir(), "the old version's artifact is kept"
    assert set(version_keys(env, "put-co", "sql")) == {v1, v2}

    detail = env.client.get("/v1/adapters/sql", headers=tenant).json()
    assert detail["version"] == v2
    assert [v["version"] for v in detail["versions"]] == [v2, v1]  # newest first
    assert [v["rank"] for v in detail["versions"]] == [4, 8]
    listed = env.client.get("/v1/adapters/sql/versions", headers=tenant).json()
    assert listed == {"versions": detail["versions"]}
    shown = env.client.get(f"/v1/adapters/sql/versions/{v1}", headers=tenant)
    assert shown.status_code == 200 and shown.json() == detail["versions"][1]

    # the current content again changes nothing; a retained one moves the name back to it
    before = env.state()
    r = put(env, tenant, "sql", two)
    assert r.status_code == 200 and r.json() == moved.model_dump(mode="json")
    assert env.state() == before
    r = put(env, tenant, "sql", one)
    assert r.status_code == 200 and r.json()["version"] == v1
    assert r.json()["pinned"] is True, "pinned, unsent, keeps the name's"
    assert set(version_keys(env, "put-co", "sql")) == {v1, v2}

    # vLLM's alias with load_inplace: a taken name gets a new version
    in_root = make_adapter(env.tmp / "allowed" / "put-co" / "inplace", seed=103)
    r = env.client.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "sql", "lora_path": str(in_root), "load_inplace": True},
        headers=tenant,
    )
    assert r.status_code == 200, r.text
    v3 = digest_of(in_root, env.tmp)
    assert env.client.get("/v1/adapters/sql", headers=tenant).json()["version"] == v3

    # the body may repeat the route's name, never name another
    before = env.state()
    r = put(env, tenant, "sql", two, name="other")
    assert r.status_code == 422 and "the body names adapter 'other'" in r.json()["detail"]
    assert env.state() == before


@pytest.mark.etcd
def test_rollback_and_bad_version_input(env: Env):
    tenant = env.new_tenant("roll-co")
    folders = [env.adapter_dir(f"roll-{i}", seed=200 + i) for i in range(3)]
    versions = [digest_of(f, env.tmp) for f in folders]
    for folder in folders:
        assert put(env, tenant, "chat", folder).status_code in (200, 201)

    def current() -> str:
        return env.client.get("/v1/adapters/chat", headers=tenant).json()["version"]

    assert current() == versions[2]
    r = env.client.post("/v1/adapters/chat/rollback", headers=tenant)  # to the one before
    assert r.status_code == 200, r.text
    assert r.json()["version"] == current() == versions[1]
    r = env.client.post("/v1/adapters/chat/rollback", json={"version": versions[2]}, headers=tenant)
    assert r.status_code == 200 and current() == versions[2]

    # a retained version the name does not serve can be deleted; then it is gone
    r = env.client.delete(f"/v1/adapters/chat/versions/{versions[0]}", headers=tenant)
    assert r.status_code == 200 and r.json()["version"] == versions[0]
    assert not (env.root / f"sha256/{versions[0]}").exists()
    assert set(version_keys(env, "roll-co", "chat")) == set(versions[1:])

    before = env.state()
    unknown = "e" * 64
    refusals = [
        # rollback to a deleted version, and to one never registered
        (
            env.client.post(
                "/v1/adapters/chat/rollback", json={"version": versions[0]}, headers=tenant
            ),
            404,
            f"version {versions[0]} of adapter 'chat' not found",
        ),
        (
            env.client.post(
                "/v1/adapters/chat/rollback", json={"version": unknown}, headers=tenant
            ),
            404,
            f"version {unknown} of adapter 'chat' not found",
        ),
        # malformed digests, in the body and in the path
        (
            env.client.post("/v1/adapters/chat/rollback", json={"version": "ABC"}, headers=tenant),
            422,
            "version",
        ),
        (env.client.get("/v1/adapters/chat/versions/xyz", headers=tenant), 422, "version"),
        (env.client.get(f"/v1/adapters/chat/versions/{unknown}", headers=tenant), 404, unknown),
        # the version the name serves cannot be deleted
        (
            env.client.delete(f"/v1/adapters/chat/versions/{versions[2]}", headers=tenant),
            409,
            "current version",
        ),
        # unknown names
        (env.client.post("/v1/adapters/nope/rollback", headers=tenant), 404, "'nope' not found"),
        (env.client.get("/v1/adapters/nope/versions", headers=tenant), 404, "'nope' not found"),
        # rollback with a body of the wrong shape
        (
            env.client.post("/v1/adapters/chat/rollback", json={"version": 5}, headers=tenant),
            422,
            "version",
        ),
    ]
    for response, status, words in refusals:
        assert response.status_code == status, (response.request.url, response.text)
        assert words in str(response.json()["detail"]), response.text
    assert env.state() == before

    # only one version left behind the current one: rollback goes there, then has nowhere
    r = env.client.post("/v1/adapters/chat/rollback", headers=tenant)
    assert r.status_code == 200 and current() == versions[1]
    before = env.state()
    r = env.client.post("/v1/adapters/chat/rollback", headers=tenant)
    assert r.status_code == 409 and "no version older" in r.json()["detail"]
    assert env.state() == before


@pytest.mark.etcd
def test_canary_serves_a_share_by_request_id(env: Env):
    tenant = env.new_tenant("canary-co")
    old, new = env.adapter_dir("can-1", seed=301), env.adapter_dir("can-2", seed=302)
    v_old, v_new = digest_of(old, env.tmp), digest_of(new, env.tmp)
    put(env, tenant, "bot", old)
    put(env, tenant, "bot", new)

    before = env.state()
    for body, status in [
        ({"version": v_new, "weight": 0.25}, 422),  # the current version
        ({"version": "d" * 64, "weight": 0.25}, 404),  # not a version of this name
        ({"version": v_old, "weight": 0.0}, 422),
        ({"version": v_old, "weight": 1.0}, 422),
        ({"version": v_old}, 422),
        ({"version": v_old[:10], "weight": 0.5}, 422),
    ]:
        r = env.client.put("/v1/adapters/bot/canary", json=body, headers=tenant)
        assert r.status_code == status, (body, r.text)
    assert env.state() == before

    r = env.client.put(
        "/v1/adapters/bot/canary", json={"version": v_old, "weight": 0.25}, headers=tenant
    )
    assert r.status_code == 200, r.text
    record = Adapter.model_validate(r.json()).alias
    assert record.version == v_new and record.canary == Canary(version=v_old, weight=0.25)
    # the version deleted from under a canary: refused while it serves
    r = env.client.delete(f"/v1/adapters/bot/versions/{v_old}", headers=tenant)
    assert r.status_code == 409 and "canary" in r.json()["detail"]

    # the share each version gets, as the ingress resolves it (the watcher's record)
    ids = [f"cmpl-{i}" for i in range(4000)]
    chosen = [record.version_for(i) for i in ids]
    share = chosen.count(v_old) / len(ids)
    assert abs(share - 0.25) < 4 * math.sqrt(0.25 * 0.75 / len(ids)), share
    assert set(chosen) == {v_old, v_new}
    assert [record.version_for(i) for i in ids] == chosen  # per request id, every time
    assert all((canary_draw(i) < 0.25) == (c == v_old) for i, c in zip(ids, chosen, strict=True))

    r = env.client.delete("/v1/adapters/bot/canary", headers=tenant)
    assert r.status_code == 200 and r.json()["canary"] is None
    ended = Adapter.model_validate(r.json()).alias
    assert {ended.version_for(i) for i in ids} == {v_new}
    # a rollback also ends a canary
    env.client.put(
        "/v1/adapters/bot/canary", json={"version": v_old, "weight": 0.5}, headers=tenant
    )
    r = env.client.post("/v1/adapters/bot/rollback", json={"version": v_old}, headers=tenant)
    assert r.json()["version"] == v_old and r.json()["canary"] is None


@pytest.mark.etcd
def test_retention_keeps_the_newest_and_releases_the_rest(env: Env):
    tenant = env.new_tenant("keep-co")
    folders = [env.adapter_dir(f"keep-{i}", seed=400 + i) for i in range(KEPT + 2)]
    versions = [digest_of(f, env.tmp) for f in folders]
    for folder in folders:
        assert put(env, tenant, "gen", folder).status_code in (200, 201)
    kept = versions[-KEPT:]
    shown = env.client.get("/v1/adapters/gen", headers=tenant).json()["versions"]
    assert [v["version"] for v in shown] == kept[::-1]
    assert set(version_keys(env, "keep-co", "gen")) == set(kept)
    for gone in versions[:-KEPT]:
        assert not (env.root / f"sha256/{gone}").exists()
    for held in kept:
        assert (env.root / f"sha256/{held}").is_dir()
    # rolled back to the oldest kept, then a new one: the version it served is kept (a
    # rollback after a bad push is always possible), the oldest other one goes
    env.client.post("/v1/adapters/gen/rollback", json={"version": kept[0]}, headers=tenant)
    extra = env.adapter_dir("keep-extra", seed=499)
    assert put(env, tenant, "gen", extra).status_code == 200
    left = set(version_keys(env, "keep-co", "gen"))
    assert left == {kept[0], kept[2], digest_of(extra, env.tmp)}, "kept[1] should have gone"

    # deleting the name deletes every version and its artifacts
    assert env.client.delete("/v1/adapters/gen", headers=tenant).status_code == 200
    assert version_keys(env, "keep-co", "gen") == {}
    for v in left:
        assert not (env.root / f"sha256/{v}").exists()


@pytest.mark.etcd
def test_another_tenants_names_and_versions_are_404(env: Env):
    owner, other = env.new_tenant("own-co"), env.new_tenant("peek-co")
    one, two = env.adapter_dir("own-1", seed=501), env.adapter_dir("own-2", seed=502)
    put(env, owner, "secret", one)
    put(env, owner, "secret", two)
    v1 = digest_of(one, env.tmp)
    before = env.state()
    for method, path, body in [
        ("GET", "/v1/adapters/secret", None),
        ("GET", "/v1/adapters/secret/versions", None),
        ("GET", f"/v1/adapters/secret/versions/{v1}", None),
        ("DELETE", f"/v1/adapters/secret/versions/{v1}", None),
        ("POST", "/v1/adapters/secret/rollback", {"version": v1}),
        ("PUT", "/v1/adapters/secret/canary", {"version": v1, "weight": 0.5}),
        ("DELETE", "/v1/adapters/secret/canary", None),
    ]:
        r = env.client.request(method, path, json=body, headers=other)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["detail"] == "adapter 'secret' not found"
    assert env.state() == before
    # the same name under the other tenant is its own adapter, at its own first version
    r = put(env, other, "secret", one)
    assert r.status_code == 201 and r.json()["tenant"] == "peek-co"
    assert env.client.get("/v1/adapters/secret", headers=owner).json()["tenant"] == "own-co"


@pytest.mark.etcd
def test_the_api_collects_unreferenced_artifacts_periodically(
    shared_etcd_server: EtcdServer, tmp_path: Path
):
    """The lifespan's task removes an artifact no alias or version refers to once it is older
    than gc_min_age_s, and keeps every referenced one. (An age of 0 would let a round remove
    an upload's temp folder while it is being written: the age guard is what spares
    registrations in flight, so the orphan is aged instead.)"""
    settings = api_settings(tmp_path, gc_interval_s=0.2, gc_min_age_s=600.0)
    root = tmp_path / "artifacts"
    app = create_app(settings, shared_etcd_server.settings(timeout_s=2.0), root)
    with TestClient(app) as client:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        r = client.post("/v1/tenants", json={"name": "gc-co"}, headers=admin)
        tenant = {"Authorization": f"Bearer {r.json()['api_key']}"}
        kept = [make_adapter(tmp_path / "src" / f"gc-{i}", seed=600 + i) for i in range(2)]
        for folder in kept:
            r = client.put("/v1/adapters/held", files=upload_files(folder), headers=tenant)
            assert r.status_code in (200, 201), r.text
        orphan = ArtifactStore(root).put_dir(make_adapter(tmp_path / "src" / "orphan", seed=699))
        time.sleep(1.0)  # rounds meanwhile keep the orphan: younger than gc_min_age_s
        assert (root / orphan.path).exists()
        an_hour_ago = time.time() - 3600
        os.utime(root / orphan.path, (an_hour_ago, an_hour_ago))
        deadline = time.monotonic() + 10
        while (root / orphan.path).exists():
            assert time.monotonic() < deadline, "the periodic gc never removed the orphan"
            time.sleep(0.1)
        for folder in kept:
            assert (root / f"sha256/{digest_of(folder, tmp_path)}").is_dir()
        client.delete("/v1/tenants/gc-co", headers=admin)


def test_canary_draw_is_a_uniform_function_of_the_request_id():
    """The draw is the same in every process (blake2b, not hash()) and uniform: a
    chi-square test over 10 bins at the 0.1% level (critical value 27.88, 9 dof)."""
    draws = [canary_draw(f"req-{i}") for i in range(20000)]
    assert draws == [canary_draw(f"req-{i}") for i in range(20000)]
    assert all(0.0 <= d < 1.0 for d in draws)
    counts = [0] * 10
    for d in draws:
        counts[int(d * 10)] += 1
    expected = len(draws) / 10
    chi2 = sum((c - expected) ** 2 / expected for c in counts)
    assert chi2 < 27.88, counts
