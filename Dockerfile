# hybridps image: shard server and workers share it.
#   docker build .                                  -> CPU torch (default)
#   docker build --build-arg TORCH_VARIANT=cu124 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 .   -> CUDA torch
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev; fi \
    && apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Dependency layers first: they change rarely and cache well.
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
COPY pyproject.toml setup.py* README.md /src/
RUN mkdir -p /src/ps /src/worker /src/hybridps && touch /src/ps/__init__.py \
    && pip install grpcio grpcio-health-checking grpcio-reflection "protobuf>=7.35.1,<8" numpy uvloop tqdm
# Source last; the build stage compiles the native kernel, the final stage needs no compiler.
COPY . /src
RUN pip install --no-deps /src

FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
    && if ! command -v python3 >/dev/null; then apt-get install -y --no-install-recommends python3; fi \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
COPY --from=build /src /app
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
WORKDIR /app
EXPOSE 50051
CMD ["python", "-m", "ps", "--host", "0.0.0.0", "--port", "50051"]
