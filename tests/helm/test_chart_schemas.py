"""The chart lints clean and every manifest it renders is valid: core kinds against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields are errors), the RayCluster against KubeRay's CRD (vendored in
schemas/, made strict the same way), for the default values and for the CI values file."""

from __future__ import annotations

import copy
import hashlib
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helm.conftest import CHART, CI_VALUES, Rendered, ci_values

SCHEMAS = Path(__file__).parent / "schemas"
RAYCLUSTER_CRD = SCHEMAS / "ray.io_rayclusters.yaml"
# the git blob id of the vendored CRD's body (below its comment header), as in KubeRay v1.7.0
RAYCLUSTER_CRD_BLOB = "ff0be58ada3bd457605eff1f258c16df21e61e21"
# the chart's kubeVersion floor, and the newest release kubernetes-validate knows
KUBE_VERSIONS = ("1.27", "1.37")
# kinds validated elsewhere: the RayCluster against the vendored CRD; the ServiceMonitor (Prometheus Operator's
# CRD is not vendored) by the wiring tests
CUSTOM_KINDS = {"RayCluster", "ServiceMonitor"}


def _values(name: str) -> dict[str, Any] | None:
    return None if name == "default" else ci_values()


# ------------------------------------------------------------------------------------------------------ lint
@pytest.mark.parametrize("values", ["default", "ci"])
def test_helm_lint_is_clean(values: str) -> None:
    report = helm.lint(CHART, _values(values), strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    # severity 1 is information (only "icon is recommended"); 2 warnings and 3 errors fail
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [], problems


def test_helm_lint_reports_a_broken_template(tmp_path: Path) -> None:
    """The lint test above can fail: the same call on a copy of the chart with a broken template reports it."""
    import shutil

    broken = tmp_path / "ballast"
    shutil.copytree(CHART, broken)
    (broken / "templates" / "api-service.yaml").write_text("{{ .Values.api.port | nope }}\n")
    report = helm.lint(broken, None, strict=True, kube_version="v1.30.0")
    assert report["errors"] or any(m["severity"] >= 2 for m in report["messages"])


def test_ci_values_file_turns_on_what_it_is_for(ci_render: Rendered) -> None:
    assert {"HorizontalPodAutoscaler", "Ingress", "ServiceMonitor", "ConfigMap"} <= set(ci_render.kinds())
    ray = ci_render.raycluster()["spec"]
    assert ray["enableInTreeAutoscaling"] is True
    assert ray["workerGroupSpecs"][0]["maxReplicas"] > ray["workerGroupSpecs"][0]["minReplicas"]
    assert ci_values()["checkpoints"]["storage"] == "s3"
    assert ci_values()["rayCluster"]["worker"]["gpus"] > 0
    assert CI_VALUES.name == "gpu-s3-ingress-values.yaml"


# ------------------------------------------------------------------------------------------ core manifests
def _core_docs(rendered: Rendered) -> list[dict[str, Any]]:
    return [d for d in rendered.docs if d["kind"] not in CUSTOM_KINDS]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", ["default", "ci"])
def test_core_manifests_validate_against_kubernetes_schemas(
    values: str, kube_version: str, default_render: Rendered, ci_render: Rendered
) -> None:
    rendered = default_render if values == "default" else ci_render
    docs = _core_docs(rendered)
    assert len(docs) >= 6
    errors = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:  # SchemaNotFoundError (an unknown kind) propagates
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")
    assert errors == []


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("Deployment", lambda d: d["spec"].__setitem__("replicas", "two")),
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("readinesProbe", {})),
        ("Job", lambda d: d["spec"]["template"]["spec"].__setitem__("restartPolicy", 3)),
    ],
    ids=["wrong-type", "misspelt-field", "job-wrong-type"],
)
def test_kubernetes_validation_rejects_broken_manifests(default_render: Rendered, kind: str, mutate: Any) -> None:
    doc = copy.deepcopy(default_render.all(kind)[0])
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBE_VERSIONS[0], strict=True)


# ----------------------------------------------------------------------------------------------- RayCluster
def _strict(schema: Any) -> Any:
    """The CRD's structural schema with unknown fields forbidden (the API server would prune them silently, so a
    misspelt field would do nothing): every object that lists its properties gets additionalProperties: false."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def raycluster_validator() -> jsonschema.protocols.Validator:
    crd = yaml.load(RAYCLUSTER_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == "RayCluster"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(v1["schema"]["openAPIV3Schema"])
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    validator: jsonschema.protocols.Validator = cls(schema)
    return validator


def _raycluster_errors(doc: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in raycluster_validator().iter_errors(doc)]


def test_vendored_crd_is_kuberays_file_unchanged() -> None:
    """The body below the header is byte for byte KubeRay v1.7.0's file (same git blob id as upstream)."""
    lines = RAYCLUSTER_CRD.read_bytes().splitlines(keepends=True)
    header = [line for line in lines[:10] if line.startswith(b"#")]
    assert any(b"v1.7.0" in line for line in header)
    body = b"".join(lines[len(header):])
    blob = hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()
    assert blob == RAYCLUSTER_CRD_BLOB


@pytest.mark.parametrize("values", ["default", "ci"])
def test_raycluster_validates_against_kuberay_crd(values: str, default_render: Rendered, ci_render: Rendered) -> None:
    doc = (default_render if values == "default" else ci_render).raycluster()
    assert doc["apiVersion"] == "ray.io/v1"
    assert _raycluster_errors(doc) == []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s["workerGroupSpecs"][0].__setitem__("minReplicas", "one"),
        lambda s: s.__setitem__("enableInTreeAutoScaling", True),  # misspelt: KubeRay would ignore it
        lambda s: s["headGroupSpec"].pop("template"),
        lambda s: s["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0),  # must be a string
    ],
    ids=["wrong-type", "misspelt-field", "missing-template", "non-string-start-param"],
)
def test_crd_validation_rejects_broken_rayclusters(default_render: Rendered, mutate: Any) -> None:
    doc = copy.deepcopy(default_render.raycluster())
    mutate(doc["spec"])
    assert _raycluster_errors(doc) != []
