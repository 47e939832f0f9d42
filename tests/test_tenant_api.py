"""The tenant API against a real etcd: tenants and keys, registration by upload, archive and
path, tenant isolation, concurrency, etcd outages, and every bad-input class.

A refusal must answer the right 4xx with a message naming the problem, and leave both etcd
(keys, values and revision) and the artifact root exactly as they were."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aetcd
import httpx
import pytest
import torch
from etcd_server import EtcdServer, etcd_server_fixture, shared_etcd_server_fixture  # noqa: F401 (fixtures)
from fastapi.testclient import TestClient
from http_server import serve
from tiny_model import BASE, SPEC

from loraplex.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from loraplex.demo.synthetic import AdapterSpec, ModelSpec, write_adapter
from loraplex.registry.api import RegistryAPISettings, create_app
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.auth import hash_api_key
from loraplex.registry.models import Adapter
from loraplex.registry.service import collect_garbage
from loraplex.registry.store import RegistryStore
from loraplex.registry.view import StoredView, WatchedView

pytestmark = pytest.mark.etcd

ADMIN_KEY = "admin-key-for-the-tests-0123456789"
MAX_ADAPTER_BYTES = 200 << 10
MAX_UPLOAD_BYTES = 1 << 20
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def api_settings(tmp: Path, **overrides) -> RegistryAPISettings:
    fields = dict(
        admin_key=ADMIN_KEY,
        base_model_id="loraplex-demo-llama",
        base_model=BASE,
        max_lora_rank=32,
        max_adapter_bytes=MAX_ADAPTER_BYTES,
        max_upload_bytes=MAX_UPLOAD_BYTES,
        allowed_roots=[str(tmp / "allowed")],
        staging_dir=str(tmp / "staging"),
    )
    (tmp / "allowed").mkdir(exist_ok=True)
    (tmp / "staging").mkdir(exist_ok=True)
    return RegistryAPISettings(**(fields | overrides))


def make_adapter(
    path: Path, *, rank=8, alpha=16.0, targets=("q_proj", "v_proj"), seed=1, spec=SPEC, **kwargs
) -> Path:
    write_adapter(path, spec, AdapterSpec(path.name, rank, alpha, targets, seed=seed), **kwargs)
    return path


def upload_files(path: Path, names=(CONFIG_FILE, WEIGHTS_FILE)) -> dict:
    fields = ("adapter_config", "adapter_model")
    return {
        field: (name, (path / name).read_bytes()) for field, name in zip(fields, names, strict=True)
    }


def tar_gz(path: Path, folder: str = "adapter") -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tf:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            tf.add(path / name, arcname=f"{folder}/{name}")
    return raw.getvalue()


def etcd_state(server: EtcdServer) -> tuple[int, dict[str, tuple[int, bytes]]]:
    """(revision, {key: (mod_revision, value)}) of everything under the registry prefix."""

    async def read():
        host, _, port = server.endpoint.rpartition(":")
        async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
            result = await client.get_prefix(b"/loraplex/v1/")
            kvs = {kv.key.decode(): (kv.mod_revision, kv.value) for kv in result.kvs}
            return result.header.revision, kvs

    return asyncio.run(read())


def tree(root: Path) -> list[tuple[str, int]]:
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")
    )


@dataclass
class Env:
    client: TestClient
    server: EtcdServer
    root: Path  # artifact root
    tmp: Path
    settings: RegistryAPISettings
    keys: dict[str, dict] = field(default_factory=dict)  # tenant keys shared across tests

    @property
    def admin(self) -> dict:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    def new_tenant(self, name: str, quota: int = 100) -> dict:
        r = self.client.post(
            "/v1/tenants", json={"name": name, "adapter_quota": quota}, headers=self.admin
        )
        assert r.status_code == 201, r.text
        return {"Authorization": f"Bearer {r.json()['api_key']}"}

    def state(self):
        return etcd_state(self.server), tree(self.root)

    def adapter_dir(self, name: str, **kwargs) -> Path:
        return make_adapter(self.tmp / "adapters" / name, **kwargs)

    def register(self, headers: dict, name: str, path: Path, **data) -> httpx.Response:
        return self.client.post(
            "/v1/adapters", data={"name": name, **data}, files=upload_files(path), headers=headers
        )


@pytest.fixture(scope="module")
def env(shared_etcd_server: EtcdServer, tmp_path_factory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("tenant_api")
    settings = api_settings(tmp)
    app = create_app(settings, shared_etcd_server.settings(timeout_s=2.0), tmp / "artifacts")
    with TestClient(app) as client:
        yield Env(client, shared_etcd_server, tmp / "artifacts", tmp, settings)


# ---------------------------------------------------------------- tenants and keys


def test_admin_creates_tenants_and_keys_are_stored_hashed(env: Env):
    r = env.client.post(
        "/v1/tenants", json={"name": "keys-co", "adapter_quota": 7}, headers=env.admin
    )
    assert r.status_code == 201, r.text
    body = r.json()
    key = body["api_key"]
    assert body["tenant"] == {
        "name": "keys-co",
        "adapter_quota": 7,
        "created_at": pytest.approx(time.time(), abs=60),
        "api_keys": 1,
        "limits": {"max_requests_in_flight": None, "tokens_per_minute": None},
    }
    _, kvs = etcd_state(env.server)
    stored = json.loads(kvs["/loraplex/v1/tenants/keys-co"][1])
    assert stored["api_key_hashes"] == [hashlib.sha256(key.encode()).hexdigest()]
    assert all(key.encode() not in value for _, value in kvs.values())

    tenant = {"Authorization": f"Bearer {key}"}
    assert env.client.get("/v1/adapters", headers=tenant).json() == {"adapters": []}
    names = [t["name"] for t in env.client.get("/v1/tenants", headers=env.admin).json()["tenants"]]
    assert "keys-co" in names

    r = env.client.post("/v1/tenants", json={"name": "keys-co"}, headers=env.admin)
    assert (r.status_code, r.json()["detail"]) == (409, "tenant 'keys-co' already exists")
    r = env.client.post("/v1/tenants", json={"name": "Bad Name"}, headers=env.admin)
    assert r.status_code == 422 and "name" in json.dumps(r.json()["detail"])

    second = env.client.post("/v1/tenants/keys-co/keys", headers=env.admin)
    assert second.status_code == 201 and second.json()["tenant"]["api_keys"] == 2
    new = {"Authorization": f"Bearer {second.json()['api_key']}"}
    assert env.client.get("/v1/adapters", headers=new).status_code == 200
    assert env.client.get("/v1/adapters", headers=tenant).status_code == 200
    rotated = env.client.post(
        "/v1/tenants/keys-co/keys", json={"revoke_existing": True}, headers=env.admin
    )
    assert rotated.json()["tenant"]["api_keys"] == 1
    assert env.client.get("/v1/adapters", headers=tenant).status_code == 401
    assert env.client.get("/v1/adapters", headers=new).status_code == 401
    assert (
        env.client.get(
            "/v1/adapters", headers={"Authorization": f"Bearer {rotated.json()['api_key']}"}
        ).status_code
        == 200
    )
    assert env.client.post("/v1/tenants/nobody/keys", headers=env.admin).status_code == 404


def test_authentication_errors(env: Env):
    tenant = env.new_tenant("auth-co")
    cases = [
        ("get", "/v1/adapters", {}, 401, "missing API key: send 'Authorization: Bearer <key>'"),
        ("get", "/v1/adapters", {"Authorization": "Basic abc"}, 401, "missing API key"),
        ("get", "/v1/adapters", {"Authorization": "Bearer lpx_wrong"}, 401, "invalid API key"),
        ("get", "/v1/adapters", env.admin, 403, "needs a tenant API key"),
        ("get", "/v1/tenants", tenant, 403, "needs the admin key"),
        ("post", "/v1/tenants", tenant, 403, "needs the admin key"),
        ("delete", "/v1/tenants/auth-co", tenant, 403, "needs the admin key"),
        ("get", "/v1/tenants", {"Authorization": "Bearer nope"}, 401, "invalid API key"),
    ]
    for method, url, headers, status, message in cases:
        r = env.client.request(
            method, url, headers=headers, json={"name": "x"} if method == "post" else None
        )
        assert r.status_code == status, (url, headers, r.text)
        assert message in r.json()["detail"]
        if status == 401:
            assert r.headers["www-authenticate"] == "Bearer"


# ---------------------------------------------------------------- registration


def test_upload_list_get_delete(env: Env):
    tenant = env.new_tenant("life-co")
    src = env.adapter_dir(
        "sql", rank=12, alpha=24.0, targets=("v_proj", "q_proj", "down_proj"), dtype=torch.bfloat16
    )
    r = env.register(tenant, "sql", src, pinned="true")
    assert r.status_code == 201, r.text
    record = Adapter.model_validate(r.json())
    assert (record.name, record.tenant, record.base_model) == (
        "sql",
        "life-co",
        "loraplex-demo-llama",
    )
    assert (record.rank, record.alpha, record.use_rslora, record.pinned) == (12, 24.0, False, True)
    assert record.target_modules == ["q_proj", "v_proj", "down_proj"]
    assert record.dtype == "bfloat16"
    assert record.size_bytes == (src / WEIGHTS_FILE).stat().st_size
    assert record.sha256 == hashlib.sha256((src / WEIGHTS_FILE).read_bytes()).hexdigest()
    stored = env.root / record.artifact
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (stored / name).read_bytes() == (src / name).read_bytes()
    assert list((env.root / "tmp").iterdir()) == [] and list((env.tmp / "staging").iterdir()) == []

    assert env.client.get("/v1/adapters", headers=tenant).json() == {"adapters": [r.json()]}
    detail = env.client.get("/v1/adapters/sql", headers=tenant).json()
    (version,) = detail.pop("versions")
    assert detail == r.json()
    assert version["version"] == record.version == record.artifact.removeprefix("sha256/")
    assert {k: version[k] for k in ("rank", "artifact", "sha256")} == {
        k: detail[k] for k in ("rank", "artifact", "sha256")
    }
    _, kvs = etcd_state(env.server)
    alias = json.loads(kvs["/loraplex/v1/adapters/life-co/sql"][1])  # names its version only
    assert alias == {"name": "sql", "tenant": "life-co", "version": record.version} | {
        "pinned": True,
        "canary": None,
    }
    stored_version = json.loads(kvs[f"/loraplex/v1/versions/life-co/sql/{record.version}"][1])
    assert stored_version["artifact"] == record.artifact

    deleted = env.client.delete("/v1/adapters/sql", headers=tenant)
    assert deleted.status_code == 200 and deleted.json()["name"] == "sql"
    assert not stored.exists()
    assert not [k for k in etcd_state(env.server)[1] if "/life-co/" in k]  # alias and versions
    assert env.client.get("/v1/adapters/sql", headers=tenant).status_code == 404
    r = env.client.delete("/v1/adapters/sql", headers=tenant)
    assert (r.status_code, r.json()["detail"]) == (404, "adapter 'sql' not found")


def test_archive_path_and_vllm_routes(env: Env):
    tenant = env.new_tenant("routes-co")
    src = env.adapter_dir("arch", rank=4, targets=ALL, seed=3)
    r = env.client.post(
        "/v1/adapters",
        data={"name": "from-archive"},
        files={"archive": ("a.tar.gz", tar_gz(src))},
        headers=tenant,
    )
    assert r.status_code == 201, r.text
    assert r.json()["target_modules"] == list(ALL)

    in_root = make_adapter(env.tmp / "allowed" / "routes-co" / "team" / "by-path", seed=4)
    r = env.client.post(
        "/v1/adapters", json={"name": "by-path", "path": str(in_root)}, headers=tenant
    )
    assert r.status_code == 201, r.text
    assert (env.root / r.json()["artifact"] / WEIGHTS_FILE).read_bytes() == (
        in_root / WEIGHTS_FILE
    ).read_bytes()

    r = env.client.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "vllm-style", "lora_path": str(in_root)},
        headers=tenant,
    )
    assert (r.status_code, r.text) == (
        200,
        "Success: LoRA adapter 'vllm-style' added successfully.",
    )
    names = [a["name"] for a in env.client.get("/v1/adapters", headers=tenant).json()["adapters"]]
    assert names == ["by-path", "from-archive", "vllm-style"]
    # the same bytes under two names share one artifact, which outlives the first delete
    records = {
        a["name"]: a for a in env.client.get("/v1/adapters", headers=tenant).json()["adapters"]
    }
    assert records["by-path"]["artifact"] == records["vllm-style"]["artifact"]
    r = env.client.post("/v1/unload_lora_adapter", json={"lora_name": "vllm-style"}, headers=tenant)
    assert (r.status_code, r.text) == (
        200,
        "Success: LoRA adapter 'vllm-style' removed successfully.",
    )
    assert (env.root / records["by-path"]["artifact"]).is_dir()
    r = env.client.post("/v1/unload_lora_adapter", json={"lora_name": "vllm-style"}, headers=tenant)
    assert r.status_code == 404
    r = env.client.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "by-path", "lora_path": str(in_root)},
        headers=tenant,
    )
    assert r.status_code == 409, "without load_inplace a taken name is refused"


def test_duplicate_name_and_quota(env: Env):
    tenant = env.new_tenant("quota-co", quota=1)
    assert env.register(tenant, "one", env.adapter_dir("q1", seed=11)).status_code == 201
    before = env.state()
    r = env.register(tenant, "one", env.adapter_dir("q2", seed=12))
    assert (r.status_code, r.json()["detail"]) == (409, "adapter 'one' already exists")
    r = env.register(tenant, "two", env.adapter_dir("q3", seed=13))
    assert r.status_code == 409
    assert (
        r.json()["detail"] == "quota of 1 adapters reached for tenant 'quota-co'; delete one first"
    )
    assert env.state() == before


def test_a_lost_race_at_the_transaction_releases_its_artifact(env: Env, monkeypatch):
    """The pre-check passes for both, so the etcd transaction decides: the loser's freshly
    stored artifact must be removed again, the winner's untouched."""
    tenant = env.new_tenant("txn-race")
    assert env.register(tenant, "same", env.adapter_dir("t1", seed=21)).status_code == 201
    before = env.state()
    store = env.client.app.state.store

    async def nothing_there(tenant, name):
        return None

    monkeypatch.setattr(store, "get_adapter", nothing_there)
    r = env.register(tenant, "same", env.adapter_dir("t2", seed=22))
    assert (r.status_code, r.json()["detail"]) == (409, "adapter 'same' already exists")
    assert env.state() == before


