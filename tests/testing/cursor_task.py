"""A test task (`--task tests.testing.cursor_task:CursorTask`) whose batches come from a
reading position the step does not give: each batch is the synthetic batch at
`CURSOR_BASE + cursor`, and the cursor moves on with every batch made. Only
`data_state` / `load_data_state` carry it across a resume (worker/checkpoint/data.py);
`ForgetfulCursorTask` drops it on resume, so its resumed run reads other batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.tasks.base import Batch
from worker.tasks.synthetic import SyntheticTask

CURSOR_BASE = 1000


class CursorTask(SyntheticTask):
    name = "cursor"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cursor = 0

    def batch(self, step: int, rank: int, world_size: int) -> Batch:
        out = super().batch(CURSOR_BASE + self.cursor, rank, world_size)
        self.cursor += 1
        return out

    def data_state(self, next_step: int) -> dict[str, Any] | None:
        return {"cursor": self.cursor, "next_step": next_step}

    def load_data_state(self, states_by_rank: Sequence[dict[str, Any] | None],
                        next_step: int) -> None:
        states = [s for s in states_by_rank if s is not None]
        assert states and all(s["next_step"] == next_step for s in states), states
        self.cursor = int(states[0]["cursor"])  # every rank reads the same position


class ForgetfulCursorTask(CursorTask):
    def load_data_state(self, states_by_rank: Sequence[dict[str, Any] | None],
                        next_step: int) -> None:
        pass
