"""Rendering helm/loraplex offline for the chart tests, and reading what it rendered.

`render(values)` runs Helm's own engine (helm-python-sdk binds Helm's Go SDK, no binary):
values are checked against values.schema.json and templates run as `helm install` would
run them, with no cluster (`lookup` finds nothing).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import yaml

from loraplex.cluster.helm import values_schema

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "loraplex"
# The KubeRay RayService CRD, shared beside the repository (never copied into it).
KUBERAY_CRD = REPO.parent / "shared" / "schemas" / "kuberay_ray.io_rayservices.yaml"
RELEASE = "prod"
NAMESPACE = "llm"
# The largest tensor-parallel degree LoraplexConfig accepts today.
TP_CAP: int = values_schema()["$defs"]["ReplicaSection"]["properties"]["tp"]["maximum"]

# Value sets the chart is rendered, linted and validated with.
EXTERNAL_ETCD = ["etcd-0.db.internal:2379", "etcd-1.db.internal:2379"]

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external-etcd": {
        "etcd": {"external": {"endpoints": EXTERNAL_ETCD, "tlsSecret": "etcd-client-tls"}}
    },
    "existing-pvc": {
        "artifacts": {"existingClaim": "shared-adapters"},
        "modelVolume": {"existingClaim": "checkpoints", "mountPath": "/models"},
        "adminKey": {"existingSecret": "ops-admin", "secretKey": "key"},
        "loraplex": {"artifact_root": "/srv/adapters"},
    },
    "tp-2": {"loraplex": {"replicas": {"tp": 2, "num_gpus": 2, "num_replicas": 3}}},
    "ingress": {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "host": "llm.example.com",
            "tlsSecret": "llm-example-tls",
            "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
        },
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "loraplex": {"http": {"ingress_proxy": "haproxy"}},
    },
    "cpu-autoscaling": {
        "loraplex": {
            "replicas": {"num_gpus": 0, "autoscaling": {"min_replicas": 1, "max_replicas": 4}}
        },
        "etcd": {"replicas": 1, "antiAffinity": "soft"},
        "networkPolicy": {"enabled": False},
        "router": {"type": "LoadBalancer", "port": 80, "annotations": {}},
    },
}


@dataclass
class Rendered:
    """The objects one render produced, and NOTES.txt."""

    objects: list[dict[str, Any]]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def named(self, name: str) -> set[str]:
        return {o["kind"] for o in self.objects if o["metadata"]["name"] == name}

    @property
    def rayservice(self) -> dict[str, Any]:
        return self.one("RayService")

    @property
    def serve_config(self) -> dict[str, Any]:
        return yaml.safe_load(self.rayservice["spec"]["serveConfigV2"])

    @property
    def app_args(self) -> dict[str, Any]:
        (app,) = self.serve_config["applications"]
        return app["args"]

    def ray_pods(self) -> dict[str, dict[str, Any]]:
        """Pod templates of the head and of every worker group, by group."""
        cluster = self.rayservice["spec"]["rayClusterConfig"]
        pods = {"head": cluster["headGroupSpec"]["template"]}
        for group in cluster["workerGroupSpecs"]:
            pods[group["groupName"]] = group["template"]
        return pods


def chart_for(values: dict[str, Any], tmp_path: Path) -> Path:
    """The chart; for a tp above TP_CAP, a copy whose schema lifts only that cap, so that the
    templates' tp wiring is tested before LoraplexConfig accepts tp > 1."""
    tp = values.get("loraplex", {}).get("replicas", {}).get("tp", 1)
    if tp <= TP_CAP:
        return CHART
    copy = tmp_path / "loraplex"
    shutil.copytree(CHART, copy)
    schema = values_schema()
    schema["$defs"]["ReplicaSection"]["properties"]["tp"]["maximum"] = tp
    (copy / "values.schema.json").write_text(json.dumps(schema))
    return copy


def render(values: dict[str, Any] | None = None, chart: Path = CHART) -> Rendered:
    with helm_python.Chart.load(chart) as loaded:
        manifests = loaded.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects += [o for o in yaml.safe_load_all(text) if o]
    return Rendered(objects, notes)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container(pod_template: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_template["spec"]["containers"]
    return only
