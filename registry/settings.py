"""The registry's settings, each declared once: what the tenant API accepts and its limits.

`RegistrySettings` is the YAML config's `registry:` section (the rank limit the engine
shares is the adapter format's `AdapterLimits`, common/adapter_format.py).
`RegistryAPISettings` (registry/api.py) adds the per-process rest: the admin key and the base
model's shape.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.registry.admission import check_staging_budget
from loraplex.registry.isolation import WorkLimits


class RegistrySettings(BaseModel):
    """Limits of the tenant API."""

    model_config = ConfigDict(extra="forbid")

    allowed_roots: list[str] = Field(
        default_factory=list,
        description="Folders from which adapters may be registered by path: tenant T only "
        "from <root>/T/ (symlinks followed only inside it); empty disables registration by "
        "path.",
    )
    max_adapter_bytes: int = Field(
        1 << 30, ge=1, description="Largest adapter accepted: config plus safetensors, in bytes."
    )
    max_upload_bytes: int = Field(
        (1 << 30) + (1 << 20),
        ge=1,
        description="Largest registration request body in bytes (multipart framing and gzip "
        "included); reading stops with 413 as soon as it is passed.",
    )
    work_timeout_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="Longest the file work of one registration step (extracting an archive, "
        "copying from a path, validating) may run in its worker process; past it the "
        "registration is refused with 413.",
    )
    work_memory_bytes: int = Field(
        512 << 20,
        ge=64 << 20,
        description="Memory the file work of one registration may add in its worker process; "
        "past it the registration is refused with 413.",
    )
    max_uploads_per_tenant: int = Field(
        2, ge=1, le=1024, description="Registrations one tenant may have in flight (else 429)."
    )
    staging_max_bytes: int = Field(
        5 << 30,
        ge=1,
        description="Staging bytes all registrations in flight may hold together: each body "
        "as it arrives, plus max_adapter_bytes per archive extracted or path copied; past "
        "it registrations are refused with 503 and Retry-After.",
    )
    staging_tenant_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Fraction of staging_max_bytes one tenant's registrations in flight may "
        "hold (503 past it), so that one tenant's stalled or large uploads leave the rest to "
        "the others; it must hold one largest upload and its extraction.",
    )
    body_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Longest a request body (the tenant API's and the ingress's) may pause "
        "between two of its bytes; past it 408, and its upload slot, staging bytes or "
        "tenant's request slot are freed.",
    )
    body_timeout_s: float = Field(
        1800.0,
        gt=0,
        le=86400,
        description="Longest a request body (the tenant API's and the ingress's) may take "
        "to arrive whole (at max_upload_bytes, 1 GiB in 30 minutes is ~0.6 MB/s); past it "
        "408.",
    )
    versions_kept: int = Field(
        5,
        ge=2,
        le=100,
        description="Versions of one adapter kept: the newest, and always the one it serves and the "
        "one it served before; registering one more deletes the oldest other one.",
    )
    gc_interval_s: float = Field(
        600.0,
        ge=0,
        le=86400,
        description="How often the API removes artifacts no adapter or version refers to; "
        "0 turns it off.",
    )
    gc_min_age_s: float = Field(
        3600.0,
        ge=0,
        description="Unreferenced artifacts younger than this are kept (a registration in "
        "flight stores its artifact before its record).",
    )

    @model_validator(mode="after")
    def _one_upload_fits_staging(self) -> RegistrySettings:
        check_staging_budget(
            self.staging_max_bytes,
            self.max_upload_bytes,
            self.max_adapter_bytes,
            self.staging_tenant_share,
        )
        return self

    def work_limits(self) -> WorkLimits:
        return WorkLimits(self.work_timeout_s, self.work_memory_bytes)
