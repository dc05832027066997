"""Export a checkpoint as one plain, single-process state_dict.

    python -m worker.export --checkpoint CKPT_DIR --out model.pt
    python -m worker.export --checkpoint CKPT_DIR --delta-since STEP --out delta.pt

CKPT_DIR is a complete checkpoint (`.../step-<s>/` with manifest.json) or a
checkpoint root (its newest complete one is taken). model.pt is a torch.save
of a plain state_dict of the un-sharded model `HybridModel(embedding, dense)`
as built by tests/testing/reference_trainer.py (LocalEmbedding: one nn.Embedding per table):

    embedding.tables.<table>.weight   the full [num_rows, dim] table
    embedding.dynamic.<table>.ids     a dynamic table (docs/dynamic_ids.md): every live
    embedding.dynamic.<table>.weight  id (sorted) and its row; with --delta-since STEP the
    embedding.dynamic.<table>.tombstones  rows changed after STEP and the ids dropped
    dense.<key>                       the dense module's (unsharded) weights

so `HybridModel(LocalEmbedding(task.tables(), ...), task.build_dense())
.load_state_dict(torch.load("model.pt"))` rebuilds the trained model in one
process. No process group, no server, no optimizer state.

KGE runs (--task kge): add `--kge-results RUN.json` (the run's --results; its id maps are
next to it in RUN.id_maps/) to write a self-contained model file instead, with the entity and
relation names, that worker/tasks/kge/export.py's KGEModel loads and scores with (torch only):

    python -m worker.export --state run.pt --kge-results run.json --out model.pt

`--state` takes the run's --dump-state file (the final model: with --keep-best, the best
on valid) instead of a checkpoint. The line printed names the step whose rows were exported
(from 0, as the run's summary and checkpoints number them): `exported step 409 (best)` when
the run ended by restoring its best evaluated model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridps.checkpoint import Manifest, load_table_rows, save_torch
from hybridps.dynamic_files import live_rows
from hybridps.errors import ShardError
from hybridps.path_checks import file_problem

EMBEDDING_PREFIX = "embedding.tables."
DYNAMIC_PREFIX = "embedding.dynamic."
DENSE_PREFIX = "dense."


def export_state_dict(checkpoint: str | Path, delta_since: int | None = None
                      ) -> tuple[dict[str, torch.Tensor], int]:
    """(the plain state_dict, the checkpoint's step) of a checkpoint directory or root.

    A dynamic table (docs/dynamic_ids.md) is written as `embedding.dynamic.<table>.ids`
    and `.weight`: every live id and its row. `delta_since` S: only the rows looked up
    (so changed) after step S, and `.tombstones`: the ids dropped after S that are not
    live again; static tables and the dense part are written whole."""
    from worker.checkpoint.dense import read_dense_full
    from worker.checkpoint.resume import find_checkpoint

    directory = find_checkpoint(checkpoint)
    if directory is None:
        raise FileNotFoundError(f"{checkpoint}: no complete checkpoint (manifest.json)")
    manifest = Manifest.read(directory)
    if delta_since is not None and not 0 <= delta_since <= manifest.step:
        raise ValueError(f"delta_since={delta_since}: not a step of this run's checkpoint "
                         f"of step {manifest.step} (0..{manifest.step})")
    out: dict[str, torch.Tensor] = {}
    for name, entry in manifest.tables.items():
        if "dynamic" in entry.extra:
            live = live_rows(directory, manifest, name)
            keep = (live.seen > delta_since if delta_since is not None
                    else torch.ones_like(live.ids, dtype=torch.bool))
            prefix = f"{DYNAMIC_PREFIX}{name}"
            out[f"{prefix}.ids"] = live.ids[keep]
            out[f"{prefix}.weight"] = live.rows[keep]
            if delta_since is not None:
                out[f"{prefix}.tombstones"] = live.tomb_ids[live.tomb_steps > delta_since]
            continue
        got, _ = load_table_rows(directory, manifest, name, "rows", 0, entry.num_rows,
                                 ["weight"])  # composed along its chain
        weight = got["weight"]
        assert weight is not None
        out[f"{EMBEDDING_PREFIX}{name}.weight"] = weight
    blob = read_dense_full(Path(directory), manifest.dense or {})  # DCP -> full, no group
    for key, value in blob["model"].items():
        out[f"{DENSE_PREFIX}{key}"] = value.detach().clone()
    return out, manifest.step


def state_dict_of_dump(path: str | Path) -> tuple[dict[str, torch.Tensor], int, bool]:
    """The same plain state_dict from a --dump-state file ({"tables", "dense", "step"}),
    the step its model is of and whether that is the best evaluated one (dump_step)."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    out = {f"{EMBEDDING_PREFIX}{name}.weight": t for name, t in blob["tables"].items()}
    out.update({f"{DENSE_PREFIX}{key}": t for key, t in blob["dense"].items()})
    return (out, *dump_step(blob))


def dump_step(blob: dict[str, object]) -> tuple[int, bool]:
    """(the step whose model a --dump-state file holds, whether it is the best evaluated one
    restored): its "step" and "best", or in a file without them, the last planned step."""
    if "step" in blob:
        return int(str(blob["step"])), bool(blob.get("best"))
    return int(str(blob["steps"])) - 1, False


def step_text(step: int, best: bool) -> str:
    return f"step {step} (best)" if best else f"step {step}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR",
                        help="a step-<s> checkpoint directory, or a root (its newest)")
    source.add_argument("--state", metavar="PATH",
                        help="a --dump-state file (the run's final model) instead")
    parser.add_argument("--kge-results", metavar="RUN.json", default="",
                        help="--task kge: write a KGEModel file (worker/tasks/kge/export.py) "
                             "with the id maps of this run's --results")
    parser.add_argument("--delta-since", type=int, default=None, metavar="STEP",
                        help="dynamic tables: only the rows changed after STEP, and "
                             "tombstones for the ids dropped after it (docs/dynamic_ids.md)")
    parser.add_argument("--out", required=True, metavar="PATH", help="output .pt file")
    args = parser.parse_args(argv)
    found = file_problem("--out", args.out, example="model.pt")
    if found is not None:  # before the checkpoint is read
        print(f"worker.export: error: {found}", file=sys.stderr)
        return 2
    try:
        if args.state:
            if args.delta_since is not None:
                raise ValueError("--delta-since reads a checkpoint (--checkpoint), not "
                                 "--state")
            state, step, best = state_dict_of_dump(args.state)
        else:
            state, step = export_state_dict(args.checkpoint, args.delta_since)
            best = False  # a checkpoint holds the rows of its step
        if args.kge_results:
            from worker.tasks.kge.export import payload_from_run

            payload = payload_from_run(state, args.kge_results)
            save_torch(args.out, payload)
            print(f"exported {step_text(step, best)}: {payload['model']} with "
                  f"{payload['entity'].shape[0]} entities and {payload['num_relations']} "
                  f"relations -> {args.out}")
            return 0
    except (OSError, ValueError, KeyError, ShardError) as exc:
        print(f"worker.export: error: {exc}", file=sys.stderr)
        return 1
    save_torch(args.out, state)
    total = sum(t.numel() * t.element_size() for t in state.values())
    print(f"exported {step_text(step, best)}: {len(state)} tensors, "
          f"{total / 2**20:.1f} MiB -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
