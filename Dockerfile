# syntax=docker/dockerfile:1
# One image for the API (`ballast serve`), the scheduler (`ballast scheduler`), the migration Job and the Ray
# nodes of a KubeRay RayCluster, so every node runs the same Python, Ray and Ballast. Build it from the repository
# root:
#   docker build -t ballast:0.1.0 .                                   # CPU torch (the default)
#   docker build --build-arg VARIANT=cuda -t ballast:0.1.0-cuda .     # CUDA torch, for GPU workers
# Every Python package is pinned: torch by TORCH_VERSION, everything else by docker/constraints.txt.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# cpu: torch from PyTorch's CPU-only index (small, no CUDA libraries); cuda: PyPI's Linux torch, which brings
# the CUDA runtime libraries as pinned wheels (the host's NVIDIA driver does the rest).
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# the version docker/constraints.txt pins and the chart's rayCluster.rayVersion names
ARG RAY_VERSION=2.60.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONSTRAINT=/tmp/constraints.txt \
    PATH=/opt/ballast/bin:$PATH
COPY docker/constraints.txt /tmp/constraints.txt
RUN python -m venv /opt/ballast
RUN case "$VARIANT" in \
      cpu) pip install --no-deps --index-url "$TORCH_CPU_INDEX" "torch==${TORCH_VERSION}" ;; \
      cuda) pip install "torch==${TORCH_VERSION}" ;; \
      *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac
# the source tree as .dockerignore leaves it; pip installs the packages pyproject.toml names
COPY . /src
# ray[default] adds what a Ray node runs besides Ray Train: the dashboard, the Ray Client server (grpcio) and the
# KubeRay autoscaler's dependencies
RUN pip install /src "ray[default]==${RAY_VERSION}" \
    && python -c "import torch, ray, api, orchestrator, workers, migrations" \
    && ballast --help > /dev/null

FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="ballast" \
      org.opencontainers.image.description="Ballast API, scheduler and Ray node image (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
# uid/gid 1000, as the chart's podSecurityContext expects (and as Ray's own images use)
RUN groupadd --gid 1000 ballast \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/ballast --shell /bin/bash ballast
COPY --from=build /opt/ballast /opt/ballast
ENV PATH=/opt/ballast/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    BALLAST_HOME=/home/ballast/.ballast
USER 1000:1000
WORKDIR /home/ballast
EXPOSE 8420
# Outside a loopback bind `ballast serve` refuses to start without BALLAST_AUTH_MODE=token and a
# BALLAST_TOKEN_PEPPER; the chart sets both and runs `serve --no-scheduler`, `scheduler` or `ray start` itself.
CMD ["ballast", "serve", "--host", "0.0.0.0"]
