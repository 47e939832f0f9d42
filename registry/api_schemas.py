"""Request and response bodies of the tenant API, and the OpenAPI description of the
registration body (multipart or JSON, which FastAPI cannot infer from a streamed body)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from loraplex.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from loraplex.registry.models import (
    DIGEST_PATTERN,
    NAME_PATTERN,
    Adapter,
    AdapterVersion,
    Tenant,
    TenantLimits,
)


class TenantCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"examples": [{"name": "acme", "adapter_quota": 50}]},
    )

    name: str = Field(pattern=NAME_PATTERN, description="Tenant name (a-z 0-9 . _ -, max 63).")
    adapter_quota: int = Field(100, ge=0, le=1_000_000, description="Most adapters at once.")
    limits: TenantLimits = Field(
        default_factory=TenantLimits,
        description="Requests in flight and tokens per minute at each ingress; unset fields "
        "take the operator's defaults.",
    )


class TenantView(BaseModel):
    name: str
    adapter_quota: int
    created_at: float
    api_keys: int = Field(description="Number of valid API keys (the keys are not stored).")
    limits: TenantLimits = Field(description="The tenant's own limits (null: the default).")

    @classmethod
    def of(cls, tenant: Tenant) -> TenantView:
        return cls(
            name=tenant.name,
            adapter_quota=tenant.adapter_quota,
            created_at=tenant.created_at,
            api_keys=len(tenant.api_key_hashes),
            limits=tenant.limits,
        )


class TenantWithKey(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "tenant": {
                        "name": "acme",
                        "adapter_quota": 50,
                        "created_at": 1767225600.0,
                        "api_keys": 1,
                    },
                    "api_key": "lpx_q3V0nJ9tXc3l1cK8bqgk0m8mYQ0JQe3c1Vj9r0h2yGk",
                }
            ]
        }
    )

    tenant: TenantView
    api_key: str = Field(description="The new key. Shown once: only its sha256 is stored.")


class KeyRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, json_schema_extra={"examples": [{"revoke_existing": True}]}
    )

    revoke_existing: bool = Field(False, description="Invalidate the tenant's other keys.")


class TenantList(BaseModel):
    tenants: list[TenantView]


class TenantDeleted(BaseModel):
    name: str
    adapters_deleted: list[str]


class RegisterByPath(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {"name": "sql-helper", "path": "/mnt/adapters/sql-helper", "pinned": False}
            ]
        },
    )

    name: str = Field(pattern=NAME_PATTERN, description="Adapter name, unique per tenant.")
    path: str = Field(
        description="Absolute path of a PEFT adapter folder in the tenant's subtree of an "
        "allowed root (<root>/<tenant>/...)."
    )
    pinned: bool = Field(False, description="Keep resident on replicas even when cold.")


class ReplaceByPath(BaseModel):
    """`PUT /v1/adapters/{name}` by path: the name is the route's."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"examples": [{"path": "/mnt/adapters/sql-helper-v2"}]},
    )

    path: str = Field(
        description="Absolute path of a PEFT adapter folder in the tenant's subtree of an "
        "allowed root (<root>/<tenant>/...)."
    )
    pinned: bool | None = Field(
        None, description="Keep resident on replicas even when cold; unset keeps the name's."
    )


class AdapterList(BaseModel):
    adapters: list[Adapter]


class AdapterDetail(Adapter):
    """An adapter's name, the version it serves, and its retained versions."""

    versions: list[AdapterVersion] = Field(
        description="Retained versions, newest first (the current one among them)."
    )

    @classmethod
    def listing(cls, adapter: Adapter, versions: list[AdapterVersion]) -> AdapterDetail:
        return cls(**adapter.model_dump(), versions=versions)


class VersionList(BaseModel):
    versions: list[AdapterVersion] = Field(description="Newest first.")


class RollbackRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"examples": [{"version": "9c0d3e5b" * 8}, {}]},
    )

    version: str | None = Field(
        None,
        pattern=DIGEST_PATTERN,
        description="The retained version to serve; unset: the one registered before the "
        "current one.",
    )


MIN_CANARY_WEIGHT = 1e-6  # below it (1e-320 was accepted) a canary serves no request


class CanaryRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"examples": [{"version": "9c0d3e5b" * 8, "weight": 0.1}]},
    )

    version: str = Field(
        pattern=DIGEST_PATTERN, description="A retained version other than the current one."
    )
    weight: float = Field(
        ge=MIN_CANARY_WEIGHT,
        le=1 - MIN_CANARY_WEIGHT,
        description="Share of the name's requests it serves, chosen per request id: at least "
        "one in a million, and as much short of all of them.",
    )


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's request body; `load_inplace` registers a new version under a taken name."""

    model_config = ConfigDict(
        strict=True,
        json_schema_extra={
            "examples": [{"lora_name": "sql-helper", "lora_path": "/mnt/adapters/sql-helper"}]
        },
    )

    lora_name: str = Field(pattern=NAME_PATTERN)
    lora_path: str
    load_inplace: bool = Field(
        False,
        description="Register the folder as a new version of `lora_name` if it exists (the "
        "alias moves to it; requests in flight finish on the version they began with); "
        "false refuses a taken name.",
    )


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(
        strict=True, json_schema_extra={"examples": [{"lora_name": "sql-helper"}]}
    )

    lora_name: str
    lora_int_id: int | None = Field(None, description="Accepted for vLLM clients; ignored.")


def registration_body(name_in_body: bool) -> dict:
    """OpenAPI request body of a registration: multipart (files or an archive) or JSON by
    path; `name_in_body` for POST (PUT takes the name from its path)."""
    by_path = RegisterByPath if name_in_body else ReplaceByPath
    example = {"path": "/mnt/adapters/sql-helper"} | (
        {"name": "sql-helper"} if name_in_body else {}
    )
    pinned = {"type": "boolean"} | ({"default": False} if name_in_body else {})
    return {
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["name"] if name_in_body else [],
                        "properties": {
                            "name": {"type": "string", "pattern": NAME_PATTERN},
                            "pinned": pinned,
                            "adapter_config": {
                                "type": "string",
                                "format": "binary",
                                "description": CONFIG_FILE,
                            },
                            "adapter_model": {
                                "type": "string",
                                "format": "binary",
                                "description": WEIGHTS_FILE,
                            },
                            "archive": {
                                "type": "string",
                                "format": "binary",
                                "description": f"tar.gz of {CONFIG_FILE} and {WEIGHTS_FILE} "
                                "(instead of the two files)",
                            },
                        },
                    },
                    "encoding": {"adapter_config": {"contentType": "application/json"}},
                },
                "application/json": {
                    "schema": by_path.model_json_schema(),
                    "examples": {"by_path": {"value": example}},
                },
            },
        }
    }


REGISTRATION_BODY = registration_body(name_in_body=True)
REPLACEMENT_BODY = registration_body(name_in_body=False)
