"""The Helm chart's wiring: what the RayService, etcd, storage, Secret and Services rendered
from a value set say, checked against each other and against LoraplexConfig (the model the
app validates its args with)."""

from __future__ import annotations

import base64
import json
import re
import tomllib
from typing import Any

import helm_python
import jsonschema
import pytest
import yaml
from helm_chart import (
    CHART,
    EXTERNAL_ETCD,
    NAMESPACE,
    RELEASE,
    REPO,
    TP_CAP,
    VALUE_SETS,
    Rendered,
    chart_for,
    container,
    render,
    selects,
)

from loraplex.cluster.config import IMPORT_PATH, LoraplexConfig
from loraplex.cluster.helm import ChartValues, schema_text
from loraplex.serve_flags import ray_env


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def case(request, tmp_path_factory) -> tuple[dict[str, Any], Rendered]:
    values = VALUE_SETS[request.param]
    chart = chart_for(values, tmp_path_factory.mktemp(request.param))
    return values, render(values, chart)


def merged(values: dict[str, Any]) -> dict[str, Any]:
    with helm_python.Chart.load(CHART) as chart:
        return chart.merge_values(values)


# one source of truth


def test_committed_schema_is_generated_from_the_config_models():
    committed = (CHART / "values.schema.json").read_text()
    assert committed == schema_text(), (
        "helm/loraplex/values.schema.json is stale: run "
        "`python -m loraplex.cluster.helm helm/loraplex/values.schema.json`"
    )


def test_values_yaml_is_valid_chart_values():
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    ChartValues.model_validate(defaults)
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(defaults, schema, cls=jsonschema.Draft7Validator)


def test_image_recipe_installs_every_package_of_the_ray_version():
    dockerfile = (CHART.parent / "image" / "Dockerfile").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert f"ARG RAY_VERSION={values['rayVersion']}\n" in dockerfile
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY --chown=\S+ (\S+) \1$", dockerfile, re.M))
    assert {f.split("/")[0] for f in folders} == copied


def test_serve_config_is_what_the_cli_deploys(case, tmp_path):
    values, rendered = case
    if rendered.app_args["replicas"]["tp"] > TP_CAP:
        pytest.skip(f"LoraplexConfig accepts tp <= {TP_CAP} until tensor parallelism lands")
    path = tmp_path / "serve.yaml"
    path.write_text(rendered.rayservice["spec"]["serveConfigV2"])
    config = LoraplexConfig.from_yaml(path)  # what `loraplex up --config` reads
    expected = config.to_serve_config()
    served = rendered.serve_config
    (app,) = served.pop("applications")
    (expected_app,) = expected.pop("applications")
    assert served == expected
    assert {k: app[k] for k in ("name", "route_prefix", "import_path")} == {
        k: expected_app[k] for k in ("name", "route_prefix", "import_path")
    }
    assert app["import_path"] == IMPORT_PATH
    # the loraplex values arrive as given, with only the etcd wiring added
    given = merged(values)["loraplex"]
    assert {k: v for k, v in app["args"].items() if k != "etcd"} == {
        k: v for k, v in given.items() if k != "etcd"
    }
    assert config.etcd_settings().endpoints == app["args"]["etcd"]["endpoints"]


# wiring


def test_gpu_limit_of_each_worker_is_tp(case):
    values, rendered = case
    args = rendered.app_args["replicas"]
    gpu = merged(values)["workers"]["gpuResource"]
    pods = rendered.ray_pods()
    head = pods.pop("head")
    assert gpu not in container(head)["resources"].get("limits", {})
    (worker,) = pods.values()
    limits = container(worker)["resources"]["limits"]
    if args["num_gpus"] == 0:
        assert gpu not in limits
    else:
        assert limits[gpu] == args["tp"] == args["num_gpus"]
    if values is VALUE_SETS["tp-2"]:
        assert limits[gpu] == 2


