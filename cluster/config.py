"""The whole application's settings: one pydantic model, loadable from YAML.

`LoraplexConfig` feeds every part: `engine_config()` the replicas' EngineConfig,
`etcd_settings()` the registry clients, `router_kwargs()` the affinity router,
`registry_api_settings()` the tenant API, and `to_serve_config()` a Ray Serve config file
for `serve deploy` whose application args are this config again.

Secrets never sit in the file: the admin key is read from the environment variable named
by `auth.admin_key_env` by the ingress process when it starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from loraplex.registry.admission import check_staging_budget
from loraplex.registry.etcd_client import EtcdCredentials, EtcdSettings

APP_NAME = "loraplex"
IMPORT_PATH = "loraplex.cluster.app:build_app"
# The engine's own default when max_model_len is unset (replica/engine.py): the model's
# max_position_embeddings, capped here.
MAX_MODEL_LEN_CAP = 8192
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineSection(_Section):
    """One replica's engine (replica/config.py EngineConfig, scheduler included)."""

    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights and activations; auto keeps the checkpoint's dtype."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda when replicas.num_gpus > 0, else cpu."
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        le=1 << 20,
        description="Context window in tokens (prompt + output); unset: the model's "
        f"max_position_embeddings, capped at {MAX_MODEL_LEN_CAP}.",
    )
    pool_mib: int | None = Field(
        None,
        ge=1,
        le=1 << 21,
        description="Unified paged pool (KV cache + adapters) per device in MiB; unset: "
        "512 MiB on CPU, 90% of free memory on CUDA.",
    )
    page_kib: int | None = Field(
        None,
        ge=1,
        le=1 << 16,
        description="Pool page size in KiB; unset: the smallest power of two holding 16 "
        "tokens of KV (at least 64 KiB). 2048 (2 MiB) suits GPUs.",
    )
    max_lora_rank: int = Field(128, ge=1, le=1024, description="Largest LoRA rank accepted.")
    max_num_seqs: int = Field(32, ge=1, le=4096, description="Requests in one batch.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, le=1 << 20, description="Tokens computed in one engine step."
    )
    max_loras_per_batch: int = Field(
        32, ge=1, le=4096, description="Distinct adapters in one batch."
    )
    seed: int = Field(
        0, ge=0, le=2**63 - 1, description="Seeds the sampling of requests that set no seed."
    )
    scheduler_policy: Literal["fifo", "sjf", "chameleon"] = Field(
        "fifo",
        description="Admission order: fifo; sjf (shortest predicted output first, aged); "
        "chameleon (multi-level queues with token quotas, seed 004).",
    )
    eviction: Literal["chameleon", "lru", "gdsf", "equal"] = Field(
        "chameleon",
        description="Which idle adapter leaves the device pool first: Chameleon's score "
        "(frequency, recency, size), lru, gdsf or equal weights.",
    )
    adapter_loading: Literal["sync", "thread"] = Field(
        "thread",
        description="thread: adapter copies into the pool overlap the forward (a copy "
        "stream on CUDA); sync: copied on the engine thread.",
    )
    prefetch: int = Field(
        0, ge=0, le=4096, description="Queued requests whose adapters are loaded ahead."
    )
    low_watermark: float = Field(
        0.0, ge=0, le=1, description="Share of the pool a KV reclaim frees beyond its need."
    )
    high_watermark: float = Field(
        0.0, ge=0, le=1, description="Share of the pool prefetching leaves free."
    )
    host_mib: int | None = Field(
        None,
        ge=0,
        le=1 << 30,
        description="Host-tier budget for adapter weights in MiB; unset: every registered "
        "adapter stays in host memory (others are read again from the artifact store).",
    )
    kernels: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="LoRA and attention kernels: auto (Triton on CUDA, torch references "
        "elsewhere; $LORAPLEX_KERNELS overrides), torch or triton.",
    )

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> EngineSection:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark:g}) must not exceed high_watermark "
                f"({self.high_watermark:g})"
            )
        return self


