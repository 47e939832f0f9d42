"""The registry's settings, each declared once: what the tenant API accepts and its limits.

`RegistrySettings` is the YAML config's `registry:` section; `AdapterLimits` holds the rank
limit that the engine shares (replica/config.py takes it from here: replica/ may import
registry/, not the reverse). `RegistryAPISettings` (registry/api.py) adds the per-process
rest: the admin key and the base model's shape.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AdapterLimits(BaseModel):
    """Which adapters are accepted: by the tenant API at registration, and again by every
    engine that loads one."""

    model_config = ConfigDict(extra="forbid")

    max_lora_rank: int = Field(
        128,
        ge=1,
        le=1024,
        description="Largest LoRA rank accepted; the engine sizes its LoRA buffers for it.",
    )


class RegistrySettings(BaseModel):
    """Limits of the tenant API."""

    model_config = ConfigDict(extra="forbid")

    allowed_roots: list[str] = Field(
        default_factory=list,
        description="Folders from which adapters may be registered by path (symlinks "
        "resolved); empty: registration by upload only.",
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
