"""The sections of the YAML config that belong to the deployment itself: the replicas and
what each holds, the registry's etcd, who administers tenants, and HTTP. The other
sections are the parts' own settings (replica/, router/, registry/); cluster/config.py
composes them all into `LoraplexConfig`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from loraplex.registry.etcd_client import EtcdCredentials, EtcdSettings
from loraplex.replica.config import EngineConfig
from loraplex.router.autoscaling import serve_autoscaling_config
from loraplex.serve_flags import IngressProxy
from loraplex.settings import describe, setting

ADMIN_KEY_ENV = "LORAPLEX_ADMIN_KEY"
METRICS_KEY_ENV = "LORAPLEX_METRICS_KEY"
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReplicaSection(_Section):
    """The replica deployment: how many, and what each one holds."""

    num_replicas: int = Field(
        2, ge=1, le=4096, description="Replicas (ignored while autoscaling is set)."
    )
    num_cpus: float = Field(1.0, ge=0, le=1024, description="CPUs reserved per replica.")
    num_gpus: float = Field(
        0.0, ge=0, le=64, description="GPUs per replica: 0 (CPU serving) or tp."
    )
    tp: int = setting(EngineConfig, "tp")
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="Requests Serve sends a replica at once, running or queued in its "
        "scheduler; unset: every request the ingresses hold (http.ingress_replicas x "
        "http.ingress_max_ongoing_requests), so that they queue in the replica's tenant-fair "
        "admission rather than in Serve's router, which knows no tenants.",
    )
    autoscaling: dict[str, Any] | None = Field(
        None,
        description="Ray Serve autoscaling_config (min_replicas, max_replicas, "
        "target_ongoing_requests, upscale_delay_s, ...); set, it replaces num_replicas. "
        "`policy: lora` scales on the replicas' batch slots and store reads "
        "(router/autoscaling.py; its settings under `lora:`), `policy: requests` (the "
        "default) on ongoing requests, as Serve does.",
    )

    @field_validator("autoscaling")
    @classmethod
    def _serve_accepts(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        from ray.serve.config import AutoscalingConfig

        try:
            AutoscalingConfig(**serve_autoscaling_config(value))
        except ValidationError as e:
            raise ValueError(f"not a Ray Serve autoscaling_config: {describe(e)}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a Ray Serve autoscaling_config: {e}") from None
        return value

    @model_validator(mode="after")
    def _gpus_are_tp(self) -> ReplicaSection:
        if self.num_gpus not in (0, self.tp):
            raise ValueError(
                f"num_gpus must be 0 (CPU) or tp ({self.tp}): a replica holds one GPU per "
                f"tensor-parallel rank, got {self.num_gpus:g}"
            )
        return self


class EtcdSection(_Section, EtcdCredentials):
    """The registry's etcd: endpoints to use, or none to have `loraplex up` start one; the
    deadline, TLS and user as `EtcdSettings` has them."""

    endpoints: list[str] | None = Field(
        None,
        min_length=1,
        description="etcd client endpoints as host:port; unset: `loraplex up` starts a "
        "single-member etcd under its state folder (`serve deploy` needs them set).",
    )
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Started etcd only: the address it listens on and replicas dial. On a "
        "multi-node cluster, the head node's private IP.",
    )
    client_port: int | None = Field(
        None, ge=1, le=65535, description="Started etcd only: client port; unset: a free one."
    )

    @model_validator(mode="after")
    def _as_etcd_settings(self) -> EtcdSection:
        # EtcdSettings owns the endpoint format.
        self.settings(self.endpoints or ["127.0.0.1:2379"])
        return self

    def settings(self, endpoints: list[str]) -> EtcdSettings:
        return EtcdSettings(endpoints=endpoints, **self.credentials())


class AuthSection(_Section):
    """Who may administer tenants."""

    admin_key_env: str = Field(
        ADMIN_KEY_ENV,
        pattern=_ENV_NAME,
        description="Environment variable holding the admin key (at least 16 characters) "
        "in the ingress processes; `loraplex up` generates one and sets it.",
    )
    metrics_key_env: str = Field(
        METRICS_KEY_ENV,
        pattern=_ENV_NAME,
        description="Environment variable holding the key /metrics wants as a bearer token "
        "(at least 16 characters; the admin key is accepted too) in the ingress processes; "
        "`loraplex up` generates one and sets it. Unset: only the admin key reads /metrics.",
    )


class HTTPSection(_Section):
    """Where clients reach the cluster, and the ingress deployment."""

    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address the HTTP proxy (ingress_proxy's) binds; 0.0.0.0: all.",
    )
    port: int = Field(8000, ge=1, le=65535, description="Port of the HTTP proxy.")
    ingress_replicas: int = Field(
        1, ge=1, le=1024, description="Ingress replicas (tokenize, auth, tenant API)."
    )
    ingress_num_cpus: float = Field(0.0, ge=0, le=64, description="CPUs reserved per ingress.")
    ingress_max_ongoing_requests: int = Field(
        1000,
        ge=1,
        le=1 << 20,
        description="Requests one ingress replica handles at once (streams included).",
    )
    ingress_proxy: IngressProxy = Field(
        "serve",
        description="What carries HTTP to the ingress replicas. serve: Ray Serve's proxy actor "
        "on each node (Python; it relays every streamed chunk over Ray). haproxy: Ray Serve's "
        "direct ingress, HAProxy on each node forwarding to the ingress replicas' own HTTP "
        "servers: under one tenant's 64-stream flood, another tenant's p99 TTFT about halves "
        "(docs/performance.md). HAProxy's stats page (8404) and Prometheus exporter (9101) "
        "listen on every interface (`loraplex up` puts them on free ports). Ray reads the "
        "choice from `ray start`'s environment (RAY_SERVE_ENABLE_DIRECT_INGRESS and "
        "RAY_SERVE_ENABLE_HA_PROXY, both 1 for haproxy): `loraplex up` sets it for the Ray it "
        "starts, the `ray up` files and the Helm chart from this field, and `loraplex up "
        "--address` refuses a Ray cluster started with the other.",
    )