class ReplicaSection(_Section):
    """The replica deployment: how many, and what each one holds."""

    num_replicas: int = Field(
        2, ge=1, le=4096, description="Replicas (ignored while autoscaling is set)."
    )
    num_cpus: float = Field(1.0, ge=0, le=1024, description="CPUs reserved per replica.")
    num_gpus: float = Field(
        0.0, ge=0, le=64, description="GPUs per replica: 0 (CPU serving) or tp."
    )
    tp: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel degree of one replica: its ranks run as Ray actors in the "
        "replica's placement group (one bundle per rank, packed on one node).",
    )
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="Requests a replica accepts at once; unset: engine.max_num_seqs.",
    )
    autoscaling: dict[str, Any] | None = Field(
        None,
        description="Ray Serve autoscaling_config, passed through as is (min_replicas, "
        "max_replicas, target_ongoing_requests, ...); set, it replaces num_replicas.",
    )

    @field_validator("autoscaling")
    @classmethod
    def _serve_accepts(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        from ray.serve.config import AutoscalingConfig

        try:
            AutoscalingConfig(**value)
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
        "LORAPLEX_ADMIN_KEY",
        pattern=_ENV_NAME,
        description="Environment variable holding the admin key (at least 16 characters) "
        "in the ingress processes; `loraplex up` generates one and sets it.",
    )


class RegistrySection(_Section):
    """Limits of the tenant API (registry/api.py RegistryAPISettings)."""

    allowed_roots: list[str] = Field(
        default_factory=list,
        description="Folders adapters may be registered from by server path, tenant T only "
        "from <root>/T/; empty: registration by upload only.",
    )
    max_adapter_bytes: int = Field(
        1 << 30, ge=1, description="Largest adapter accepted (config + safetensors), bytes."
    )
    max_upload_bytes: int = Field(
        (1 << 30) + (1 << 20), ge=1, description="Largest registration request body, bytes."
    )
    work_timeout_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="Longest one registration step's file work (archive, path copy, "
        "validation) may run in its worker process (else 413), seconds.",
    )
    work_memory_bytes: int = Field(
        512 << 20,
        ge=64 << 20,
        description="Memory one registration's file work may add in its worker process "
        "(else 413), bytes.",
    )
    max_uploads_per_tenant: int = Field(
        2, ge=1, le=1024, description="Registrations one tenant may have in flight (else 429)."
    )
    staging_max_bytes: int = Field(
        4 << 30,
        ge=1,
        description="Staging bytes all registrations in flight may hold together (else 503); "
        "at least max_upload_bytes + max_adapter_bytes.",
    )

    @model_validator(mode="after")
    def _one_upload_fits_staging(self) -> RegistrySection:
        check_staging_budget(self.staging_max_bytes, self.max_upload_bytes, self.max_adapter_bytes)
        return self


class ArtifactsSection(_Section):
    """How replicas read adapters from the artifact store. Unset, reads take what the
    storage gives; set, they take at least latency + size / bandwidth (one read at a time
    per replica), as from a network store: for benchmarks and capacity planning on a
    machine whose local disk is far faster than the store the cluster will use."""

    read_bandwidth_mib_s: float | None = Field(
        None, gt=0, le=1e7, description="Store bandwidth one replica gets, MiB/s; unset: unpaced."
    )
    read_latency_ms: float = Field(
        0.0, ge=0, le=600_000, description="Latency of one read from the store, ms."
    )


