# syntax=docker/dockerfile:1
# kv-sidecar image. The install steps are those of scripts/setup.sh, which CI runs on every change:
# Debian's RDMA libraries, a virtualenv, torch only when missing, then the package.
#
#   docker build -t kv-sidecar:0.1.0 .
#   docker build --build-arg KVSIDECAR_EXTRAS=mooncake-cuda -t kv-sidecar:0.1.0-cuda .
#
# The admin API stays on 127.0.0.1 in the image; a pod sets KVSIDECAR_ADMIN_HOST=0.0.0.0
# (see k8s/) because the kubelet probes the pod IP, not the container's loopback.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# The CPU wheel index is not reachable from every builder, so the default is PyPI's build;
# CUDA/NPU images pass their own spec (and index) here.
ARG TORCH_SPEC=torch==2.13.0
# mooncake: the non-CUDA transfer engine wheel; mooncake-cuda for GPU nodes.
ARG KVSIDECAR_EXTRAS=mooncake
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Same libraries as scripts/setup.sh: the Mooncake wheel needs them to import, even for TCP.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# pip is upgraded unpinned on purpose, as scripts/setup.sh does: the resolver must handle the
# torch and Mooncake wheels of the day.
# hadolint ignore=DL3013
RUN python -m pip install --upgrade pip
# As scripts/setup.sh: install torch first only when the venv has none, so the range in
# pyproject.toml is already met and pip does not pick a different build. TORCH_SPEC is pinned
# (torch==2.13.0), hadolint just cannot see through the build arg.
# hadolint ignore=DL3013
RUN python -c "import torch" 2>/dev/null || python -m pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY app ./app
# The project itself, from the local tree; its dependencies follow pyproject.toml's ranges.
# hadolint ignore=DL3013
RUN python -m pip install ".[${KVSIDECAR_EXTRAS}]" \
    && python -c "import app.config"

FROM ${PYTHON_IMAGE} AS runtime
# Runtime needs the same three libraries; nothing else from the build stage but the venv.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 libnuma1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kvsidecar \
    && useradd --system --uid 10001 --gid kvsidecar --home-dir /home/kvsidecar --create-home \
        --shell /usr/sbin/nologin kvsidecar
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/kvsidecar
# 8300 admin API (/livez, /readyz, /metrics), 5600 peer control port. The Mooncake RPC port is
# pinned per deployment with KVSIDECAR_MOONCAKE_RPC_PORT (k8s/ uses 17100).
EXPOSE 8300 5600
# No curl in the slim image: probe /livez with the interpreter that is already there, on the
# admin port the container was configured with.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/livez' % os.environ.get('KVSIDECAR_ADMIN_PORT', '8300'), timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["kv-sidecar", "serve"]
CMD []
