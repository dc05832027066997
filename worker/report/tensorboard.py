"""`--tensorboard DIR`: rank 0 writes TensorBoard scalars under DIR/<run id>/.

    torchrun ... worker/main.py --ps HOST:PORT --tensorboard runs/tb
    tensorboard --logdir runs/tb             # every run of the directory side by side

Scalars (x axis: the step, counted from 1):
    train/loss               mean over the ranks of the last --log-every steps
    train/samples_per_s      all ranks, over the last --log-every steps
    staleness/applied        K' of the newest applied update (<= --staleness)
    staleness/arrival_lag    mean steps an update arrived after its push
    staleness/waits          steps that waited for an update (cumulative)
    time_ms/<part>           rank 0's step-time breakdown over the last --log-every steps
                             (apply, data, forward, a2a, backward, optimizer, push, log, eval)
    eval/<metric>            every evaluation (--eval-every, and the final one)
The run's config is a text entry ("config"). (Not named tensorboard.py: `torchrun
worker/main.py` puts worker/ first on sys.path, where it would hide the tensorboard
package.) Uses torch.utils.tensorboard, which needs the
`tensorboard` package: `pip install 'hybridps[tensorboard]'` (worker/config/train_config.py
refuses the flag without it, before anything starts).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'hybridps[tensorboard]' (or: pip install tensorboard)"


class TensorBoardLog:
    """The SummaryWriter of rank 0 and what the training loop hands it."""

    def __init__(self, directory: str, run_id: str, config: Mapping[str, Any],
                 start_step: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # checked by TrainConfig already; a clear line anyway
            raise RuntimeError(f"--tensorboard needs the tensorboard package: {INSTALL_HINT}"
                               ) from exc
        self.path = Path(directory) / run_id
        self.writer = SummaryWriter(log_dir=str(self.path))
        self.writer.add_text("config", "```\n" + json.dumps(dict(config), indent=1,
                                                           default=str) + "\n```")
        self._last_step = start_step  # a resumed run's first window starts there
        self._last_times: dict[str, float] = {}

    def train(self, step: int, loss: float, samples_per_s: float, staleness: Mapping[str, Any],
              times: Mapping[str, float]) -> None:
        """After step `step` (1-based): the window's loss, speed, staleness and step times
        (`times`: cumulative seconds per part since the start, as worker/train/trainer.py keeps)."""
        w = self.writer
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("train/samples_per_s", samples_per_s, step)
        for key, value in staleness.items():
            w.add_scalar(f"staleness/{key}", float(value), step)
        steps = max(step - self._last_step, 1)
        for key, total in times.items():
            w.add_scalar(f"time_ms/{key}",
                         1000.0 * (total - self._last_times.get(key, 0.0)) / steps, step)
        self._last_step, self._last_times = step, dict(times)

    def eval(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(f"eval/{key}", float(value), step)

    def close(self) -> None:
        self.writer.close()  # flushes the event file