class RouterSection(_Section):
    """The adapter-affinity request router (router/policy.py AffinityConfig) and how often
    replicas publish the stats it routes on."""

    load_cost_s: float = Field(
        0.5, ge=0, le=600, description="What a cold adapter load adds to TTFT, seconds."
    )
    host_load_cost_s: float = Field(
        0.02,
        ge=0,
        le=600,
        description="Host tier -> device load time, seconds (at most load_cost_s).",
    )
    request_time_s: float = Field(
        2.0, gt=0, le=3600, description="Mean time a request holds a batch slot, seconds."
    )
    busy_cost_s: float = Field(
        0.0,
        ge=0,
        le=600,
        description="TTFT each request already on a replica adds, seconds: ~0 on GPUs "
        "(decode batching is nearly free), the per-sequence step time on CPUs.",
    )
    bounded_load_c: float = Field(
        1.25,
        gt=1,
        le=100,
        description="A cold home takes a request only below ceil(c * mean load).",
    )
    bounded_adapters_c: float = Field(
        1.1,
        gt=1,
        le=100,
        description="A cold home takes a new adapter only below ceil(c * mean adapters held).",
    )
    home_utilisation: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of a replica's batch slots one adapter should fill: an adapter "
        "gets as many homes as its request rate needs at this share (Little's law with "
        "request_time_s).",
    )
    home_hysteresis: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="A home of a hot adapter is withdrawn only once its rate needs (1 - "
        "this) of one home less, so a rate near a threshold does not flap.",
    )
    max_homes_per_adapter: int = Field(
        4, ge=1, le=4096, description="Most replicas one adapter is spread over."
    )
    rate_window_s: float = Field(
        10.0, gt=0, le=3600, description="Time constant of the adapter request-rate estimate."
    )
    stale_after_s: float = Field(
        30.0, gt=0, le=3600, description="Routing stats older than this rank their replica last."
    )
    use_measured_costs: bool = Field(
        True,
        description="Judge each replica by the busy and host-load costs it measures on its "
        "own steps and loads (the two settings above stand in until it has).",
    )
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seeds tie-breaks between replicas.")
    stats_period_s: float = Field(
        1.0, gt=0, le=600, description="How often each replica publishes its routing stats."
    )
    stats_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Deadline of one routing-stats call."
    )
    metrics_top_adapters: int = Field(
        20,
        ge=0,
        le=1000,
        description="Adapters shown one by one in /metrics and `loraplex status` (the "
        "busiest); the rest are summed as one.",
    )
    first_chunk_timeout_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="Longest wait for a request's first token (queueing, routing, adapter "
        "load); past it the client gets 503 instead of waiting on a cluster with no replica.",
    )

    @model_validator(mode="after")
    def _host_below_cold(self) -> RouterSection:
        if self.host_load_cost_s > self.load_cost_s:
            raise ValueError(
                f"host_load_cost_s ({self.host_load_cost_s:g}) must not exceed load_cost_s "
                f"({self.load_cost_s:g}): a host-tier load is a part of a cold load"
            )
        return self

    def affinity_kwargs(self) -> dict[str, Any]:
        """AffinityConfig fields and `seed`: the router's `request_router_kwargs`."""
        return self.model_dump(
            exclude={
                "stats_period_s",
                "stats_timeout_s",
                "first_chunk_timeout_s",
                "metrics_top_adapters",
            }
        )


class HTTPSection(_Section):
    """Where clients reach the cluster, and the ingress deployment."""

    host: str = Field(
        "127.0.0.1", min_length=1, description="Address Serve's HTTP proxy binds; 0.0.0.0: all."
    )
    port: int = Field(8000, ge=1, le=65535, description="Port of Serve's HTTP proxy.")
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