def test_worker_group_size_follows_the_replica_count(case):
    _, rendered = case
    replicas = rendered.app_args["replicas"]
    cluster = rendered.rayservice["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    autoscaling = replicas.get("autoscaling")
    if autoscaling:
        assert cluster["enableInTreeAutoscaling"] is True
        assert (group["minReplicas"], group["maxReplicas"]) == (
            autoscaling["min_replicas"],
            autoscaling["max_replicas"],
        )
    else:
        assert cluster["enableInTreeAutoscaling"] is False
        n = replicas["num_replicas"]
        assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (n, n, n)


def test_etcd_endpoints_are_the_etcd_service_or_the_external_ones(case):
    values, rendered = case
    endpoints = rendered.app_args["etcd"]["endpoints"]
    if values.get("etcd", {}).get("external"):
        assert endpoints == EXTERNAL_ETCD
        assert not rendered.of_kind("StatefulSet") and not rendered.of_kind("NetworkPolicy")
        assert not [s for s in rendered.of_kind("Service") if "etcd" in s["metadata"]["name"]]
        return
    statefulset = rendered.one("StatefulSet")
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    (client,) = [
        s
        for s in rendered.of_kind("Service")
        if selects(s["spec"]["selector"], pod_labels) and s["spec"].get("clusterIP") != "None"
    ]
    (port,) = [p["port"] for p in client["spec"]["ports"] if p["targetPort"] == "client"]
    assert endpoints == [f"{client['metadata']['name']}.{NAMESPACE}.svc:{port}"]


def test_external_etcd_tls_files_come_from_the_secret(case):
    values, rendered = case
    secret = values.get("etcd", {}).get("external", {}).get("tlsSecret")
    etcd = rendered.app_args["etcd"]
    for pod in rendered.ray_pods().values():
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container(pod)["volumeMounts"]}
        if not secret:
            assert "etcd-tls" not in volumes and etcd.get("ca_cert") is None
            continue
        assert volumes["etcd-tls"]["secret"]["secretName"] == secret
        for field, key in (("ca_cert", "ca.crt"), ("cert", "tls.crt"), ("key", "tls.key")):
            folder, name = etcd[field].rsplit("/", 1)
            assert name == key and volumes[mounts[folder]] == volumes["etcd-tls"]


