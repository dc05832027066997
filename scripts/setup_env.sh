#!/usr/bin/env bash
# Create (once) and fill the project's virtualenv. Sourced by the other scripts.
#
# torch 2.13.0 first (the package itself asks only torch>=2.6, so a torch already there,
# e.g. a CUDA build, is kept):
#   TORCH_INDEX_URL set      -> from that index (a CUDA build: .../whl/cu128; as the Dockerfile)
#   a GPU (nvidia-smi -L)    -> torch==2.13.0 from pip's index (PyPI's default CUDA build)
#   no GPU                   -> the CPU wheel from torch's CPU index when it is reachable,
#                               else torch==2.13.0 by name from pip's configured index
# It says which torch it installed. A second run is quick: nothing is installed again while
# torch 2.13.0 is there and pyproject.toml, setup.py and the native kernel's source are
# unchanged (a stamp in the venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HYBRIDPS_VENV:-$ROOT/.venv}"
TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

installed_torch() {  # the installed torch's version (2.13.0+cpu, ...), without importing it
    "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' \
        2>/dev/null || true
}

reachable() {  # an index answers within a few seconds
    "$VENV/bin/python" -c 'import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=5)' "$1/torch/" >/dev/null 2>&1
}

have=$(installed_torch)
if [ "${have%%+*}" != "$TORCH_VERSION" ]; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        "${PIP[@]}" "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
        from="$TORCH_INDEX_URL (TORCH_INDEX_URL)"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "${PIP[@]}" "torch==$TORCH_VERSION"
        from="pip's index (a GPU is here: PyPI's default CUDA build)"
    elif reachable "$TORCH_CPU_INDEX"; then
        "${PIP[@]}" "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
        from="$TORCH_CPU_INDEX (no GPU here: the CPU build)"
    else
        "${PIP[@]}" "torch==$TORCH_VERSION"
        from="pip's configured index by name ($TORCH_CPU_INDEX unreachable)"
    fi
    echo "setup_env: installed torch $(installed_torch) from $from" >&2
fi

stamp="$VENV/.hybridps-setup"
want=$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/hybridps/native/*.c \
    | "$VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    "${PIP[@]}" -e "$ROOT[dev]"
    echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
