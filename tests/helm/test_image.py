"""The container image definition: hadolint finds nothing, its pins agree with the rest of the repository, the
build context holds what the Dockerfile copies, and the commands the chart runs in the image work (run here in
the venv, which holds the same package: no Docker engine runs on this machine)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

from tests.helm.conftest import CHART, REPO, Rendered, container

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
CONSTRAINTS = REPO / "docker" / "constraints.txt"
SCRIPTS = Path(sysconfig.get_path("scripts"))


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(SCRIPTS)) or shutil.which(name)
    assert found, f"{name} is not installed (it comes with the dev extra)"
    return found


def _hadolint(path: Path) -> list[dict[str, object]]:
    out = subprocess.run([_tool("hadolint"), "--no-fail", "--format", "json", str(path)],
                         capture_output=True, text=True, timeout=60, check=True)
    findings: list[dict[str, object]] = json.loads(out.stdout)
    return findings


def _args() -> dict[str, str]:
    """The Dockerfile's ARG defaults (the first one of each name)."""
    args: dict[str, str] = {}
    for name, value in re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), flags=re.M):
        args.setdefault(name, value)
    return args


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and re.fullmatch(r"[A-Za-z0-9_.\-]+", name), f"not an exact pin: {line!r}"
            pins[name.lower().replace("_", "-")] = version
    return pins


# --------------------------------------------------------------------------------------------- hadolint
def test_hadolint_finds_nothing() -> None:
    assert _hadolint(DOCKERFILE) == []


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path: Path) -> None:
    """The test above means something: the same call reports an unpinned pip install and a root user."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN pip install --no-cache-dir ray\nUSER root\n")
    assert {"DL3013", "DL3002"} <= {f["code"] for f in _hadolint(bad)}


# ----------------------------------------------------------------------------------------- consistency
def test_torch_version_is_the_makefiles() -> None:
    makefile = (REPO / "Makefile").read_text()
    (make_torch,) = re.findall(r"^TORCH_VERSION := (\S+)$", makefile, flags=re.M)
    assert _args()["TORCH_VERSION"] == make_torch


def test_ray_version_agrees_in_dockerfile_constraints_and_chart() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert _args()["RAY_VERSION"] == _pins()["ray"] == values["rayCluster"]["rayVersion"]


def test_variants_and_python() -> None:
    args = _args()
    assert args["VARIANT"] == "cpu"
    text = DOCKERFILE.read_text()
    assert re.search(r"^\s+cpu\) pip install --no-deps --index-url", text, flags=re.M)
    assert re.search(r"^\s+cuda\) pip install \"torch==\$\{TORCH_VERSION\}\"", text, flags=re.M)
    assert re.fullmatch(r"python:3\.11-slim-\w+", args["PYTHON_IMAGE"])
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"


def test_final_stage_runs_as_the_charts_non_root_user() -> None:
    stages = re.split(r"^FROM ", DOCKERFILE.read_text(), flags=re.M)
    (user,) = re.findall(r"^USER (\S+)$", stages[-1], flags=re.M)
    uid, _, gid = user.partition(":")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(uid) == values["podSecurityContext"]["runAsUser"] != 0
    assert int(gid) == values["podSecurityContext"]["runAsGroup"]


def test_constraints_pin_every_runtime_dependency_within_pyproject() -> None:
    pins = _pins()
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in map(Requirement, deps):
        name = dep.name.lower().replace("_", "-")
        if name == "torch":  # installed by the Dockerfile per VARIANT, at TORCH_VERSION
            assert dep.specifier.contains(_args()["TORCH_VERSION"])
            assert "torch" not in pins
            continue
        assert name in pins, f"{name} is not pinned in docker/constraints.txt"
        assert dep.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {dep}"
    # what a Ray node needs beyond ray[train]: the Ray Client server (grpcio) and the dashboard (aiohttp)
    assert {"grpcio", "aiohttp"} <= pins.keys()


# -------------------------------------------------------------------------------------------- .dockerignore
def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    def regex(pattern: str) -> re.Pattern[str]:
        out = re.escape(pattern.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        return re.compile(out.replace(r"\*", "[^/]*").replace(r"\?", "[^/]") + "$")

    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        rx = regex(raw[1:] if negate else raw)
        if any(rx.match(p) for p in prefixes):
            ignored = not negate
    return ignored


def _packages() -> list[str]:
    """The top-level packages pyproject.toml installs (its packages.find include patterns)."""
    import fnmatch

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = {p.rstrip("*").rstrip(".") for p in include}
    return sorted(d.name for d in REPO.iterdir()
                  if (d / "__init__.py").exists() and any(fnmatch.fnmatch(d.name, t) for t in tops))


def test_build_context_holds_the_packages_and_leaves_out_local_state() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert re.search(r"^COPY \. /src$", DOCKERFILE.read_text(), flags=re.M)
    packages = _packages()
    assert {"api", "orchestrator", "workers", "migrations"} <= set(packages)
    needed = ["pyproject.toml", "README.md", "docker/constraints.txt"]
    needed += [f"{pkg}/__init__.py" for pkg in packages]
    needed += [str(p.relative_to(REPO)) for p in (REPO / "migrations" / "versions").glob("*.py")]
    for path in needed:
        assert (REPO / path).exists(), path
        assert not _ignored(path, patterns), f"{path} is needed by the build but .dockerignore leaves it out"
    for local in (".git/HEAD", ".venv/bin/python", ".ballast/ballast.db", "tests/conftest.py",
                  "helm/ballast/values.yaml", "api/__pycache__/app.cpython-311.pyc", "ballast.egg-info/PKG-INFO"):
        assert _ignored(local, patterns), f"{local} would be sent to the Docker build"


# ------------------------------------------------------------------------------------- the image's commands
def _ballast(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_tool("ballast"), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_ballast_cli_starts() -> None:
    out = _ballast("--help")
    assert out.returncode == 0, out.stderr
    for command in ("serve", "scheduler", "db", "token"):
        assert command in out.stdout


def test_scheduler_command_of_the_chart_parses(default_render: Rendered) -> None:
    command = container(default_render.deployment("scheduler"))["command"]
    assert command[0] == "ballast"
    out = _ballast(*command[1:], "--help")
    assert out.returncode == 0, out.stderr
    assert "--no-migrate" in out.stdout


def test_image_default_command_refuses_to_serve_unprotected(tmp_path: Path) -> None:
    """The Dockerfile's CMD (`serve --host 0.0.0.0`) without token auth refuses to start (exit 2) before it
    binds or touches a database: the image is safe to run by mistake."""
    (cmd,) = re.findall(r"^CMD (\[.*\])$", DOCKERFILE.read_text(), flags=re.M)
    argv = json.loads(cmd)
    assert argv[:2] == ["ballast", "serve"]
    env = {"PATH": str(SCRIPTS), "HOME": str(tmp_path), "BALLAST_HOME": str(tmp_path / "home")}
    out = _ballast(*argv[1:], env=env, timeout=120)
    assert out.returncode == 2
    assert "BALLAST_AUTH_MODE=off is only allowed on a loopback bind" in out.stderr
