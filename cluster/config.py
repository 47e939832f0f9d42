"""The whole application's settings: one pydantic model, loadable from YAML.

Each part's settings are declared by that part, once, and composed here: `engine` is
replica/settings.py's EngineSettings, `router` router/settings.py's RouterSettings,
`registry` registry/settings.py's RegistrySettings; replicas, etcd, auth and HTTP are the
deployment's own (cluster/sections.py). `LoraplexConfig` feeds every part:
`engine_config()` the replicas' EngineConfig, `etcd_settings()` the registry clients,
`router.affinity_kwargs()` the affinity router, `registry_api_settings()` the tenant API,
and `to_serve_config()` a Ray Serve config file for `serve deploy` whose application args
are this config again.

Secrets never sit in the file: the admin key is read from the environment variable named
by `auth.admin_key_env` by the ingress process when it starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplex.cluster.sections import AuthSection, EtcdSection, HTTPSection, ReplicaSection
from loraplex.registry.etcd_client import EtcdSettings
from loraplex.registry.settings import RegistrySettings
from loraplex.replica.config import (
    ArtifactReadConfig,
    EngineConfig,
    checkpoint_max_positions,
    context_window,
    plain_engine_config,
)
from loraplex.replica.settings import EngineSettings
from loraplex.router.autoscaling import Homes, LoraAutoscaling, serve_autoscaling_config
from loraplex.router.limits import IngressLimits
from loraplex.router.settings import RouterSettings
from loraplex.settings import describe, setting

APP_NAME = "loraplex"
IMPORT_PATH = "loraplex.cluster.app:build_app"


class LoraplexConfig(BaseModel):
    """A loraplex application: base model, engine, replicas, registry, router and HTTP.

    Relative paths in a YAML file are taken relative to that file's folder."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None,
        description="Hugging Face checkpoint folder (config.json, *.safetensors, "
        "tokenizer.json) or a Llama-family .gguf file, readable on every node; unset: "
        "`loraplex up` uses the demo model (SmolLM2-135M-Instruct).",
    )
    model_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Name clients pass as `model` for the base model; unset: the folder name.",
    )
    engine: EngineSettings = Field(default_factory=EngineSettings, description="Engine.")
    replicas: ReplicaSection = Field(default_factory=ReplicaSection, description="Replicas.")
    etcd: EtcdSection = Field(default_factory=EtcdSection, description="Registry's etcd.")
    artifact_root: str | None = Field(
        None,
        description="Adapter artifact store, shared by every node (NFS/EFS on multi-node); "
        "unset: `loraplex up` uses STATE_DIR/artifacts.",
    )
    artifacts: ArtifactReadConfig = setting(EngineConfig, "artifacts")
    auth: AuthSection = Field(default_factory=AuthSection, description="Admin and metrics keys.")
    registry: RegistrySettings = Field(default_factory=RegistrySettings, description="Tenant API.")
    router: RouterSettings = Field(default_factory=RouterSettings, description="Replica selection.")
    http: HTTPSection = Field(default_factory=HTTPSection, description="HTTP.")
    limits: IngressLimits = Field(
        default_factory=IngressLimits,
        description="Request bodies, prompts, and each tenant's default limits at the ingress.",
    )

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
        return self.engine.resolve_device(self.replicas.num_gpus > 0)

    def engine_config(self) -> dict[str, Any]:
        """EngineConfig as plain values (`scheduler` and `cache` as dicts): what crosses Ray."""
        engine = self.engine.engine_config(
            self.require_model(),
            device=self.device,
            tp=self.replicas.tp,
            artifacts=self.artifacts,
        )
        return plain_engine_config(engine)

    def max_model_len(self) -> int:
        """The context window the engine will use (the checkpoint's own if unset)."""
        positions = checkpoint_max_positions(self.require_model())
        return context_window(self.engine.max_model_len, positions)

    def etcd_settings(self) -> EtcdSettings:
        if self.etcd.endpoints is None:
            raise ValueError(
                "etcd.endpoints is not set: `loraplex up` starts an etcd and fills it in; "
                "for `serve deploy`, list the endpoints of a running etcd"
            )
        return self.etcd.settings(self.etcd.endpoints)

    def overridden(self, section: str, **values: Any) -> LoraplexConfig:
        """A copy with `values` set in `section`, validated like a file's (ValueError)."""
        data = self.model_dump()
        data[section] = {**data[section], **values}
        try:
            return LoraplexConfig.model_validate(data)
        except ValidationError as e:
            raise ValueError(describe(e)) from None

    def with_etcd_endpoints(self, endpoints: list[str]) -> LoraplexConfig:
        return self.model_copy(
            update={"etcd": self.etcd.model_copy(update={"endpoints": list(endpoints)})}
        )

    def registry_api_settings(self, admin_key: str):
        """The tenant API's settings (reads the model's shape for adapter validation)."""
        from loraplex.model_shape import read_model_shape
        from loraplex.registry.api import RegistryAPISettings

        return RegistryAPISettings(
            admin_key=admin_key,
            base_model_id=self.base_model_id,
            base_model=read_model_shape(self.require_model()),
            max_lora_rank=self.engine.max_lora_rank,
            **self.registry.model_dump(),
        )

    def ingress_capacity(self) -> int:
        """Requests the ingresses hold at once: more can never be sent to one replica."""
        return self.http.ingress_replicas * self.http.ingress_max_ongoing_requests

    def demand_window_s(self) -> float:
        """How long replicas remember the adapters' demand (`replicas.autoscaling.lora`'s
        demand_window_s; its default without autoscaling)."""
        lora = (self.replicas.autoscaling or {}).get("lora") or {}
        return LoraAutoscaling(**lora).demand_window_s

    def serve_options(self) -> dict[str, Any]:
        """The options of the replica deployment (replica/deployment.py `deployment`): Serve's
        and its request router's."""
        r = self.replicas
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus},
            "max_ongoing_requests": r.max_ongoing_requests or self.ingress_capacity(),
            "router_kwargs": self.router.affinity_kwargs(),
            "routing_stats_period_s": self.router.stats_period_s,
            "routing_stats_timeout_s": self.router.stats_timeout_s,
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
            homes = Homes(self.router.home_utilisation, self.router.max_homes_per_adapter)
            options["autoscaling_config"] = serve_autoscaling_config(r.autoscaling, homes)
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
