#!/usr/bin/env bash
# Create (once) and fill the project's virtualenv. Sourced by the other scripts.
# torch==2.13.0 is installed first: the package asks only torch>=2.6, so GPU users
# keep their CUDA build, while a fresh CPU machine gets the CPU wheel.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HYBRIDPS_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[dev]"
export PATH="$VENV/bin:$PATH"
