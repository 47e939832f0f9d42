"""The Ray Serve application: N replica deployments behind one ingress deployment.

`build_app(args)` is the `import_path` target of the Serve config file (`serve deploy`),
and what `loraplex up` runs. `args` is a `LoraplexConfig` as a dict.

    HTTP ─▶ Ingress (router/ingress.py app: auth, tokenize, tenant API, /metrics)
              └─ ServeBackend over a DeploymentHandle ─▶ replica (replica/deployment.py),
                 routed by the adapter-affinity request router
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import TYPE_CHECKING, Any

from ray import serve

from loraplex.cluster.config import LoraplexConfig

if TYPE_CHECKING:
    from fastapi import FastAPI
    from ray.serve import Application
    from ray.serve.handle import DeploymentHandle

INGRESS_NAME = "ingress"


@serve.ingress()
class Ingress:
    """Builds router/ingress.py's app at replica start (`__serve_build_asgi_app__`, after
    `__init__`), over a ServeBackend that calls the replica deployment."""

    def __init__(self, replicas: DeploymentHandle, config: dict[str, Any]):
        self.replicas = replicas
        self.config = LoraplexConfig.model_validate(config)
        env = self.config.auth.admin_key_env
        admin_key = os.environ.get(env, "")  # the one read of the environment, at start
        if len(admin_key) < 16:
            raise RuntimeError(
                f"the ingress needs the admin key (16+ characters) in ${env} on every node; "
                f"set it in the environment `ray start` runs in"
            )
        self.admin_key = admin_key
        metrics_env = self.config.auth.metrics_key_env
        self.metrics_key = os.environ.get(metrics_env) or None
        if self.metrics_key is not None and len(self.metrics_key) < 16:
            raise RuntimeError(f"the metrics key in ${metrics_env} needs 16+ characters")

    async def __serve_build_asgi_app__(self) -> FastAPI:
        from loraplex.registry.artifacts import ArtifactStore
        from loraplex.registry.store import RegistryStore
        from loraplex.registry.watch import RegistryWatcher
        from loraplex.replica.tokenizer import Tokenizer
        from loraplex.router.ingress import RegistryHandles, build_ingress
        from loraplex.router.ledger_actor import RayLedger
        from loraplex.router.live_routers import placement_counts, routing_snapshot
        from loraplex.router.serve_backend import ServeBackend

        config = self.config
        etcd = config.etcd_settings()
        # Unstarted: the app's lifespan starts and stops them on this replica's event loop.
        registry = RegistryHandles(
            store=RegistryStore(etcd),
            watcher=RegistryWatcher(etcd),
            artifacts=await asyncio.to_thread(ArtifactStore, config.artifact_root),
            settings=await asyncio.to_thread(config.registry_api_settings, self.admin_key),
        )
        return build_ingress(
            ServeBackend(self.replicas, first_chunk_timeout_s=config.router.first_chunk_timeout_s),
            await asyncio.to_thread(Tokenizer, config.require_model()),
            base_model_id=config.base_model_id,
            max_model_len=await asyncio.to_thread(config.max_model_len),
            registry=registry,
            routing=functools.partial(routing_snapshot, config.router.metrics_top_adapters),
            placements=placement_counts,
            limits=config.limits,
            metrics_key=self.metrics_key,
            ledger=RayLedger(config.limits.tenant_ledger_sync_s),
        )


def app_parts() -> tuple[type, ...]:
    """What the app is built from, imported (ImportError names a part this install lacks:
    `loraplex up` checks before starting anything)."""
    from loraplex.replica.deployment import ReplicaDeployment
    from loraplex.router.ingress import RegistryHandles
    from loraplex.router.serve_backend import ServeBackend

    return ReplicaDeployment, RegistryHandles, ServeBackend


def build_app(args: dict[str, Any]) -> Application:
    """The application for `args` (LoraplexConfig fields). ValueError when it cannot be
    deployed as configured (no model, no etcd endpoints, no artifact root)."""
    from loraplex.replica.deployment import deployment

    config = LoraplexConfig.model_validate(args)
    etcd = config.etcd_settings()
    engine = config.engine_config()
    if config.artifact_root is None:
        raise ValueError("artifact_root is not set: name a folder every node can read")
    replicas = deployment(**config.serve_options()).bind(
        engine, etcd.model_dump(), config.artifact_root, config.demand_window_s()
    )
    ingress = serve.deployment(
        Ingress,
        name=INGRESS_NAME,
        num_replicas=config.http.ingress_replicas,
        max_ongoing_requests=config.http.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": config.http.ingress_num_cpus},
    )
    return ingress.bind(replicas, config.model_dump(mode="json"))
