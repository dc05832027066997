#!/usr/bin/env bash
# Lint, type-check and run the whole test suite (CPU, gloo, real processes).
# The suite runs on one pytest worker per core, at most 4 (pytest-xdist; each file stays on
# one worker, so a module's fixtures run once): most of an end-to-end test is waiting on
# process start-up and collectives. Extra arguments go to pytest; `-n 0` runs in one process.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
ruff check .
mypy
workers=$(python -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
pytest -n "$workers" --dist loadfile "$@"
