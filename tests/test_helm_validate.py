"""The chart lints clean under `helm lint --strict`, and every object it renders is one the
API server accepts: core kinds against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: unknown fields refused), the RayService against KubeRay's CRD schema."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_chart import CHART, KUBERAY_CRD, NAMESPACE, RELEASE, VALUE_SETS, chart_for, render

# The chart's floor (Chart.yaml kubeVersion) and the release the helm binary below targets.
KUBE_VERSIONS = ("1.30.0", "1.35.0")
# Kinds of operators' CRDs: checked against their CRD schema (RayService) or field by field.
CUSTOM_KINDS = {"RayService", "ServiceMonitor"}


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def value_set(request, tmp_path_factory):
    values = VALUE_SETS[request.param]
    return values, chart_for(values, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_lint_strict_is_clean(value_set, kube_version):
    values, chart = value_set
    report = helm_python.lint(
        chart, values, strict=True, namespace=NAMESPACE, kube_version=f"v{kube_version}"
    )
    assert report["errors"] == []
    # severity 2 = warning, 3 = error; --strict fails on either
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_core_object_validates_strictly(value_set, kube_version):
    values, chart = value_set
    objects = [o for o in render(values, chart).objects if o["kind"] not in CUSTOM_KINDS]
    assert len(objects) >= 3
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{where} is invalid on Kubernetes {kube_version}: {path}: {e.message}")


def strict_crd_schema(schema: Any) -> Any:
    """The CRD's schema refusing unknown fields, as the API server does under strict field
    validation (`kubectl apply --validate=strict`), except where the CRD keeps them."""
    if isinstance(schema, list):
        return [strict_crd_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_crd_schema(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def rayservice_schema() -> dict[str, Any]:
    if not KUBERAY_CRD.exists():
        pytest.skip(f"the KubeRay CRD is not at {KUBERAY_CRD} (shared/ beside the repository)")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(KUBERAY_CRD.read_text(), Loader=loader)
    assert crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict_crd_schema(v1["schema"]["openAPIV3Schema"])


def test_rayservice_validates_against_the_kuberay_crd(value_set, rayservice_schema):
    values, chart = value_set
    rayservice = render(values, chart).rayservice
    assert rayservice["apiVersion"] == "ray.io/v1"
    errors = sorted(jsonschema.Draft7Validator(rayservice_schema).iter_errors(rayservice), key=str)
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:10])


def test_strict_crd_schema_refuses_a_misspelt_field(rayservice_schema):
    rayservice = render().rayservice
    rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    with pytest.raises(jsonschema.ValidationError, match="rayStartParam"):
        jsonschema.validate(rayservice, rayservice_schema, cls=jsonschema.Draft7Validator)


def test_rayservice_has_what_kuberay_requires():
    """Without the CRD at hand, the fields the v1 schema requires, checked by name."""
    spec = render().rayservice["spec"]
    cluster = spec["rayClusterConfig"]
    assert isinstance(spec["serveConfigV2"], str)
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"] and group["template"]["spec"]["containers"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def helm_binary() -> str | None:
    return os.environ.get("HELM_BIN") or shutil.which("helm")


@pytest.mark.skipif(
    helm_binary() is None,
    reason="no helm binary (HELM_BIN or PATH); DEVELOPERS.md tells how to get one",
)
def test_helm_binary_agrees_with_the_sdk(tmp_path):
    helm = helm_binary()
    lint = subprocess.run(
        [helm, "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=120
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    values = VALUE_SETS["ingress"]
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    template = subprocess.run(
        [helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    by_binary = [o for o in yaml.safe_load_all(template.stdout) if o]
    by_sdk = render(values).objects
    for objects in (by_binary, by_sdk):  # the generated admin key differs run to run
        for secret in (o for o in objects if o["kind"] == "Secret"):
            secret["data"] = sorted(secret["data"])

    def key(o):
        return (o["kind"], o["metadata"]["name"])

    assert sorted(by_binary, key=key) == sorted(by_sdk, key=key)
