# hybridps image: the shard server (`python -m ps`) and the workers (torchrun) share it.
#
#   docker build -t hybridps .                       # CPU torch (default)
#   docker build -t hybridps:cuda \                  # CUDA torch on a CUDA base
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Layers: dependencies first (they change rarely: only pyproject.toml/setup.py
# invalidate them), the source last. The `build` stage has gcc and compiles the
# optional native kernel (setup.py, hybridps/native/fused_adam.c) in place; the final
# stage copies the venv and the tree and has no compiler. Runs as an unprivileged
# user; /data (results) is owned by it, for a named volume.
ARG BASE_IMAGE=python:3.11-slim

# -- python + venv on the chosen base ---------------------------------------------------
FROM ${BASE_IMAGE} AS base
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    DEBIAN_FRONTEND=noninteractive
# CUDA/Ubuntu bases have no python: install the distribution's (3.10+ is required).
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# -- build: compiler, dependencies, native kernel ----------------------------------------
FROM base AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && if ! python3 -c "import sysconfig,os,sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then \
           apt-get install -y --no-install-recommends python3-dev; fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# 1. torch from the index the build args select (cpu or cuXXX wheels).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
# 2. The other runtime dependencies, read from pyproject.toml by installing a stub of
#    the project (empty packages: the top-level ones pyproject.toml's packages.find
#    includes, and the one setup.py's optional extension lives in; its C source is not
#    there yet, so the stub builds no kernel), then removing the stub: only these two
#    files bust it. tests/system/test_docker_static.py checks the stub against both files.
WORKDIR /app
COPY pyproject.toml setup.py ./
RUN mkdir -p ps worker hybridps/native \
    && touch ps/__init__.py worker/__init__.py hybridps/__init__.py \
        hybridps/native/__init__.py README.md \
    && pip install . \
    && pip uninstall -y hybridps \
    && rm -rf build ps worker hybridps README.md *.egg-info
# 3. The source; the editable install compiles the native kernel into the tree
#    (hybridps/native/_fused_adam*.so and _pooled_bags*.so). Both are optional for a
#    pip install without a compiler (torch kernels instead), but this stage has one:
#    an image without them would be silently slower, so a failed build stops here.
COPY . .
RUN pip install --no-deps -e . \
    && python -c "import hybridps.native._fused_adam, hybridps.native._pooled_bags; print('native kernels: built')" \
    && rm -rf build

# -- final: no compiler ----------------------------------------------------------------
FROM base
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
ENV PATH=/opt/venv/bin:$PATH
RUN useradd --create-home --uid 10001 hybridps \
    && mkdir -p /data && chown hybridps:hybridps /data
USER hybridps
WORKDIR /app
EXPOSE 50051
# Listening beyond loopback needs a token: generated into the data volume on first start.
CMD ["python", "-m", "ps", "--host", "0.0.0.0", "--port", "50051", \
     "--auth-token-file", "/data/auth-token", "--generate-auth-token", \
     "--checkpoint-root", "/data/checkpoints"]
