"""hybridps worker entry point.

    torchrun --standalone --nproc_per_node 2 worker/main.py --ps 127.0.0.1:50051
    torchrun --standalone --nproc_per_node 2 worker/main.py --local-optimizer
    python -m worker.main --local-optimizer --steps 50     # a world of one

Every flag is also the env var HYBRIDPS_<FLAG> (see `--help`). Flags are
parsed and validated before torch is imported, so a bad flag fails fast with
a message naming the value (exit code 2).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

if not __package__:  # `torchrun worker/main.py` / `python worker/main.py` from the tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridps.cli import parse_config
from worker.config import TrainConfig

DESCRIPTION = ("hybridps worker: row-wise sharded embeddings (all_to_all), FSDP2 dense part, "
               "sparse optimizer state on the node's shard server")

log = logging.getLogger("worker")


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_config(TrainConfig, argv, prog="worker/main.py", description=DESCRIPTION)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")

    # Heavy imports (torch, grpc) only once the flags are known to be good.
    from worker.parallel import destroy_distributed, init_distributed
    from worker.sync import SyncError
    from worker.train import Trainer

    trainer: Trainer | None = None
    try:
        ctx = init_distributed(cfg.device, timeout_s=max(600.0, 4 * cfg.ps_timeout))
        trainer = Trainer(cfg, ctx)  # task, sharded tables, FSDP dense, server connection
        trainer.train()              # the loop; ends with every update applied
        trainer.report()             # eval, --dump-state, summary, shard stats, --results
        return 0
    except SyncError as exc:  # server trouble: one clear line, torchrun stops the other ranks
        print(f"hybridps worker: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if trainer is not None:
            trainer.close()  # sync thread and channel
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
