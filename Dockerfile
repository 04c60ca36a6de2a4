# syntax=docker/dockerfile:1
# One image for every loraplane component. Each component is a console script on the PATH:
#   loraplane-picker, loraplane-controller, loraplane-sidecar, loraplane-engine, loraplane (the umbrella command).
# The Helm chart sets the command per container; the image has no entrypoint of its own. See docs/helm.md.
#
#   docker build -t loraplane/loraplane:0.1.0 .
#   docker build --build-arg LORAPLANE_EXTRAS=gpu ...        # + Triton kernels for the engine on NVIDIA GPUs
#
# torch is pinned in pyproject.toml. From the default index it is the CUDA build; for a smaller CPU-only image set
# PIP_EXTRA_INDEX_URL (a build argument) to a PyTorch CPU wheel index or your mirror of one.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
# loraplane/ and each component folder's part of the loraplane namespace (<folder>/loraplane/<component>: setup.py)
COPY loraplane/ loraplane/
COPY api/ api/
COPY kernels/ kernels/
COPY engine/ engine/
COPY runtime-sidecar/ runtime-sidecar/
COPY picker/ picker/
COPY controller/ controller/
COPY devcluster/ devcluster/
COPY sim/ sim/
COPY emulator/ emulator/
COPY bench/ bench/
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG LORAPLANE_EXTRAS=""
# Read by pip from the environment (empty: the default index only).
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/tmp
COPY --from=build /wheels /wheels
# DL3013 (pin pip versions): the one requirement is the wheel built in the stage above.
# hadolint ignore=DL3013
RUN set -eu; \
    wheel="$(ls /wheels/loraplane-*.whl)"; \
    if [ -n "${LORAPLANE_EXTRAS}" ]; then wheel="${wheel}[${LORAPLANE_EXTRAS}]"; fi; \
    pip install "${wheel}"; \
    rm -rf /wheels; \
    groupadd --gid 10001 loraplane; \
    useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin loraplane; \
    loraplane --version
# Non-root; the chart also runs every container with a read-only root filesystem (writable: /tmp, the cache dir).
USER 10001:10001
WORKDIR /tmp
# engine 8000 | picker gRPC 9002, health 9003, metrics 9090 | controller metrics 9091 | sidecar metrics 9100
EXPOSE 8000 9002 9003 9090 9091 9100
CMD ["loraplane", "--help"]
