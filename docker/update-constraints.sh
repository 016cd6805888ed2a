#!/usr/bin/env bash
# Re-resolve docker/constraints.txt, the exact versions the container image installs: pyproject.toml's runtime
# dependencies and ray[default], for the Python of the image (3.11), in a scratch venv (nothing is installed:
# pip resolves with --dry-run and reports). torch itself is left out: the Dockerfile installs it per VARIANT.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
ray_version=$(sed -n 's/^ARG RAY_VERSION=//p' Dockerfile)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

python3.11 -m venv "$scratch/venv"
"$scratch/venv/bin/pip" install --quiet --dry-run --ignore-installed --report "$scratch/report.json" \
    "torch==$torch_version" "ray[default]==$ray_version" .
"$scratch/venv/bin/python" - "$scratch/report.json" docker/constraints.txt <<'PY'
import json
import sys

report, out = sys.argv[1], sys.argv[2]
pins = sorted(
    (item["metadata"]["name"], item["metadata"]["version"])
    for item in json.load(open(report))["install"]
    if item["metadata"]["name"].lower() not in ("ballast", "torch")
)
header = open(out).read().split("\n")
keep = [line for line in header if line.startswith("#")]
with open(out, "w") as f:
    f.write("\n".join(keep) + "\n")
    f.writelines(f"{name}=={version}\n" for name, version in sorted(pins, key=lambda p: p[0].lower()))
PY
echo "docker/constraints.txt: $(grep -vc '^#' docker/constraints.txt) pins"