# ---------------------------------------------------------------- bad input changes nothing


@dataclass(frozen=True)
class BadCase:
    id: str
    status: int
    message: str
    request: Callable[[Env, dict], httpx.Response]


def _upload(env: Env, tenant: dict, name: str, path: Path, **kwargs) -> httpx.Response:
    return env.register(tenant, name, path, **kwargs)


def _bad_adapter(
    prepare: Callable[[Path], None], **adapter_kwargs
) -> Callable[[Env, dict], httpx.Response]:
    def request(env: Env, tenant: dict) -> httpx.Response:
        path = env.adapter_dir(f"bad-{time.monotonic_ns()}", **adapter_kwargs)
        prepare(path)
        return env.register(tenant, "bad", path)

    return request


def _edit_config(**changes) -> Callable[[Path], None]:
    def prepare(path: Path) -> None:
        config = json.loads((path / CONFIG_FILE).read_text())
        (path / CONFIG_FILE).write_text(json.dumps(config | changes))

    return prepare


def _weights(data: bytes) -> Callable[[Path], None]:
    return lambda path: (path / WEIGHTS_FILE).write_bytes(data)


def _nested_header(depth: int) -> bytes:
    header = b'{"__metadata__": {"x": ' + b"[" * depth + b"]" * depth + b"}}"
    return len(header).to_bytes(8, "little") + header