def test_artifact_volume_is_mounted_at_the_artifact_root(case):
    values, rendered = case
    root = rendered.app_args["artifact_root"]
    existing = values.get("artifacts", {}).get("existingClaim")
    if existing:
        claim = existing
        assert not rendered.of_kind("PersistentVolumeClaim")
    else:
        pvc = rendered.one("PersistentVolumeClaim")
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        assert pvc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE  # README
        claim = pvc["metadata"]["name"]
    pods = rendered.ray_pods()
    assert len(pods) == 2  # head (ingress may run there) and the worker group
    for pod in pods.values():
        mounts = {m["mountPath"]: m["name"] for m in container(pod)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes[mounts[root]]["persistentVolumeClaim"]["claimName"] == claim


def test_model_claim_is_mounted_read_only_where_the_model_lives(case):
    values, rendered = case
    claim = values.get("modelVolume", {}).get("existingClaim")
    for pod in rendered.ray_pods().values():
        mounts = [m for m in container(pod)["volumeMounts"] if m["name"] == "model"]
        if not claim:
            assert not mounts
            continue
        (mount,) = mounts
        assert mount["readOnly"] is True
        assert rendered.app_args["model"].startswith(mount["mountPath"] + "/")


def test_every_ray_pod_starts_ray_with_the_ingress_proxy_flags_of_the_app_s_config(case):
    """Ray reads `http.ingress_proxy` from the environment it starts in, not from the app's
    args: every Ray pod's env says what the args say (cluster/ingress_proxy.py)."""
    _, rendered = case
    wanted = ray_env(rendered.app_args["http"].get("ingress_proxy", "serve"))
    for pod in rendered.ray_pods().values():
        env = {e["name"]: e.get("value") for e in container(pod)["env"]}
        assert {name: env.get(name) for name in wanted} == wanted


def test_admin_key_reaches_the_app_from_the_secret(case):
    values, rendered = case
    env_name = rendered.app_args["auth"]["admin_key_env"]
    existing = values.get("adminKey", {}).get("existingSecret")
    for pod in rendered.ray_pods().values():
        (env,) = [e for e in container(pod)["env"] if e["name"] == env_name]
        ref = env["valueFrom"]["secretKeyRef"]
        if existing:
            assert ref == {"name": existing, "key": values["adminKey"]["secretKey"]}
            assert "Secret" not in rendered.named("prod-loraplex-admin-key")
            continue
        secret = rendered.one("Secret", ref["name"])
        key = base64.b64decode(secret["data"][ref["key"]]).decode()
        assert len(key) >= 16  # what the ingress requires
        assert key not in rendered.rayservice["spec"]["serveConfigV2"]


def test_metrics_key_reaches_the_app_and_the_service_monitor(case):
    """/metrics wants the metrics key: the ingress reads it from the env var the config
    names, and the ServiceMonitor sends it from the same Secret."""
    values, rendered = case
    env_name = rendered.app_args["auth"]["metrics_key_env"]
    existing = values.get("metricsKey", {}).get("existingSecret")
    refs = []
    for pod in rendered.ray_pods().values():
        (env,) = [e for e in container(pod)["env"] if e["name"] == env_name]
        refs.append(env["valueFrom"]["secretKeyRef"])
    (ref,) = {tuple(sorted(r.items())) for r in refs}
    ref = dict(ref)
    if existing:
        assert ref == {"name": existing, "key": values["metricsKey"]["secretKey"]}
    else:
        secret = rendered.one("Secret", ref["name"])
        key = base64.b64decode(secret["data"][ref["key"]]).decode()
        assert len(key) >= 16  # what the ingress requires
        assert key not in rendered.rayservice["spec"]["serveConfigV2"]
    if values.get("serviceMonitor", {}).get("enabled"):
        (endpoint,) = rendered.one("ServiceMonitor")["spec"]["endpoints"]
        assert endpoint["authorization"] == {"type": "Bearer", "credentials": ref}


def test_router_service_reaches_the_serve_proxies(case):
    values, rendered = case
    router = rendered.one("Service", "prod-loraplex-router")
    port = router["spec"]["ports"][0]
    for pod in rendered.ray_pods().values():
        labels = {**pod["metadata"]["labels"], "ray.io/serve": "true"}  # set by KubeRay
        assert selects(router["spec"]["selector"], labels)
        ports = {p["name"]: p["containerPort"] for p in container(pod)["ports"]}
        assert ports[port["targetPort"]] == rendered.app_args["http"]["port"]
    assert rendered.serve_config["http_options"]["host"] == "0.0.0.0"
    ingress = values.get("ingress", {})
    if not ingress.get("enabled"):
        assert not rendered.of_kind("Ingress")
        return
    spec = rendered.one("Ingress")["spec"]
    assert spec["tls"] == [{"hosts": [ingress["host"]], "secretName": ingress["tlsSecret"]}]
    (rule,) = spec["rules"]
    assert rule["host"] == ingress["host"]
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": router["metadata"]["name"], "port": {"name": port["name"]}}


def test_service_monitor_scrapes_the_router_metrics(case):
    values, rendered = case
    if not values.get("serviceMonitor", {}).get("enabled"):
        assert not rendered.of_kind("ServiceMonitor")
        return
    router = rendered.one("Service", "prod-loraplex-router")
    monitor = rendered.one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert selects(monitor["spec"]["selector"]["matchLabels"], router["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == router["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


def test_etcd_members_form_one_cluster_through_the_headless_service(case):
    values, rendered = case
    if not rendered.of_kind("StatefulSet"):
        return
    statefulset = rendered.one("StatefulSet")
    spec = statefulset["spec"]
    n = merged(values)["etcd"]["replicas"]
    assert spec["replicas"] == n
    headless = rendered.one("Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == {
        "client": 2379,
        "peer": 2380,
    }
    pod = spec["template"]
    assert selects(headless["spec"]["selector"], pod["metadata"]["labels"])
    env = {e["name"]: e.get("value") for e in container(pod)["env"]}
    name = statefulset["metadata"]["name"]
    domain = f"{spec['serviceName']}.{NAMESPACE}.svc"
    assert env["ETCD_INITIAL_CLUSTER"].split(",") == [
        f"{name}-{i}=http://{name}-{i}.{domain}:2380" for i in range(n)
    ]
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE  # README
    assert container(pod)["volumeMounts"] == [
        {"name": claim["metadata"]["name"], "mountPath": env["ETCD_DATA_DIR"]}
    ]
    anti = pod["spec"]["affinity"]["podAntiAffinity"]
    if merged(values)["etcd"]["antiAffinity"] == "hard":
        (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert selects(term["labelSelector"]["matchLabels"], pod["metadata"]["labels"])
    else:
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti
    budgets = rendered.of_kind("PodDisruptionBudget")
    if n == 1:
        assert not budgets  # a lone member cannot spare itself; drains must not hang on it
    else:
        (budget,) = budgets
        assert budget["spec"]["minAvailable"] == n // 2 + 1  # quorum
        assert selects(budget["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])


def test_network_policy_admits_only_the_app_to_etcd(case):
    values, rendered = case
    policies = rendered.of_kind("NetworkPolicy")
    if not merged(values)["networkPolicy"]["enabled"] or not rendered.of_kind("StatefulSet"):
        assert not policies
        return
    (policy,) = policies
    etcd_labels = rendered.one("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], etcd_labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    client_peers = [
        rule["from"][0]["podSelector"]["matchLabels"]
        for rule in policy["spec"]["ingress"]
        if {"protocol": "TCP", "port": 2379} in rule["ports"]
    ]
    for pod in rendered.ray_pods().values():
        assert any(selects(peer, pod["metadata"]["labels"]) for peer in client_peers)
    router_labels = rendered.one("Service", "prod-loraplex-router")["metadata"]["labels"]
    other_pod = {**router_labels, "app.kubernetes.io/component": "other"}
    assert not any(selects(peer, other_pod) for peer in client_peers)


def test_notes_tell_how_to_reach_the_api_and_create_a_tenant(case):
    values, rendered = case
    notes = rendered.notes
    assert "POST $LORAPLEX_URL/v1/tenants" in notes
    secret = values.get("adminKey", {}).get("existingSecret") or "prod-loraplex-admin-key"
    assert f"get secret {secret}" in notes
    if values.get("ingress", {}).get("enabled"):
        assert "LORAPLEX_URL=https://llm.example.com" in notes
    elif merged(values)["router"]["type"] == "ClusterIP":
        assert "port-forward svc/prod-loraplex-router" in notes


# refusals


SCHEMA_REFUSALS = {
    "replica count below LoraplexConfig's minimum": (
        {"loraplex": {"replicas": {"num_replicas": 0}}},
        "/loraplex/replicas/num_replicas",
    ),
    "unknown engine setting": ({"loraplex": {"engine": {"dtyp": "float16"}}}, "/loraplex/engine"),
    "dtype outside the accepted list": (
        {"loraplex": {"engine": {"dtype": "int4"}}},
        "/loraplex/engine/dtype",
    ),
    f"tp above {TP_CAP}": ({"loraplex": {"replicas": {"tp": TP_CAP + 1}}}, "/loraplex/replicas/tp"),
    "even etcd member count": ({"etcd": {"replicas": 2}}, "/etcd/replicas"),
    "external endpoint with a scheme": (
        {"etcd": {"external": {"endpoints": ["http://etcd:2379"]}}},
        "/etcd/external/endpoints/0",
    ),
    "storage size that is no quantity": ({"artifacts": {"size": "lots"}}, "/artifacts/size"),
    "service type": ({"router": {"type": "Ingress"}}, "/router/type"),
    "required value removed": ({"image": {"tag": None}}, "/image"),
    "unknown top-level value": ({"replicaCount": 3}, "replicaCount"),
}


@pytest.mark.parametrize("values, where", SCHEMA_REFUSALS.values(), ids=list(SCHEMA_REFUSALS))
def test_bad_values_fail_the_schema(values, where):
    with pytest.raises(helm_python.HelmValuesError, match="schema") as error:
        render(values)
    assert where in str(error.value)


TEMPLATE_REFUSALS = {
    "gpus other than 0 or tp": (
        {"loraplex": {"replicas": {"num_gpus": 2}}},
        "num_gpus must be 0 (CPU serving) or tp",
    ),
    "etcd endpoints in the app config": (
        {"loraplex": {"etcd": {"endpoints": ["etcd:2379"]}}},
        "set etcd.external.endpoints",
    ),
    "etcd password in the serve config": (
        {"loraplex": {"etcd": {"username": "app", "password": "hunter2"}}},
        "readable in the RayService",
    ),
    "proxy bound to loopback": (
        {"loraplex": {"http": {"host": "127.0.0.1"}}},
        "loraplex.http.host must be 0.0.0.0",
    ),
    "relative artifact root": (
        {"loraplex": {"artifact_root": "artifacts"}},
        "must be an absolute path",
    ),
    "no model": ({"loraplex": {"model": None}}, "loraplex.model is not set"),
    "GPUs in worker resources": (
        {"workers": {"resources": {"limits": {"nvidia.com/gpu": 4}}}},
        "must not name nvidia.com/gpu",
    ),
    "TLS secret for the chart's own etcd": (
        {"etcd": {"external": {"tlsSecret": "etcd-tls"}}},
        "tlsSecret is set but etcd.external.endpoints is empty",
    ),
}


@pytest.mark.parametrize("values, message", TEMPLATE_REFUSALS.values(), ids=list(TEMPLATE_REFUSALS))
def test_inconsistent_values_fail_with_a_message(values, message):
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        render(values)
