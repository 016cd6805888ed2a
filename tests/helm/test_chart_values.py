"""values.yaml documents itself (a `# --` comment on every key, helm-docs style), and every BALLAST_* variable the
chart sets is a real setting (one of the README's generated settings table)."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.helm.conftest import CHART, REPO, Rendered, ci_values, container, ray_pod_specs

KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.\-/]+):(?:\s|$)")


def undocumented_keys(text: str) -> list[str]:
    """Keys of a values file without a `# --` line in the comment block just above them.

    A key documented as a whole (a `# --` on it and on none of its children, e.g. `resources` or
    `podSecurityContext`) covers its subtree: those are defaults, not settings of their own. Lines of list items
    are values. Indentation is two spaces per level.
    """
    keys: list[tuple[tuple[str, ...], bool]] = []  # (path, documented) in file order
    comments: list[str] = []
    path: list[str] = []
    list_indent: int | None = None
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if list_indent is not None and stripped and indent > list_indent:
            continue  # inside a list item
        list_indent = None
        if stripped.startswith("#"):
            comments.append(stripped)
            continue
        if not stripped:
            comments = []
            continue
        if stripped.startswith("- "):
            list_indent = indent
            continue
        m = KEY.match(line)
        assert m, f"cannot read values line {line!r}"
        path = path[: indent // 2] + [m["key"]]
        keys.append((tuple(path), any(c.startswith("# --") for c in comments)))
        comments = []

    documented = dict(keys)
    children: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
    for key, _ in keys:
        children.setdefault(key[:-1], []).append(key)

    def covered(key: tuple[str, ...]) -> bool:
        """Inside a subtree documented as a whole."""
        for n in range(1, len(key)):
            parent = key[:n]
            if documented[parent] and not any(documented[c] for c in children.get(parent, [])):
                return True
        return False

    return [".".join(key) for key, doc in keys if not doc and not covered(key)]


def test_every_values_key_has_a_helm_docs_comment() -> None:
    text = (CHART / "values.yaml").read_text()
    assert sum(1 for line in text.splitlines() if KEY.match(line)) > 80
    assert undocumented_keys(text) == []


def test_the_comment_check_finds_an_undocumented_key() -> None:
    text = (
        "# -- documented\na: 1\n"
        "b:\n  # -- documented\n  c: 2\n  d: 3\n"  # b and b.d undocumented
        "# -- a default documented as a whole\nres:\n  requests:\n    cpu: 1\n"
        "# -- a list\nhosts:\n  - host: x\n    paths: [a]\n"
        "e: {}\n"
    )
    assert undocumented_keys(text) == ["b", "b.d", "e"]


def test_values_file_parses_and_ci_file_only_sets_known_keys() -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())

    def unknown(over: dict[str, object], base: dict[str, object], prefix: str = "") -> list[str]:
        out = []
        for k, v in over.items():
            if k not in base:
                out.append(prefix + k)
            elif isinstance(v, dict) and isinstance(base[k], dict) and base[k]:
                out += unknown(v, base[k], f"{prefix}{k}.")  # type: ignore[arg-type]
        return out

    assert unknown(ci_values(), defaults) == []


def _settings_in_readme() -> set[str]:
    readme = (REPO / "README.md").read_text()
    table = readme.split("<!-- BEGIN settings table", 1)[1].split("<!-- END settings table", 1)[0]
    return set(re.findall(r"^\| `(BALLAST_[A-Z_]+)`", table, flags=re.M))


@pytest.mark.parametrize("values", ["default", "ci"])
def test_every_ballast_variable_set_is_a_real_setting(values: str, default_render: Rendered,
                                                      ci_render: Rendered) -> None:
    r = default_render if values == "default" else ci_render
    containers = [container(r.deployment(c)) for c in ("api", "scheduler")] + [container(r.job())]
    containers += [c for spec in ray_pod_specs(r.raycluster()) for c in spec["containers"]]
    used = {e["name"] for c in containers for e in c.get("env", []) if e["name"].startswith("BALLAST_")}
    known = _settings_in_readme()
    assert len(known) > 10
    assert used and used <= known, sorted(used - known)
