#!/usr/bin/env bash
# Lint, type-check and run the whole test suite (CPU, gloo, real processes).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
ruff check .
mypy
pytest "$@"
