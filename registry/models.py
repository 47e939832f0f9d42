"""What the registry keeps in etcd: tenants and adapter records, and the keys they live under.

Keys (the layout is versioned by the prefix; a v2 layout would live beside it):
    /loraplex/v1/tenants/<tenant>
    /loraplex/v1/adapters/<tenant>/<name>                 the alias: which version serves
    /loraplex/v1/versions/<tenant>/<name>/<version>       every retained version of a name
Values are the JSON of the models below without their `*_revision` fields, which are
filled from etcd's create_revision / mod_revision when a key is read.

Versions. A registration makes an immutable version, named by the content digest of its
files (`version`: the artifact store's sha256 over config and weights, so the same bytes
are the same version everywhere). A name is an alias: its `AdapterRecord` names the version
it points to, and may send a share of requests to a second one (`canary`); what a version is
(rank, targets, artifact, ...) is in its `AdapterVersion` only. Alias and versions change
together, in one transaction that compares the alias's revision and writes a version before
the alias that names it. `Adapter` is the two joined, as the tenant API answers.

Models are frozen: the watcher hands the same objects to every request path, so a change is
a `model_copy(update=...)` written back through the store, never an attribute assignment.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

PREFIX = "/loraplex/v1"
NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
DIGEST_PATTERN = r"^[0-9a-f]{64}$"
TENANTS_PREFIX = f"{PREFIX}/tenants/"
ADAPTERS_PREFIX = f"{PREFIX}/adapters/"
VERSIONS_PREFIX = f"{PREFIX}/versions/"
REVISION_FIELDS = frozenset({"created_revision", "updated_revision"})


def tenant_key(tenant: str) -> str:
    return f"{TENANTS_PREFIX}{tenant}"


def adapter_key(tenant: str, name: str) -> str:
    return f"{ADAPTERS_PREFIX}{tenant}/{name}"


def version_key(tenant: str, name: str, version: str) -> str:
    return f"{VERSIONS_PREFIX}{tenant}/{name}/{version}"


def tenant_adapters_prefix(tenant: str) -> str:
    """Prefix of every adapter key of `tenant`; the trailing slash keeps `a` from matching `ab`."""
    return f"{ADAPTERS_PREFIX}{tenant}/"


def tenant_versions_prefix(tenant: str) -> str:
    return f"{VERSIONS_PREFIX}{tenant}/"


def adapter_versions_prefix(tenant: str, name: str) -> str:
    return f"{VERSIONS_PREFIX}{tenant}/{name}/"


KeyKind = Literal["tenant", "adapter", "version"]


def parse_key(key: str) -> tuple[KeyKind, str, str | None, str | None]:
    """(kind, tenant, adapter name or None, version or None) of a registry key; ValueError
    for anything else."""
    if key.startswith(TENANTS_PREFIX):
        tenant = key[len(TENANTS_PREFIX) :]
        if tenant and "/" not in tenant:
            return "tenant", tenant, None, None
    elif key.startswith(ADAPTERS_PREFIX):
        parts = key[len(ADAPTERS_PREFIX) :].split("/")
        if len(parts) == 2 and all(parts):
            return "adapter", parts[0], parts[1], None
    elif key.startswith(VERSIONS_PREFIX):
        parts = key[len(VERSIONS_PREFIX) :].split("/")
        if len(parts) == 3 and all(parts):
            return "version", parts[0], parts[1], parts[2]
    raise ValueError(f"not a loraplex registry key: {key!r}")


class _Revisioned(BaseModel):
    model_config = ConfigDict(frozen=True)

    created_revision: int = Field(
        0, ge=0, description="etcd revision that created the key (filled on read; 0 if unsaved)."
    )
    updated_revision: int = Field(
        0,
        ge=0,
        description="etcd revision of the last change (filled on read); pass it back as "
        "`expected_revision` for a compare-and-set update.",
    )


class TenantLimits(BaseModel):
    """What one tenant may use at once at an ingress; a field left null takes the operator's
    default (the config's `limits` section). Enforced by every ingress replica on the
    requests it receives."""

    # strict: `true` or "5" is not a limit (lax validation read them as 1 and 5)
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    max_requests_in_flight: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="Generation requests of this tenant one ingress serves at once; past it "
        "429 with Retry-After. Null: the operator's default.",
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        le=1 << 40,
        description="Prompt plus generated tokens per minute (a token bucket of one minute's "
        "tokens; a request reserves its prompt and max_tokens, and gets back what it did not "
        "use); past it 429 with Retry-After. Null: the operator's default.",
    )


class Tenant(_Revisioned):
    """A tenant: owns adapters, authenticates with API keys stored only as hashes."""

    model_config = ConfigDict(
        frozen=True,
        json_schema_extra={
            "examples": [
                {
                    "name": "acme",
                    "api_key_hashes": [
                        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
                    ],
                    "adapter_quota": 100,
                    "created_at": 1767225600.0,
                    "created_revision": 12,
                    "updated_revision": 12,
                }
            ]
        },
    )

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Tenant name: 1-63 of a-z 0-9 . _ -, starting with a letter or digit.",
    )
    api_key_hashes: list[str] = Field(
        default_factory=list,
        description="sha256 hex digests of the tenant's API keys; the keys themselves are "
        "shown once when issued and never stored.",
    )
    adapter_quota: int = Field(
        100, ge=0, description="Most adapters this tenant may have registered at once."
    )
    created_at: float = Field(
        default_factory=time.time, ge=0, description="Creation time, seconds since the epoch."
    )
    limits: TenantLimits = Field(
        default_factory=TenantLimits,
        description="Requests in flight and tokens per minute; unset fields take the "
        "operator's defaults.",
    )

    @field_validator("api_key_hashes")
    @classmethod
    def _hex_digests(cls, hashes: list[str]) -> list[str]:
        for digest in hashes:
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError("api_key_hashes holds lowercase sha256 hex digests (64 chars)")
        return hashes


_ADAPTER_EXAMPLE: dict[str, Any] = {
    "name": "sql-helper",
    "tenant": "acme",
    "base_model": "meta-llama/Llama-3.1-8B-Instruct",
    "rank": 16,
    "alpha": 32.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "use_rslora": False,
    "dtype": "bfloat16",
    "size_bytes": 27262976,
    "sha256": "3a6eb0790f39ac87c94f3856b2dd2c5d110e6811602261a9a923d3bb23adc8b7",
    "artifact": "sha256/9c0d3e5b1a4f6e7d8c9b0a1f2e3d4c5b6a7f8e9d0c1b2a3f4e5d6c7b8a9f0e1d",
    "version": "9c0d3e5b1a4f6e7d8c9b0a1f2e3d4c5b6a7f8e9d0c1b2a3f4e5d6c7b8a9f0e1d",
    "created_revision": 40,
    "updated_revision": 41,
}


class _AdapterFields(_Revisioned):
    """One version of an adapter: its name and owner, and what every replica needs to find,
    check and load its weights."""

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Adapter name, unique within its tenant: 1-63 of a-z 0-9 . _ -.",
    )
    tenant: str = Field(pattern=NAME_PATTERN, description="Owning tenant.")
    base_model: str = Field(min_length=1, description="Base model id the adapter was trained on.")
    rank: int = Field(ge=1, description="LoRA rank r.")
    alpha: float = Field(
        gt=0, description="LoRA alpha; the scale is alpha / r (alpha / sqrt(r) with rsLoRA)."
    )
    target_modules: list[str] = Field(
        min_length=1, description="Module names the adapter modifies, e.g. q_proj."
    )
    use_rslora: bool = Field(False, description="Rank-stabilized LoRA scaling (alpha / sqrt(r)).")
    dtype: str = Field(
        min_length=1, description="Tensor dtype of the stored weights, e.g. bfloat16."
    )
    size_bytes: int = Field(ge=0, description="Size of the weights file in bytes.")
    sha256: str = Field(
        pattern=DIGEST_PATTERN, description="sha256 of the weights file, lowercase hex."
    )
    artifact: str = Field(
        min_length=1,
        description="Location of the adapter's files, relative to the artifact root.",
    )
    version: str = Field(
        pattern=DIGEST_PATTERN,
        description="The version: content digest of the adapter's config and weights (the "
        "artifact's sha256). Replicas key their pools and caches by it.",
    )

    @field_validator("artifact")
    @classmethod
    def _relative_inside_root(cls, artifact: str) -> str:
        path = PurePosixPath(artifact)
        if path.is_absolute() or ".." in path.parts or "\\" in artifact:
            raise ValueError("artifact is a path relative to the artifact root, without '..'")
        return artifact


class AdapterVersion(_AdapterFields):
    """A retained version of an adapter: immutable once written."""

    model_config = ConfigDict(
        frozen=True,
        json_schema_extra={"examples": [_ADAPTER_EXAMPLE | {"created_at": 1767225600.0}]},
    )

    created_at: float = Field(
        default_factory=time.time, ge=0, description="Registration time, seconds since the epoch."
    )


class Canary(BaseModel):
    """A share of a name's requests sent to another of its versions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str = Field(pattern=DIGEST_PATTERN, description="The version on trial.")
    weight: float = Field(
        gt=0, lt=1, description="Share of requests it gets, chosen per request id."
    )


class AdapterRecord(_Revisioned):
    """A registered LoRA adapter's name: an alias to the version that serves it, and
    optionally a canary version that serves a share of requests."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "name": _ADAPTER_EXAMPLE["name"],
                    "tenant": _ADAPTER_EXAMPLE["tenant"],
                    "version": _ADAPTER_EXAMPLE["version"],
                    "pinned": False,
                    "canary": None,
                }
            ]
        },
    )

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Adapter name, unique within its tenant: 1-63 of a-z 0-9 . _ -.",
    )
    tenant: str = Field(pattern=NAME_PATTERN, description="Owning tenant.")
    version: str = Field(pattern=DIGEST_PATTERN, description="The version that serves the name.")
    pinned: bool = Field(
        False, description="Keep resident on replicas instead of evicting when cold."
    )
    canary: Canary | None = Field(
        None, description="Another version that serves a share of this name's requests."
    )

    @classmethod
    def naming(cls, version: AdapterVersion, pinned: bool = False) -> AdapterRecord:
        """The alias of a new name, at its first version."""
        return cls(name=version.name, tenant=version.tenant, version=version.version, pinned=pinned)

    def version_for(self, request_id: str) -> str:
        """The version that serves request `request_id`: the canary's for a fixed share of
        ids (a hash of the id, so a request keeps its version wherever it is resolved)."""
        canary = self.canary
        if canary is not None and canary_draw(request_id) < canary.weight:
            return canary.version
        return self.version

    @property
    def targets(self) -> frozenset[str]:
        """The versions new requests of this name may get."""
        return frozenset({self.version} | ({self.canary.version} if self.canary else set()))

    def pointing_to(self, version: AdapterVersion, canary: Canary | None = None) -> AdapterRecord:
        """This alias moved to `version` (keeping its revisions, for a compare-and-set)."""
        return self.model_copy(update={"version": version.version, "canary": canary})


class Adapter(_AdapterFields):
    """A name as the tenant API answers it: the fields of the version that serves it, the
    alias's `pinned` and `canary`, and the alias's revisions. Not stored: the alias and its
    version joined."""

    model_config = ConfigDict(
        frozen=True,
        json_schema_extra={"examples": [_ADAPTER_EXAMPLE | {"pinned": False, "canary": None}]},
    )

    pinned: bool = Field(
        False, description="Keep resident on replicas instead of evicting when cold."
    )
    canary: Canary | None = Field(
        None, description="Another version that serves a share of this name's requests."
    )

    @classmethod
    def of(cls, alias: AdapterRecord, version: AdapterVersion) -> Adapter:
        assert (alias.tenant, alias.name, alias.version) == (
            version.tenant,
            version.name,
            version.version,
        ), "an alias is joined with the version it names"
        fields = version.model_dump(exclude=set(REVISION_FIELDS | {"created_at"}))
        revisions = alias.model_dump(include=set(REVISION_FIELDS))
        return cls(**fields, **revisions, pinned=alias.pinned, canary=alias.canary)

    @property
    def alias(self) -> AdapterRecord:
        """The name's alias record (which version serves which request: `version_for`)."""
        return AdapterRecord.model_validate(
            self.model_dump(include=set(AdapterRecord.model_fields))
        )


def canary_draw(request_id: str) -> float:
    """A uniform draw in [0, 1) that depends only on the request id (blake2b, so every
    ingress process draws the same)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


RegistryValue = Tenant | AdapterRecord | AdapterVersion


def encode(value: RegistryValue) -> bytes:
    return value.model_dump_json(exclude=set(REVISION_FIELDS)).encode()


def decode(key: str, data: bytes, *, created_revision: int, updated_revision: int) -> RegistryValue:
    """The model stored under `key`; ValueError if the key or the value is not one of ours."""
    kind, tenant, name, version = parse_key(key)
    revisions = {"created_revision": created_revision, "updated_revision": updated_revision}
    if kind == "tenant":
        value: RegistryValue = Tenant.model_validate_json(data).model_copy(update=revisions)
        if value.name != tenant:
            raise ValueError(f"{key}: holds tenant {value.name!r}")
    elif kind == "adapter":
        value = AdapterRecord.model_validate_json(data).model_copy(update=revisions)
        if (value.tenant, value.name) != (tenant, name):
            raise ValueError(f"{key}: holds adapter {value.tenant}/{value.name}")
    else:
        value = AdapterVersion.model_validate_json(data).model_copy(update=revisions)
        if (value.tenant, value.name, value.version) != (tenant, name, version):
            raise ValueError(
                f"{key}: holds version {value.version} of adapter {value.tenant}/{value.name}"
            )
    return value


def key_of(value: RegistryValue) -> str:
    if isinstance(value, Tenant):
        return tenant_key(value.name)
    if isinstance(value, AdapterVersion):
        return version_key(value.tenant, value.name, value.version)
    return adapter_key(value.tenant, value.name)
