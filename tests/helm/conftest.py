"""Render helm/ballast with Helm's own template engine and hand the manifests to the tests.

helm-python-sdk binds Helm's Go library (``libhelm_c``) through ctypes: ``Chart.load(path).render(values, name=...,
namespace=...)`` returns ``{template path: manifest text}`` exactly as ``helm template`` would, offline (no cluster,
no helm binary). Rendering takes milliseconds, so every test renders what it needs.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "ballast"
CI_VALUES = CHART / "ci" / "gpu-s3-ingress-values.yaml"
RELEASE = "demo"
NAMESPACE = "ml"


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, maps merged key by key (as Helm merges several values files)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def ci_values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(CI_VALUES.read_text())
    return loaded


@dataclass
class Rendered:
    """The manifests of one render, with the lookups the tests need."""

    files: dict[str, str]
    docs: list[dict[str, Any]]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, component: str | None = None) -> dict[str, Any]:
        found = [
            d for d in self.all(kind)
            if component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]
        assert len(found) == 1, f"expected one {kind} (component {component}), found {len(found)}"
        return found[0]

    def kinds(self) -> list[str]:
        return sorted(d["kind"] for d in self.docs)

    def deployment(self, component: str) -> dict[str, Any]:
        return self.one("Deployment", component)

    def job(self) -> dict[str, Any]:
        return self.one("Job", "migrations")

    def raycluster(self) -> dict[str, Any]:
        return self.one("RayCluster")


class Renderer:
    def __init__(self, chart: helm.Chart) -> None:
        self.chart = chart

    def __call__(self, values: dict[str, Any] | None = None) -> Rendered:
        files = self.chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        docs = [
            doc
            for path, text in sorted(files.items())
            if path.endswith((".yaml", ".yml"))
            for doc in yaml.safe_load_all(text)
            if doc
        ]
        return Rendered(files=files, docs=docs)


@pytest.fixture(scope="session")
def render() -> Iterator[Renderer]:
    """``render(values)``: the chart rendered for release ``demo`` in namespace ``ml``, values over the defaults."""
    with helm.Chart.load(CHART) as chart:
        yield Renderer(chart)


@pytest.fixture(scope="session")
def default_render(render: Renderer) -> Rendered:
    return render()


@pytest.fixture(scope="session")
def ci_render(render: Renderer) -> Rendered:
    return render(ci_values())


# -------------------------------------------------------------------------------------------- pod spec helpers
def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = pod_spec(workload)["containers"]
    if name is None:
        assert len(containers) == 1, [c["name"] for c in containers]
        return dict(containers[0])
    return dict(next(c for c in containers if c["name"] == name))


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's env by name; a name listed twice is a chart bug (the later one would silently win)."""
    entries = c.get("env") or []
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), f"duplicate env names in {c['name']}: {names}"
    return {e["name"]: e for e in entries}


def secret_ref(entry: dict[str, Any]) -> tuple[str, str]:
    ref = entry["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def ray_pod_specs(raycluster: dict[str, Any]) -> list[dict[str, Any]]:
    spec = raycluster["spec"]
    return [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
