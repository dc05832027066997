#!/usr/bin/env bash
# Lint, type-check and run the whole test suite (CPU, gloo, real processes).
# The suite runs on one pytest worker per core, at most 4 and one per 4 GiB of memory (a
# worker's test starts a server and ranks): pytest-xdist, each file on one worker, so a
# module's fixtures run once. Most of an end-to-end test waits on process start-up and
# collectives. Extra arguments go to pytest; `-n 0` runs everything in one process.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
ruff check .
mypy
workers=$(python -c "import os
gib = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 2**30
print(max(1, min(4, len(os.sched_getaffinity(0)), gib // 4)))")
pytest -n "$workers" --dist loadfile "$@"
