"""A test task (`--task tests.testing.group_tables_task:TwoWidths`): --tables with two widths.

Tables named `*_wide` are 2 x --dim wide, the others --dim: so with --group-tables a rank
holds two groups (one per width) and, with `--tables a:300,solo_wide:40`, a table alone
in its width. One fused lookup_many per width (a lookup takes tables of one width)."""

from __future__ import annotations

import torch

from worker.config.train_config import TrainConfig
from worker.tasks.base import Batch, HybridModel, TableConfig
from worker.tasks.tables import NUM_DENSE, TablesTask, table_specs


def _width(cfg: TrainConfig, name: str) -> int:
    return 2 * cfg.run.dim if name.endswith("_wide") else cfg.run.dim


class TwoWidths(TablesTask):
    name = "two_widths"

    @classmethod
    def plan_tables(cls, cfg: TrainConfig) -> list[tuple[TableConfig, float]]:
        return [(TableConfig(name, rows, _width(cfg, name)), float(pool))
                for name, rows, pool in table_specs(cfg)]

    def width(self, name: str) -> int:
        return _width(self.cfg, name)

    def tables(self) -> list[TableConfig]:
        return [TableConfig(name, rows, self.width(name)) for name, rows, _ in self.specs]

    @classmethod
    def input_width_for(cls, cfg: TrainConfig) -> int:
        return sum(_width(cfg, name) for name, _, _ in table_specs(cfg)) + NUM_DENSE

    def forward(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        out: list[torch.Tensor] = []
        for wide in (False, True):
            names = [name for name, _, _ in self.specs if name.endswith("_wide") == wide]
            ids, bags = self.lookup_inputs(batch, names, "sum" if wide else "mean")
            if names:
                out.extend(model.lookups.lookup_many(names, ids, bags=bags))
        logit: torch.Tensor = model.dense(torch.cat([*out, batch.values["dense"]], dim=1))
        return logit.squeeze(-1)
