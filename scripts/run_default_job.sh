#!/usr/bin/env bash
# Start a shard server on a free port, train the default job on 2 CPU ranks,
# print the summary and the server's shard stats, stop the server.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
RUN_DIR="${HYBRIDPS_RUN_DIR:-$ROOT/runs/default}"
mkdir -p "$RUN_DIR"
PORT_FILE="$RUN_DIR/ps.port"
PS_LOG="$RUN_DIR/ps.log"
rm -f "$PORT_FILE"
# The server logs to a file so that the console shows the training run only.
# Checkpoints (worker --checkpoint-dir) only inside the server's root: the repository.
python -m ps --host 127.0.0.1 --port 0 --port-file "$PORT_FILE" \
    --checkpoint-root "${HYBRIDPS_CHECKPOINT_ROOT:-$ROOT}" >"$PS_LOG" 2>&1 &
PS_PID=$!
trap 'kill -TERM $PS_PID 2>/dev/null || true; wait $PS_PID 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    [ -s "$PORT_FILE" ] && break
    kill -0 "$PS_PID" 2>/dev/null || break
    sleep 0.1
done
if [ ! -s "$PORT_FILE" ]; then
    tail -n 20 "$PS_LOG" >&2
    echo "shard server did not start (its log: $PS_LOG)" >&2
    exit 1
fi
PS_ADDR="127.0.0.1:$(cat "$PORT_FILE")"
echo "shard server on $PS_ADDR (log: $PS_LOG)"
# hybridps-run: torchrun (one intra-op thread per rank, as torchrun would set, without its
# banner) whose last line is ours (worker/launch.py)
python -m worker.launch --standalone --nproc_per_node 2 worker/main.py --ps "$PS_ADDR" \
    --results "$RUN_DIR/results.json" "$@"
echo "next: source .venv/bin/activate, then see README.md (three ways to use it)"