class LoraplexConfig(_Section):
    """A loraplex application: base model, engine, replicas, registry, router and HTTP.

    Relative paths in a YAML file are taken relative to that file's folder."""

    model: str | None = Field(
        None,
        description="Hugging Face checkpoint folder (config.json, *.safetensors, "
        "tokenizer.json), readable on every node; unset: `loraplex up` uses the demo model.",
    )
    model_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Name clients pass as `model` for the base model; unset: the folder name.",
    )
    engine: EngineSection = Field(default_factory=EngineSection, description="Engine.")
    replicas: ReplicaSection = Field(default_factory=ReplicaSection, description="Replicas.")
    etcd: EtcdSection = Field(default_factory=EtcdSection, description="Registry's etcd.")
    artifact_root: str | None = Field(
        None,
        description="Adapter artifact store, shared by every node (NFS/EFS on multi-node); "
        "unset: `loraplex up` uses STATE_DIR/artifacts.",
    )
    artifacts: ArtifactsSection = Field(
        default_factory=ArtifactsSection, description="Reads from the artifact store."
    )
    auth: AuthSection = Field(default_factory=AuthSection, description="Admin key.")
    registry: RegistrySection = Field(default_factory=RegistrySection, description="Tenant API.")
    router: RouterSection = Field(default_factory=RouterSection, description="Replica selection.")
    http: HTTPSection = Field(default_factory=HTTPSection, description="HTTP.")

    @classmethod
    def from_yaml(cls, path: str | Path) -> LoraplexConfig:
        """Load and validate a LoraplexConfig file, or a Serve config file (the args of its
        loraplex application); ValueError names the file and every bad field."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"{path}: cannot read it as YAML: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
        if "applications" in data:
            data = _app_args(data, path)
        try:
            config = cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(f"{path}: {describe(e)}") from None
        return config.resolve_paths(path.resolve().parent)

    def resolve_paths(self, base: Path) -> LoraplexConfig:
        """A copy with every path (model, artifact_root, allowed_roots, etcd's TLS files)
        made absolute against `base`."""

        def absolute(p: str | None) -> str | None:
            return None if p is None else str((base / Path(p).expanduser()).resolve())

        return self.model_copy(
            update={
                "model": absolute(self.model),
                "artifact_root": absolute(self.artifact_root),
                "registry": self.registry.model_copy(
                    update={"allowed_roots": [absolute(p) for p in self.registry.allowed_roots]}
                ),
                "etcd": self.etcd.model_copy(
                    update={f: absolute(getattr(self.etcd, f)) for f in ("ca_cert", "cert", "key")}
                ),
            }
        )

    # what each part is built from

    def require_model(self) -> str:
        if self.model is None:
            raise ValueError("no model configured: set `model` to a checkpoint folder")
        return self.model

    @property
    def base_model_id(self) -> str:
        return self.model_id or Path(self.require_model()).name

    @property
    def device(self) -> str:
        if self.engine.device != "auto":
            return self.engine.device
        return "cuda" if self.replicas.num_gpus > 0 else "cpu"

    def engine_config(self) -> dict[str, Any]:
        """EngineConfig fields as plain values (`scheduler` as a dict): what crosses Ray."""
        e, a = self.engine, self.artifacts
        return {
            "model": self.require_model(),
            "dtype": e.dtype,
            "device": self.device,
            "max_model_len": e.max_model_len,
            "pool_bytes": None if e.pool_mib is None else e.pool_mib << 20,
            "page_bytes": None if e.page_kib is None else e.page_kib << 10,
            "max_lora_rank": e.max_lora_rank,
            "scheduler": {
                "max_num_seqs": e.max_num_seqs,
                "max_num_batched_tokens": e.max_num_batched_tokens,
                "max_loras_per_batch": e.max_loras_per_batch,
                "policy": e.scheduler_policy,
            },
            "cache": {
                "eviction": e.eviction,
                "loading": e.adapter_loading,
                "prefetch": e.prefetch,
                "low_watermark": e.low_watermark,
                "high_watermark": e.high_watermark,
                "host_bytes": None if e.host_mib is None else e.host_mib << 20,
            },
            "kernels": e.kernels,
            "seed": e.seed,
            "tp": self.replicas.tp,
            "artifact_read_bytes_per_s": (
                None if a.read_bandwidth_mib_s is None else a.read_bandwidth_mib_s * (1 << 20)
            ),
            "artifact_read_latency_s": a.read_latency_ms / 1e3,
        }

    def max_model_len(self) -> int:
        """The context window the engine will use (reads the model's config.json if unset)."""
        if self.engine.max_model_len is not None:
            return self.engine.max_model_len
        config = json.loads((Path(self.require_model()) / "config.json").read_text())
        return min(int(config["max_position_embeddings"]), MAX_MODEL_LEN_CAP)

    def etcd_settings(self) -> EtcdSettings:
        if self.etcd.endpoints is None:
            raise ValueError(
                "etcd.endpoints is not set: `loraplex up` starts an etcd and fills it in; "
                "for `serve deploy`, list the endpoints of a running etcd"
            )
        return self.etcd.settings(self.etcd.endpoints)

    def with_etcd_endpoints(self, endpoints: list[str]) -> LoraplexConfig:
        return self.model_copy(
            update={"etcd": self.etcd.model_copy(update={"endpoints": list(endpoints)})}
        )

    def registry_api_settings(self, admin_key: str):
        """The tenant API's settings (reads the model's config.json for adapter shapes)."""
        from loraplex.registry.api import RegistryAPISettings
        from loraplex.registry.validation import BaseModelShape

        return RegistryAPISettings(
            admin_key=admin_key,
            base_model_id=self.base_model_id,
            base_model=BaseModelShape.from_config_json(self.require_model()),
            max_lora_rank=self.engine.max_lora_rank,
            **self.registry.model_dump(),
        )

    def serve_options(self) -> dict[str, Any]:
        """`serve.deployment` options of the replica deployment."""
        r = self.replicas
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus},
            "max_ongoing_requests": r.max_ongoing_requests or self.engine.max_num_seqs,
        }
        if r.tp > 1:  # rank 0 is the replica (bundle 0); ranks 1.. are actors in bundles 1..
            gpus = 1 if r.num_gpus else 0
            bundle = {"CPU": r.num_cpus, **({"GPU": 1} if gpus else {})}
            worker = {"CPU": 1, **({"GPU": 1} if gpus else {})}
            options["ray_actor_options"] = {"num_cpus": r.num_cpus, "num_gpus": gpus}
            options["placement_group_bundles"] = [bundle] + [worker] * (r.tp - 1)
            options["placement_group_strategy"] = "STRICT_PACK"
        if r.autoscaling is not None:
            options["num_replicas"] = "auto"
            options["autoscaling_config"] = r.autoscaling
        else:
            options["num_replicas"] = r.num_replicas
        return options

    def to_serve_config(self) -> dict[str, Any]:
        """A Ray Serve config file (ServeDeploySchema) deploying this config with
        `serve deploy`; the application's args are this config."""
        return {
            "proxy_location": "EveryNode",
            "http_options": {"host": self.http.host, "port": self.http.port},
            "applications": [
                {
                    "name": APP_NAME,
                    "route_prefix": "/",
                    "import_path": IMPORT_PATH,
                    "args": self.model_dump(mode="json"),
                }
            ],
        }


def _app_args(serve_config: dict[str, Any], path: Path) -> dict[str, Any]:
    apps = [
        app
        for app in serve_config.get("applications") or []
        if isinstance(app, dict) and app.get("import_path") == IMPORT_PATH
    ]
    if len(apps) != 1:
        raise ValueError(
            f"{path}: a Serve config file needs exactly one application with import_path "
            f"{IMPORT_PATH}, found {len(apps)}"
        )
    return apps[0].get("args") or {}


def describe(error: ValidationError) -> str:
    """One line per problem: `replicas.num_replicas: Input should be ... (got 0)`."""
    lines = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "config"
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "unknown setting"
        value = problem.get("input")
        shown = problem["type"] != "missing" and not isinstance(value, dict | list)
        if shown and problem["loc"] and problem["loc"][-1] == "password":
            value = "***"
        got = f" (got {value!r})" if shown else ""
        lines.append(f"{where}: {message}{got}")
    return "; ".join(lines)