def _torch_pickle(path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, path / WEIGHTS_FILE)


def _nan(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / WEIGHTS_FILE)
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, path / WEIGHTS_FILE)


def _drop_b(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / WEIGHTS_FILE)
    tensors.pop("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight")
    save_file(tensors, path / WEIGHTS_FILE)


def _archive(members: list[tuple[str, bytes, bytes]]) -> Callable[[Env, dict], httpx.Response]:
    """members: (name, tar type, data or link target)."""

    def request(env: Env, tenant: dict) -> httpx.Response:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tf:
            for name, kind, data in members:
                info = tarfile.TarInfo(name)
                info.type = kind
                if kind == tarfile.REGTYPE:
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
                else:
                    info.linkname = data.decode()
                    tf.addfile(info)
        body = gzip.compress(raw.getvalue())
        return env.client.post(
            "/v1/adapters", data={"name": "bad"}, files={"archive": ("a.tgz", body)}, headers=tenant
        )

    return request


def _bomb(env: Env, tenant: dict) -> httpx.Response:
    info = tarfile.TarInfo(WEIGHTS_FILE)
    info.size = 64 << 20
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tf:
        tf.addfile(info, io.BytesIO(bytes(info.size)))
    body = gzip.compress(raw.getvalue(), 9)
    assert len(body) < MAX_UPLOAD_BYTES
    return env.client.post(
        "/v1/adapters", data={"name": "bad"}, files={"archive": ("a.tgz", body)}, headers=tenant
    )


def _by_path(
    path_of: Callable[[Env], str], name: str = "bad"
) -> Callable[[Env, dict], httpx.Response]:
    return lambda env, tenant: env.client.post(
        "/v1/adapters", json={"name": name, "path": path_of(env)}, headers=tenant
    )


def _outside(env: Env) -> str:
    return str(make_adapter(env.tmp / "outside" / "secret"))


def _symlink_escape(env: Env) -> str:
    link = env.tmp / "allowed" / "bad-co" / f"escape-{time.monotonic_ns()}"
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(_outside(env))
    return str(link)


def _link_loop(env: Env) -> str:
    loop = env.tmp / "allowed" / "bad-co" / f"loop-{time.monotonic_ns()}"
    loop.parent.mkdir(exist_ok=True)
    loop.symlink_to(loop.name)
    return str(loop)


