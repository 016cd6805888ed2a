"""docs/deploy.md names real things: the workloads and Services its commands address exist when the release is
called `ballast`, as in its examples, and the values it quotes are the chart's."""

from __future__ import annotations

import re

import helm_python as helm
import yaml

from tests.helm.conftest import CHART, REPO

DOC = (REPO / "docs" / "deploy.md").read_text()


def test_kubectl_targets_in_the_docs_exist_for_a_release_named_ballast() -> None:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(None, name="ballast", namespace="ballast", is_install=True)
    docs = [d for path, text in files.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    targets = set(re.findall(r"\b(deploy|svc)/([a-z0-9-]+)", DOC))
    assert targets, "no kubectl targets found in docs/deploy.md"
    kinds = {"deploy": "Deployment", "svc": "Service"}
    missing = [f"{k}/{n}" for k, n in sorted(targets) if (kinds[k], n) not in names]
    assert missing == []


def test_values_the_docs_quote_are_the_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["database"]["existingSecret"] == "ballast-database" and values["database"]["urlKey"] == "url"
    assert values["auth"]["existingSecret"] == "ballast-auth" and values["auth"]["pepperKey"] == "pepper"
    assert values["rayCluster"]["clientPort"] == 10001 and values["rayCluster"]["upgradeStrategy"] == "Recreate"
    assert values["checkpoints"]["pvc"]["mountPath"] == "/mnt/ballast-checkpoints"
    for quoted in ("ballast-database", "ballast-auth", "/mnt/ballast-checkpoints", "--no-scheduler --no-migrate"):
        assert quoted in DOC
