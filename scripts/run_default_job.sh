#!/usr/bin/env bash
# Start a shard server on a free port, train the default job on 2 CPU ranks,
# print the summary and the server's shard stats, stop the server.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
RUN_DIR="${HYBRIDPS_RUN_DIR:-$ROOT/runs/default}"
mkdir -p "$RUN_DIR"
PORT_FILE="$RUN_DIR/ps.port"
rm -f "$PORT_FILE"
# Checkpoints (worker --checkpoint-dir) only inside the server's root: the repository.
python -m ps --host 127.0.0.1 --port 0 --port-file "$PORT_FILE" \
    --checkpoint-root "${HYBRIDPS_CHECKPOINT_ROOT:-$ROOT}" &
PS_PID=$!
trap 'kill -TERM $PS_PID 2>/dev/null || true; wait $PS_PID 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do [ -s "$PORT_FILE" ] && break; sleep 0.1; done
[ -s "$PORT_FILE" ] || { echo "shard server did not start" >&2; exit 1; }
PS_ADDR="127.0.0.1:$(cat "$PORT_FILE")"
torchrun --standalone --nproc_per_node 2 worker/main.py --ps "$PS_ADDR" \
    --results "$RUN_DIR/results.json" "$@"
# The worker printed the shard stats; `python -m ps.admin stats --ps "$PS_ADDR"` shows them too.