def _chunked_oversize(env: Env, tenant: dict) -> httpx.Response:
    boundary = "b0undary"

    def body():
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="adapter_model"; filename="m"\r\n\r\n'.encode()
        for _ in range(20):
            yield bytes(64 << 10)
        yield f"\r\n--{boundary}--\r\n".encode()

    headers = tenant | {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    return env.client.post("/v1/adapters", content=body(), headers=headers)


def _fields(data: dict, files: dict | None = None) -> Callable[[Env, dict], httpx.Response]:
    def request(env: Env, tenant: dict) -> httpx.Response:
        src = env.adapter_dir(f"ok-{time.monotonic_ns()}")
        sent = upload_files(src) if files is None else files
        return env.client.post("/v1/adapters", data=data, files=sent, headers=tenant)

    return request


VALID = ("q_proj", "v_proj")
BAD_CASES = [
    # safetensors
    BadCase(
        "header-bomb",
        400,
        "header length field says 1152921504606846976 bytes but only 2 follow",
        _bad_adapter(_weights((1 << 60).to_bytes(8, "little") + b"{}")),
    ),
    BadCase(
        "not-safetensors",
        400,
        "adapter_model.safetensors is not a safetensors file",
        _bad_adapter(_weights(b"garbage, not a safetensors file")),
    ),
    BadCase("pickle-content", 422, "looks like a PyTorch pickle", _bad_adapter(_torch_pickle)),
    BadCase(
        "bad-dtype",
        422,
        "dtype 'I64'; accepted: F32, F16, BF16",
        _bad_adapter(
            _weights(
                b"\x48\x00\x00\x00\x00\x00\x00\x00"
                + json.dumps({"t": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})
                .encode()
                .ljust(72)
                + bytes(8)
            )
        ),
    ),
    BadCase("nan", 422, "holds NaN or infinite values", _bad_adapter(_nan)),
    # adapter_config.json
    BadCase(
        "config-json",
        400,
        "adapter_config.json is not valid JSON",
        _bad_adapter(lambda p: (p / CONFIG_FILE).write_text("{")),
    ),
    BadCase(
        "config-nested-too-deeply",
        400,
        "adapter_config.json is not valid JSON: nested too deeply",
        _bad_adapter(lambda p: (p / CONFIG_FILE).write_text("[" * 30000 + "]" * 30000)),
    ),
    BadCase(
        "header-nested-too-deeply",
        400,
        "safetensors header is not valid JSON: nested too deeply",
        _bad_adapter(_weights(_nested_header(20_000))),
    ),
    BadCase(
        "rank-over-max",
        422,
        "r must be an integer in 1..32 (the server's max_lora_rank), found 48",
        _bad_adapter(lambda p: None, rank=48),
    ),
    BadCase(
        "unsupported-target",
        422,
        "unsupported target_modules ['embed_tokens']",
        _bad_adapter(_edit_config(target_modules=["q_proj", "v_proj", "embed_tokens"])),
    ),
    BadCase(
        "dora", 422, "unsupported options: use_dora", _bad_adapter(_edit_config(use_dora=True))
    ),
    BadCase(
        "peft-type",
        422,
        "peft_type must be 'LORA', found 'PREFIX_TUNING'",
        _bad_adapter(_edit_config(peft_type="PREFIX_TUNING")),
    ),
    # tensors against the base model
    BadCase(
        "wrong-base",
        422,
        "has shape [8, 96]; expected [8, 64]",
        _bad_adapter(
            lambda p: None,
            spec=ModelSpec(
                hidden_size=96,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
            ),
        ),
    ),
    BadCase(
        "too-deep",
        422,
        "layer 2 but the base model has 2 layers",
        _bad_adapter(
            lambda p: None,
            spec=ModelSpec(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
            ),
        ),
    ),
    BadCase("missing-b", 422, "layer 0 v_proj: lora_B is missing", _bad_adapter(_drop_b)),
    # sizes
    BadCase(
        "adapter-too-large",
        413,
        f"the limit is {MAX_ADAPTER_BYTES} (max_adapter_bytes)",
        _bad_adapter(lambda p: None, rank=32, targets=ALL),
    ),
    BadCase(
        "upload-too-large",
        413,
        f"exceeds the limit of {MAX_UPLOAD_BYTES} bytes (max_upload_bytes)",
        lambda env, t: env.client.post(
            "/v1/adapters",
            data={"name": "bad"},
            files={"adapter_model": ("m", bytes(MAX_UPLOAD_BYTES))},
            headers=t,
        ),
    ),
    BadCase(
        "chunked-too-large",
        413,
        f"upload exceeds {MAX_UPLOAD_BYTES} bytes (max_upload_bytes)",
        _chunked_oversize,
    ),
    # the form
    BadCase(
        "pickle-filename",
        422,
        "'adapter_model.bin': pickle weights are refused",
        lambda env, t: env.client.post(
            "/v1/adapters",
            data={"name": "bad"},
            files={
                "adapter_config": ("adapter_config.json", b"{}"),
                "adapter_model": ("adapter_model.bin", b"\x80\x04"),
            },
            headers=t,
        ),
    ),
    BadCase(
        "missing-file",
        400,
        "missing file field(s) ['adapter_model']",
        _fields({"name": "bad"}, {"adapter_config": ("c.json", b"{}")}),
    ),
    BadCase(
        "unexpected-field",
        400,
        "unexpected form field 'weights'; accepted: name, pinned",
        _fields({"name": "bad"}, {"weights": ("w", b"x")}),
    ),
    BadCase("bad-name", 422, "adapter name 'Bad/Name' must match", _fields({"name": "Bad/Name"})),
    BadCase("no-name", 422, "form field 'name' is required", _fields({})),
    BadCase(
        "bad-pinned",
        422,
        "form field 'pinned' must be true or false, found 'maybe'",
        _fields({"name": "bad", "pinned": "maybe"}),
    ),
    BadCase(
        "unsupported-media",
        415,
        "send multipart/form-data (an upload) or application/json",
        lambda env, t: env.client.post(
            "/v1/adapters", content=b"name=x", headers=t | {"Content-Type": "text/plain"}
        ),
    ),
    # archives
    BadCase(
        "archive-dotdot",
        400,
        "contains '..'; path traversal is refused",
        _archive([("../adapter_config.json", tarfile.REGTYPE, b"{}")]),
    ),
    BadCase(
        "archive-absolute",
        400,
        "has an absolute path",
        _archive([("/tmp/adapter_config.json", tarfile.REGTYPE, b"{}")]),
    ),
    BadCase(
        "archive-symlink",
        400,
        "is a symlink; only regular files are accepted",
        _archive([(WEIGHTS_FILE, tarfile.SYMTYPE, b"/etc/passwd")]),
    ),
    BadCase(
        "archive-hardlink",
        400,
        "is a hard link",
        _archive([(WEIGHTS_FILE, tarfile.LNKTYPE, b"/etc/passwd")]),
    ),
    BadCase(
        "archive-extra",
        400,
        "'run.sh' is not accepted",
        _archive([("run.sh", tarfile.REGTYPE, b"rm -rf /")]),
    ),
    BadCase("archive-bomb", 413, f"exceed {MAX_ADAPTER_BYTES} bytes", _bomb),
    BadCase(
        "archive-and-files",
        400,
        "send either 'archive' or the files",
        _fields({"name": "bad"}, {"archive": ("a", b"x"), "adapter_config": ("c", b"{}")}),
    ),
    BadCase(
        "archive-not-gzip",
        400,
        "archive is not a valid tar.gz",
        _fields({"name": "bad"}, {"archive": ("a.tgz", b"plain text")}),
    ),
    # registration by path
    BadCase("path-outside", 400, "is not in your folder of an allowed root", _by_path(_outside)),
    BadCase(
        "path-symlink-escape", 400, "leads outside the tenant's folder", _by_path(_symlink_escape)
    ),
    BadCase(
        "path-dotdot",
        400,
        "leads outside the tenant's folder",
        _by_path(lambda env: f"{env.tmp}/allowed/bad-co/../outside"),
    ),
    BadCase(
        "path-other-tenant",
        400,
        "tenant 'bad-co' may register only from <allowed root>/bad-co/",
        _by_path(lambda env: str(make_adapter(env.tmp / "allowed" / "other-co" / "theirs"))),
    ),
    BadCase("path-link-loop", 400, "too many symbolic links", _by_path(_link_loop)),
    BadCase("path-relative", 400, "must be an absolute path", _by_path(lambda env: "allowed/x")),
    BadCase(
        "path-missing",
        400,
        "is not a folder",
        _by_path(lambda env: f"{env.tmp}/allowed/bad-co/nope"),
    ),
    BadCase(
        "json-body",
        422,
        "invalid request body: path: Field required",
        lambda env, t: env.client.post("/v1/adapters", json={"name": "x"}, headers=t),
    ),
]


def test_every_bad_input_is_refused_and_changes_nothing(env: Env):
    tenant = env.new_tenant("bad-co")
    assert env.register(tenant, "good", env.adapter_dir("good", targets=VALID)).status_code == 201
    staging = env.tmp / "staging"
    failures = []
    for case in BAD_CASES:
        before = env.state()
        r = case.request(env, tenant)
        detail = r.json().get("detail")
        if (r.status_code, case.message in str(detail)) != (case.status, True):
            failures.append(f"{case.id}: {r.status_code} {detail!r}")
        if env.state() != before:
            failures.append(f"{case.id}: etcd or the artifact root changed")
        if list(staging.iterdir()):
            failures.append(f"{case.id}: staging not cleaned")
    assert not failures, "\n".join(failures)


@dataclass(frozen=True)
class Raw:
    """A request sent as raw bytes (JSON a client's encoder would never write)."""

    id: str
    method: str
    path: str
    body: bytes
    status: int
    message: str
    admin: bool = False
    content_type: str = "application/json"


def _alpha_with_zeros(path: Path) -> None:
    config = (path / CONFIG_FILE).read_text()
    zeros = '"lora_alpha": 1' + "0" * 400
    (path / CONFIG_FILE).write_text(re.sub(r'"lora_alpha": [^,}]+', zeros, config))


DIGEST = "9c0d3e5b" * 8
RAW_CASES = [
    Raw("tenant-nan", "POST", "/v1/tenants", b'{"name": "n1", "adapter_quota": NaN}', 400, "NaN is not a JSON number", admin=True),
    Raw("tenant-1e400", "POST", "/v1/tenants", b'{"name": "n2", "adapter_quota": 1e400}', 400, "out of the range of a 64-bit float", admin=True),
    Raw("tenant-dup", "POST", "/v1/tenants", b'{"name": "n3", "name": "n4"}', 400, "duplicate key 'name'", admin=True),
    Raw("tenant-surrogate", "POST", "/v1/tenants", b'{"name": "\\ud800"}', 400, "lone UTF-16 surrogate", admin=True),
    Raw("limits-infinity", "PUT", "/v1/tenants/bad-raw/limits", b'{"tokens_per_minute": Infinity}', 400, "Infinity is not a JSON number", admin=True),
    Raw("limits-bool", "PUT", "/v1/tenants/bad-raw/limits", b'{"max_requests_in_flight": true}', 422, "valid integer", admin=True),
    Raw("limits-string", "PUT", "/v1/tenants/bad-raw/limits", b'{"max_requests_in_flight": "5"}', 422, "valid integer", admin=True),
    Raw("key-nan", "POST", "/v1/tenants/bad-raw/keys", b'{"revoke_existing": NaN}', 400, "NaN is not a JSON number", admin=True),
    Raw("canary-nan", "PUT", "/v1/adapters/good/canary", b'{"version": "' + DIGEST.encode() + b'", "weight": NaN}', 400, "NaN"),
    Raw("canary-tiny", "PUT", "/v1/adapters/good/canary", b'{"version": "' + DIGEST.encode() + b'", "weight": 1e-320}', 422, "greater than or equal to 0.000001"),
    Raw("rollback-inf", "POST", "/v1/adapters/good/rollback", b'{"version": -Infinity}', 400, "-Infinity is not a JSON number"),
    Raw("load-nan", "POST", "/v1/load_lora_adapter", b'{"lora_name": "x", "lora_path": "/x", "load_inplace": NaN}', 400, "NaN"),
    Raw("load-surrogate", "POST", "/v1/load_lora_adapter", b'{"lora_name": "x", "lora_path": "/\\udfff"}', 400, "surrogate"),
    Raw("unload-big", "POST", "/v1/unload_lora_adapter", b'{"lora_name": "x", "lora_int_id": 1' + b"0" * 400 + b"}", 400, "out of the 64-bit range"),
    Raw("by-path-nan", "POST", "/v1/adapters", b'{"name": "x", "path": "/x", "pinned": NaN}', 400, "NaN"),
    Raw("boundary-300", "POST", "/v1/adapters", b"--" + b"b" * 300 + b"--\r\n", 400, "boundary of 300 characters", content_type="multipart/form-data; boundary=" + "b" * 300),
    Raw("multipart-truncated", "POST", "/v1/adapters", b'--xyz\r\nContent-Disposition: form-data; name="name"\r\n\r\nbad\r\n--xyz\r\nContent-Disposition: form-data; name="adapter_config"; filename="c"\r\n\r\n{"r"', 400, "ended before its closing boundary", content_type="multipart/form-data; boundary=xyz"),
]  # fmt: skip


@pytest.mark.parametrize("case", RAW_CASES, ids=lambda c: c.id)
def test_inputs_that_reached_a_500_are_4xx_and_change_nothing(env: Env, case: Raw):
    """Non-finite numbers, out-of-range integers, duplicate keys, lone surrogates, coerced
    types and malformed multipart bodies: each a 4xx naming the problem, nothing written."""
    if "bad-raw" not in env.keys:  # one tenant with one adapter for every case
        env.keys["bad-raw"] = env.new_tenant("bad-raw")
        good = env.adapter_dir("raw-good", seed=71)
        assert env.register(env.keys["bad-raw"], "good", good).status_code == 201
    headers = env.admin if case.admin else env.keys["bad-raw"]
    before = env.state()
    sent = {**headers, "content-type": case.content_type}
    r = env.client.request(case.method, case.path, content=case.body, headers=sent)
    assert r.status_code == case.status, r.text
    assert case.message in str(r.json()["detail"]), r.text
    assert env.state() == before
    assert list((env.tmp / "staging").iterdir()) == []


def test_an_adapter_config_number_past_float_range_is_refused(env: Env):
    tenant = env.new_tenant("bad-alpha")
    before = env.state()
    r = env.register(tenant, "bad", _prepared(env, _alpha_with_zeros))
    assert (r.status_code, "out of the 64-bit range" in r.json()["detail"]) == (400, True), r.text
    assert env.state()[1] == before[1]


def _prepared(env: Env, prepare: Callable[[Path], None]) -> Path:
    path = env.adapter_dir(f"prepared-{time.monotonic_ns()}")
    prepare(path)
    return path


def test_a_404_does_not_echo_a_long_name(env: Env):
    tenant = env.new_tenant("long-name")
    r = env.client.get("/v1/adapters/" + "a" * 20_000, headers=tenant)
    assert r.status_code in (404, 422), r.text
    assert len(r.text) < 1_000, len(r.text)


# ---------------------------------------------------------------- isolation


def test_tenants_never_see_use_or_delete_each_others_adapters(env: Env):
    acme, globex = env.new_tenant("iso-acme"), env.new_tenant("iso-globex")
    assert env.register(acme, "secret-sauce", env.adapter_dir("s1", seed=31)).status_code == 201
    assert env.register(acme, "shared-name", env.adapter_dir("s2", seed=32)).status_code == 201
    r = env.register(globex, "shared-name", env.adapter_dir("s3", seed=33))
    assert r.status_code == 201, "names are per tenant"
    globex_record = r.json()

    listing = env.client.get("/v1/adapters", headers=globex).json()["adapters"]
    assert [(a["tenant"], a["name"]) for a in listing] == [("iso-globex", "shared-name")]
    unknown = env.client.get("/v1/adapters/no-such-adapter", headers=globex)
    other = env.client.get("/v1/adapters/secret-sauce", headers=globex)
    assert (other.status_code, other.json()) == (
        unknown.status_code,
        {"detail": "adapter 'secret-sauce' not found"},
    )
    assert unknown.status_code == 404
    shown = env.client.get("/v1/adapters/shared-name", headers=globex).json()
    assert shown.pop("versions")[0]["version"] == globex_record["version"]
    assert shown == globex_record

    before = env.state()
    assert env.client.delete("/v1/adapters/secret-sauce", headers=globex).status_code == 404
    assert (
        env.client.post(
            "/v1/unload_lora_adapter", json={"lora_name": "secret-sauce"}, headers=globex
        ).status_code
        == 404
    )
    assert env.state() == before
    assert env.client.get("/v1/adapters/secret-sauce", headers=acme).status_code == 200

    watcher = env.client.app.state.watcher

    async def resolve_both():
        async with RegistryStore(env.server.settings()) as store:
            return [
                await view.adapter(tenant, name)
                for view in (WatchedView(watcher), StoredView(store))
                for tenant, name in (
                    ("iso-globex", "secret-sauce"),
                    ("iso-acme", "secret-sauce"),
                    ("iso-globex", "shared-name"),
                )
            ]

    found = asyncio.run(resolve_both())
    assert [None if r is None else (r.tenant, r.name) for r in found] == [
        None, ("iso-acme", "secret-sauce"), ("iso-globex", "shared-name")
    ] * 2  # fmt: skip
    assert found[2].version == globex_record["version"]


def test_deleting_a_tenant_deletes_its_adapters_and_keys(env: Env):
    tenant = env.new_tenant("gone-co")
    record = env.register(tenant, "a", env.adapter_dir("g1", seed=41)).json()
    r = env.client.delete("/v1/tenants/gone-co", headers=env.admin)
    assert r.json() == {"name": "gone-co", "adapters_deleted": ["a"]}
    assert not (env.root / record["artifact"]).exists()
    assert not any(
        k.startswith(
            (
                "/loraplex/v1/adapters/gone-co/",
                "/loraplex/v1/versions/gone-co/",
                "/loraplex/v1/tenants/gone-co",
            )
        )
        for k in etcd_state(env.server)[1]
    )
    assert env.client.get("/v1/adapters", headers=tenant).status_code == 401
    assert env.client.delete("/v1/tenants/gone-co", headers=env.admin).status_code == 404


def test_gc_keeps_what_etcd_references(env: Env):
    tenant = env.new_tenant("gc-co")
    kept = env.register(tenant, "kept", env.adapter_dir("gc1", seed=81)).json()
    artifacts = ArtifactStore(env.root)
    orphan = artifacts.put_dir(
        env.adapter_dir("gc2", seed=82)
    )  # as a crash before the txn leaves it

    async def gc(min_age_s):
        async with RegistryStore(env.server.settings()) as store:
            return await collect_garbage(store, artifacts, min_age_s=min_age_s)

    assert asyncio.run(gc(3600)) == []  # too young: it may belong to a registration in flight
    assert asyncio.run(gc(0)) == [orphan.digest]
    assert (env.root / kept["artifact"]).is_dir() and not artifacts.exists(orphan.digest)
    assert env.client.get("/v1/adapters/kept", headers=tenant).status_code == 200


def test_openapi_schema_renders_with_examples(env: Env):
    schema = env.client.get("/openapi.json").json()
    paths = schema["paths"]
    assert set(paths) >= {
        "/v1/tenants",
        "/v1/tenants/{name}",
        "/v1/tenants/{name}/keys",
        "/v1/adapters",
        "/v1/adapters/{name}",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
    register = paths["/v1/adapters"]["post"]
    assert set(register["requestBody"]["content"]) == {"multipart/form-data", "application/json"}
    assert {"201", "409", "413", "422", "503"} <= set(register["responses"])
    assert schema["components"]["schemas"]["Adapter"]["examples"]
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


# ---------------------------------------------------------------- concurrency, end to end


@pytest.fixture
def live_server(shared_etcd_server: EtcdServer, tmp_path) -> Iterator[tuple[str, Path]]:
    """The app under a real uvicorn on a free loopback port; a tenant may race 8 uploads."""
    settings = api_settings(tmp_path, max_uploads_per_tenant=8)
    app = create_app(settings, shared_etcd_server.settings(), tmp_path / "artifacts")
    with serve(app, timeout_s=10) as url:
        yield url, tmp_path


def test_concurrent_registrations_of_one_name_exactly_one_wins(live_server):
    url, tmp = live_server
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        key = client.post(
            "/v1/tenants", json={"name": "race-co", "adapter_quota": 3}, headers=admin
        ).json()["api_key"]
        tenant = {"Authorization": f"Bearer {key}"}
        sources = [make_adapter(tmp / "adapters" / f"r{i}", seed=50 + i) for i in range(4)]

        def post(src: Path) -> httpx.Response:
            return client.post(
                "/v1/adapters", data={"name": "contested"}, files=upload_files(src), headers=tenant
            )

        for _ in range(3):
            with ThreadPoolExecutor(len(sources)) as pool:
                responses = list(pool.map(post, sources))
            statuses = sorted(r.status_code for r in responses)
            assert statuses == [201, 409, 409, 409], [r.text for r in responses]
            assert all(
                r.json()["detail"] == "adapter 'contested' already exists"
                for r in responses
                if r.status_code == 409
            )
            winner = next(r.json() for r in responses if r.status_code == 201)
            listing = client.get("/v1/adapters", headers=tenant).json()["adapters"]
            assert listing == [winner]
            assert [p.name for p in (tmp / "artifacts" / "sha256").iterdir()] == [
                winner["artifact"].split("/")[1]
            ]
            assert list((tmp / "artifacts" / "tmp").iterdir()) == []
            assert client.delete("/v1/adapters/contested", headers=tenant).status_code == 200

        # Different names racing for the last quota slots: the quota holds.
        with ThreadPoolExecutor(len(sources)) as pool:
            responses = list(pool.map(
                lambda i: client.post("/v1/adapters", data={"name": f"q{i}"}, files=upload_files(sources[i]), headers=tenant),
                range(len(sources)),
            ))  # fmt: skip
        assert sorted(r.status_code for r in responses) == [201, 201, 201, 409], [
            r.text for r in responses
        ]
        assert len(client.get("/v1/adapters", headers=tenant).json()["adapters"]) == 3
        assert len(list((tmp / "artifacts" / "sha256").iterdir())) == 3


def _held_upload(
    url: str, pool: ThreadPoolExecutor, headers: dict, src: Path, name: str, method: str = "POST"
) -> tuple[threading.Event, Future[httpx.Response]]:
    """An upload of `src` sent up to half its body, the rest once the event is set."""
    path = "/v1/adapters" if method == "POST" else f"/v1/adapters/{name}"
    data = {"name": name} if method == "POST" else {}
    request = httpx.Request(method, url + path, data=data, files=upload_files(src))
    body = request.read()
    resume = threading.Event()

    def chunks() -> Iterator[bytes]:
        yield body[: len(body) // 2]
        assert resume.wait(30), "the test never resumed the upload"
        yield body[len(body) // 2 :]

    def send() -> httpx.Response:
        sent = {**headers, "content-type": request.headers["content-type"]}
        with httpx.Client(timeout=60, trust_env=False) as client:
            return client.request(method, url + path, content=chunks(), headers=sent)

    return resume, pool.submit(send)


def _await_staging(staging: Path) -> None:
    """Until the server stages a body: the caller's key has been checked by then."""
    deadline = time.monotonic() + 10
    while not any(staging.iterdir()):
        assert time.monotonic() < deadline, "the held upload never reached its handler"
        time.sleep(0.01)


@pytest.mark.parametrize("change", ["tenant recreated", "key revoked", "limits changed"])
@pytest.mark.parametrize("method", ["POST", "PUT"])
def test_an_upload_commits_only_while_its_key_holds(live_server, change: str, method: str):
    """A registration held open mid-body while the admin deletes its tenant and creates one
    of the same name, or revokes its key, must not commit: 401, and nothing written to the
    new tenant or the artifact store. A change that keeps the key (limits) commits."""
    url, tmp = live_server
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    tenant = f"held-{method.lower()}-{change.split()[0]}"
    # bytes of its own: the etcd is shared, and a record elsewhere would keep the artifact
    seed = 91 + ["tenant recreated", "key revoked", "limits changed"].index(change) * 2
    src = make_adapter(tmp / "adapters" / "held", seed=seed + (method == "PUT"))
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:

        def create() -> dict:
            r = client.post("/v1/tenants", json={"name": tenant}, headers=admin)
            assert r.status_code == 201, r.text
            return {"Authorization": f"Bearer {r.json()['api_key']}"}

        key = create()
        if method == "PUT":  # a new version of an existing name
            first = make_adapter(tmp / "adapters" / "first", seed=seed + 10)
            assert (
                client.post(
                    "/v1/adapters", data={"name": "held"}, files=upload_files(first), headers=key
                ).status_code
                == 201
            )
        before = tree(tmp / "artifacts")
        versions = [
            a["version"] for a in client.get("/v1/adapters", headers=key).json()["adapters"]
        ]
        with ThreadPoolExecutor(1) as pool:
            resume, response = _held_upload(url, pool, key, src, "held", method)
            _await_staging(tmp / "staging")
            if change == "tenant recreated":
                assert client.delete(f"/v1/tenants/{tenant}", headers=admin).status_code == 200
                key = create()
            elif change == "key revoked":
                r = client.post(
                    f"/v1/tenants/{tenant}/keys", json={"revoke_existing": True}, headers=admin
                )
                key = {"Authorization": f"Bearer {r.json()['api_key']}"}
            else:
                r = client.put(
                    f"/v1/tenants/{tenant}/limits",
                    json={"max_requests_in_flight": 3},
                    headers=admin,
                )
                assert r.status_code == 200, r.text
            resume.set()
            r = response.result(timeout=60)
        listed = client.get("/v1/adapters", headers=key).json()["adapters"]
        if change == "limits changed":
            assert r.status_code == (201 if method == "POST" else 200), r.text
            assert [a["version"] for a in listed] == [r.json()["version"]]
            return
        assert r.status_code == 401, r.text
        assert "revoked, or its tenant deleted" in r.json()["detail"]
        if change == "tenant recreated":  # the old tenant's adapters went with it
            assert listed == []
            assert list((tmp / "artifacts" / "sha256").iterdir()) == []
        else:
            assert [a["version"] for a in listed] == versions
            assert tree(tmp / "artifacts") == before


_HOLD_STAGING = """
import asyncio, sys
from loraplex.registry import uploads

async def main():
    async with uploads.staging(sys.argv[1]) as work:
        (work / "adapter_model.safetensors").write_bytes(b"a tenant's bytes")
        print(work, flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_staging_left_by_a_killed_process_is_swept_at_start(shared_etcd_server, tmp_path):
    """A process killed (-9) mid-upload leaves its staging folder with a tenant's bytes; the
    next API to start removes it, and keeps the folders of processes still running."""
    settings = api_settings(tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_STAGING, settings.staging_dir],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        leaked = Path(child.stdout.readline().strip())
        assert (leaked / "adapter_model.safetensors").exists()
    finally:
        child.kill()
        child.wait(10)
    live = Path(
        tempfile.mkdtemp(prefix=f"loraplex-upload-{os.getpid()}-", dir=settings.staging_dir)
    )
    app = create_app(settings, shared_etcd_server.settings(), tmp_path / "artifacts")
    with TestClient(app) as client:
        assert not leaked.exists()
        assert live.exists()
        assert client.get(
            "/v1/tenants", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ).is_success


# ---------------------------------------------------------------- etcd down


def test_etcd_down_writes_503_reads_from_the_snapshot(etcd_server: EtcdServer, tmp_path):
    settings = api_settings(tmp_path)
    app = create_app(settings, etcd_server.settings(timeout_s=0.5), tmp_path / "artifacts")
    with TestClient(app) as client:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        tenant = {
            "Authorization": f"Bearer {client.post('/v1/tenants', json={'name': 'down-co'}, headers=admin).json()['api_key']}"
        }
        first = make_adapter(tmp_path / "adapters" / "first", seed=61)
        r = client.post(
            "/v1/adapters", data={"name": "first"}, files=upload_files(first), headers=tenant
        )
        assert r.status_code == 201
        record = r.json()
        artifacts_before = tree(tmp_path / "artifacts")

        etcd_server.stop(kill=True)
        second = make_adapter(tmp_path / "adapters" / "second", seed=62)
        writes = [
            client.post(
                "/v1/adapters", data={"name": "second"}, files=upload_files(second), headers=tenant
            ),
            client.delete("/v1/adapters/first", headers=tenant),
            client.post("/v1/tenants", json={"name": "new-co"}, headers=admin),
            client.post("/v1/tenants/down-co/keys", headers=admin),
        ]
        for w in writes:
            assert w.status_code == 503, w.text
            assert w.json()["detail"].startswith(
                "registry unavailable, nothing was changed; retry later"
            )
            assert w.headers["retry-after"] == "5"
            port = etcd_server.endpoint.rpartition(":")[2]
            assert port not in w.text, "the etcd endpoint is the operator's, not the caller's"
        assert tree(tmp_path / "artifacts") == artifacts_before
        assert client.get("/v1/adapters", headers=tenant).json() == {"adapters": [record]}
        shown = client.get("/v1/adapters/first", headers=tenant).json()
        assert [v["version"] for v in shown.pop("versions")] == [record["version"]]
        assert shown == record
        assert [t["name"] for t in client.get("/v1/tenants", headers=admin).json()["tenants"]] == [
            "down-co"
        ]

        etcd_server.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = client.post(
                "/v1/adapters", data={"name": "second"}, files=upload_files(second), headers=tenant
            )
            if r.status_code != 503:
                break
            time.sleep(0.1)
        assert r.status_code == 201, r.text
        names = [a["name"] for a in client.get("/v1/adapters", headers=tenant).json()["adapters"]]
        assert names == ["first", "second"]


def test_without_a_watcher_reads_go_to_etcd(shared_etcd_server: EtcdServer, tmp_path):
    app = create_app(
        api_settings(tmp_path), shared_etcd_server.settings(), tmp_path / "artifacts", watch=False
    )
    with TestClient(app) as client:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        key = client.post("/v1/tenants", json={"name": "nowatch-co"}, headers=admin).json()[
            "api_key"
        ]
        tenant = {"Authorization": f"Bearer {key}"}
        assert (
            hash_api_key(key)
            in json.loads(etcd_state(shared_etcd_server)[1]["/loraplex/v1/tenants/nowatch-co"][1])[
                "api_key_hashes"
            ]
        )
        src = make_adapter(tmp_path / "adapters" / "w", seed=71)
        r = client.post("/v1/adapters", data={"name": "w"}, files=upload_files(src), headers=tenant)
        assert r.status_code == 201
        shown = client.get("/v1/adapters/w", headers=tenant).json()
        assert [v["version"] for v in shown.pop("versions")] == [r.json()["version"]]
        assert shown == r.json()
        assert client.get("/v1/adapters", headers=tenant).json() == {"adapters": [r.json()]}
        assert client.delete("/v1/adapters/w", headers=tenant).status_code == 200
        assert client.get("/v1/adapters/w", headers=tenant).status_code == 404
