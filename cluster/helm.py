"""The Helm chart's values (helm/loraplex): their shape, limits and meaning, and the chart's
`values.schema.json` generated from them.

`ChartValues.loraplex` IS `LoraplexConfig`, the model `loraplex up` and `serve deploy` use:
the chart passes that section to the Serve app as its args, so the schema Helm checks at
install and the model the app validates at start cannot drift apart. The other sections
describe Kubernetes objects. They carry no defaults here: `values.yaml` is the one place
defaults live, and every key of it is required by the schema, so a value removed with
`--set key=null` fails at install instead of rendering half an object.

    python -m loraplex.cluster.helm helm/loraplex/values.schema.json    # regenerate
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.cluster.config import LoraplexConfig

# Draft 7: what every Helm 3 and 4 validates with; pydantic's output uses nothing newer
# (`$ref` into `$defs` is a plain JSON pointer there).
JSON_SCHEMA_DIALECT = "http://json-schema.org/draft-07/schema#"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_OPTIONAL_DNS_NAME = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$"
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|M|G|T|P)?$"
_ABSOLUTE_PATH = r"^/"
_HOST_PORT = r"^[^:/\s]+:[0-9]{1,5}$"
_DURATION = r"^[0-9]+(ms|s|m|h)$"

Resources = dict[str, Any]  # a core/v1 ResourceRequirements; the Kubernetes schema checks it


class _Values(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Image(_Values):
    """A container image."""

    repository: str = Field(min_length=1, description="Image repository.")
    tag: str = Field(description="Image tag; empty: the chart's appVersion.")
    pullPolicy: Literal["Always", "IfNotPresent", "Never"] = Field(description="Pull policy.")


class Scheduling(_Values):
    """Where a group of pods runs and what it reserves."""

    resources: Resources = Field(description="Container resources (requests, limits).")
    nodeSelector: dict[str, str] = Field(description="Node labels the pods require.")
    tolerations: list[dict[str, Any]] = Field(description="Taints the pods tolerate.")
    affinity: dict[str, Any] = Field(description="Pod affinity and node affinity.")


class Head(Scheduling):
    """The Ray head pod: GCS, dashboard, Serve controller; ingress replicas may run here."""

    rayStartParams: dict[str, str] = Field(
        description="`ray start` options; num-cpus 0 keeps engine replicas off the head."
    )


class Workers(Scheduling):
    """The worker group: one pod per engine replica, with `loraplex.replicas.tp` GPUs each.
    Its size follows `loraplex.replicas` (num_replicas, or autoscaling's bounds)."""

    groupName: str = Field(pattern=_DNS_LABEL, max_length=63, description="Worker group name.")
    gpuResource: str = Field(
        min_length=1,
        description="Extended resource name of one GPU; each worker's limit of it is set to "
        "loraplex.replicas.num_gpus (= tp), never here.",
    )
    rayStartParams: dict[str, str] = Field(description="`ray start` options of the workers.")


class ModelVolume(_Values):
    """Where the base model's checkpoint folder comes from on head and workers."""

    existingClaim: str = Field(
        pattern=_OPTIONAL_DNS_NAME,
        description="PersistentVolumeClaim holding checkpoints, mounted read-only at "
        "mountPath; empty: the image must carry loraplex.model.",
    )
    mountPath: str = Field(pattern=_ABSOLUTE_PATH, description="Mount path of existingClaim.")


class Artifacts(_Values):
    """Adapter artifact storage, mounted at loraplex.artifact_root on head and workers."""

    existingClaim: str = Field(
        pattern=_OPTIONAL_DNS_NAME,
        description="A ReadWriteMany PersistentVolumeClaim to use; empty: the chart makes one.",
    )
    size: str = Field(pattern=_QUANTITY, description="Size of the claim the chart makes.")
    storageClassName: str = Field(
        description="StorageClass of the claim the chart makes (one offering ReadWriteMany: "
        "NFS, EFS, Filestore, CephFS); empty: the cluster's default."
    )


class EtcdStorage(_Values):
    """Each etcd member's data volume."""

    size: str = Field(pattern=_QUANTITY, description="Size of one member's claim.")
    storageClassName: str = Field(description="StorageClass; empty: the cluster's default.")


class ExternalEtcd(_Values):
    """An etcd run elsewhere; set endpoints to use it instead of the chart's."""

    endpoints: list[Annotated[str, Field(pattern=_HOST_PORT)]] = Field(
        description="Client endpoints as host:port; empty: the chart runs etcd."
    )
    tlsSecret: str = Field(
        pattern=_OPTIONAL_DNS_NAME,
        description="Secret with ca.crt, tls.crt and tls.key for mutual TLS to the external "
        "etcd; empty: plain connections.",
    )


class Etcd(Scheduling):
    """The registry's etcd: a StatefulSet with a headless service, or an external one."""

    replicas: Literal[1, 3, 5] = Field(
        description="Members; fixed at install (changing it needs etcd member add/remove)."
    )
    image: Image = Field(description="etcd image (its entrypoint is the etcd binary).")
    storage: EtcdStorage = Field(description="Data volumes.")
    antiAffinity: Literal["hard", "soft"] = Field(
        description="hard: members never share a node; soft: preferably not."
    )
    external: ExternalEtcd = Field(description="Use an etcd run elsewhere.")


class RouterService(_Values):
    """The Service in front of the Serve HTTP proxies (ingress deployment)."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(description="Service type.")
    port: int = Field(ge=1, le=65535, description="Service port.")
    annotations: dict[str, str] = Field(description="Service annotations.")


class Ingress(_Values):
    """An optional Ingress to the router Service."""

    enabled: bool = Field(description="Make the Ingress.")
    className: str = Field(description="IngressClass; empty: the cluster's default.")
    host: str = Field(
        pattern=_OPTIONAL_DNS_NAME, description="Host name; empty: every host (no TLS then)."
    )
    tlsSecret: str = Field(
        pattern=_OPTIONAL_DNS_NAME,
        description="Secret holding the certificate of host; empty: plain HTTP.",
    )
    annotations: dict[str, str] = Field(
        description="Ingress annotations (turn proxy buffering off for streamed responses)."
    )


class AdminKey(_Values):
    """The admin key, put in the env var loraplex.auth.admin_key_env of head and workers."""

    existingSecret: str = Field(
        pattern=_OPTIONAL_DNS_NAME,
        description="Secret holding the key (16+ characters); empty: the chart generates "
        "one at install and keeps it on upgrade.",
    )
    secretKey: str = Field(
        pattern=r"^[-._a-zA-Z0-9]+$", description="Key of the Secret's data holding it."
    )


class MetricsKey(_Values):
    """The key /metrics wants as its bearer token (it shows every tenant's name and token
    counts), put in the env var loraplex.auth.metrics_key_env of head and workers; the
    ServiceMonitor sends it."""

    existingSecret: str = Field(
        pattern=_OPTIONAL_DNS_NAME,
        description="Secret holding the key (16+ characters); empty: the chart generates "
        "one at install and keeps it on upgrade.",
    )
    secretKey: str = Field(
        pattern=r"^[-._a-zA-Z0-9]+$", description="Key of the Secret's data holding it."
    )


class ServiceMonitor(_Values):
    """A Prometheus Operator ServiceMonitor scraping /metrics through the router Service."""

    enabled: bool = Field(description="Make it (needs the monitoring.coreos.com CRDs).")
    interval: str = Field(pattern=_DURATION, description="Scrape interval.")
    labels: dict[str, str] = Field(description="Labels your Prometheus selects monitors by.")


class NetworkPolicy(_Values):
    """Who may reach the chart's etcd."""

    enabled: bool = Field(description="Only the app's Ray pods reach etcd's client port.")


class ChartValues(_Values):
    """Values of helm/loraplex."""

    nameOverride: str = Field(pattern=_OPTIONAL_DNS_NAME, description="Replaces the chart name.")
    fullnameOverride: str = Field(
        pattern=_OPTIONAL_DNS_NAME, description="Replaces release-chart in object names."
    )
    image: Image = Field(description="Ray with loraplex installed (helm/image/Dockerfile).")
    imagePullSecrets: list[dict[str, str]] = Field(description="Pull secrets of every pod.")
    rayVersion: str = Field(
        pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$", description="Ray version inside the image."
    )
    head: Head = Field(description="Ray head.")
    workers: Workers = Field(description="Ray GPU worker group.")
    modelVolume: ModelVolume = Field(description="Base model checkpoints.")
    artifacts: Artifacts = Field(description="Adapter artifact storage.")
    etcd: Etcd = Field(description="Registry etcd.")
    router: RouterService = Field(description="Router Service.")
    ingress: Ingress = Field(description="Ingress.")
    adminKey: AdminKey = Field(description="Admin key Secret.")
    metricsKey: MetricsKey = Field(description="Metrics key Secret (/metrics).")
    serviceMonitor: ServiceMonitor = Field(description="Prometheus ServiceMonitor.")
    networkPolicy: NetworkPolicy = Field(description="NetworkPolicy around etcd.")
    loraplex: LoraplexConfig = Field(
        description="The application's config (cluster/config.py), passed to the Serve app as "
        "its args; the chart fills in etcd.endpoints (and TLS files)."
    )


def values_schema() -> dict[str, Any]:
    """values.schema.json: ChartValues as a JSON Schema."""
    return {"$schema": JSON_SCHEMA_DIALECT, **ChartValues.model_json_schema()}


def schema_text() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m loraplex.cluster.helm PATH/values.schema.json", file=sys.stderr)
        return 2
    Path(argv[0]).write_text(schema_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
