"""hybridps' sparse optimizers against FBGEMM's CPU kernels on the same rows (bench extra).

    python bench/check_fbgemm_optim.py                 # exit 1 when a kind is out of tolerance
    python bench/check_fbgemm_optim.py --json runs/bench/fbgemm_optim.json

FBGEMM (fbgemm-gpu-cpu, pyproject's `bench` extra; not installed in CI, which is why this
check lives here and not in tests/) has CPU training kernels for EXACT_ADAGRAD,
EXACT_ROWWISE_ADAGRAD and EXACT_SGD: for each, one table is trained by both sides on the
same rows and gradients for STEPS steps:
- FBGEMM: SplitTableBatchedEmbeddingBagsCodegen on the CPU (host weights, sum pooling, one
  id a bag, ids repeated within a batch), the optimizer fused into its backward;
- hybridps: the coalesced gradient through hybridps.optim.step_rows_ and apply_update_,
  what the shard server does with a push (the native kernels when built).
The rows and the optimizer state must agree within TOLERANCE, relative to the largest
value of each: the two sides round differently, not by much (FBGEMM sums a row's g^2
left to right, hybridps in 8 lanes; FBGEMM computes lr * g / (sqrt(s) + eps), hybridps
(g / (sqrt(s) + eps)) * lr, or g * -(lr / ...) rowwise; repeated ids are summed in
another order). Anything else (another formula, a wrong eps or decay) is orders of
magnitude further off.

Not compared: weight decay. FBGEMM 1.8's CPU rowwise Adagrad ignores it (with
weight_decay=0.5 every WeightDecayMode, NONE, L2 and DECOUPLE, left a row at lr 0.5, g = 1
at 0.5, the undecayed value; measured when this check was written), so hybridps' decoupled
decay (w * (1 - lr wd), FBGEMM's GPU DECOUPLE formula) has no CPU result to meet.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from hybridps.optim import (  # noqa: E402
    OptimizerSpec,
    apply_update_,
    kernel_name,
    step_rows_,
)
from hybridps.state_alloc import alloc_row_state  # noqa: E402

ROWS, DIM, BATCH, STEPS = 1000, 24, 512, 30
TOLERANCE = 1e-5  # max |hybridps - fbgemm| / max |fbgemm|, for the rows and for the state
# (name, hybridps spec, FBGEMM optimizer name, FBGEMM weight decay mode: none)
CASES = [
    ("adagrad", OptimizerSpec("adagrad", lr=0.05, eps=1e-8), "EXACT_ADAGRAD", 0),
    ("rowwise_adagrad", OptimizerSpec("rowwise_adagrad", lr=0.05, eps=1e-8),
     "EXACT_ROWWISE_ADAGRAD", 0),
    ("sgd", OptimizerSpec("sgd", lr=0.05), "EXACT_SGD", 0),
]


def fbgemm_available() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
    except Exception:
        return False
    return True


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    scale = float(theirs.abs().max()) or 1.0
    return float((ours - theirs).abs().max()) / scale


def compare(name: str, spec: OptimizerSpec, fbgemm_optimizer: str, decay_mode: int,
            seed: int = 0) -> dict[str, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
        WeightDecayMode,
    )

    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(ROWS, DIM, generator=gen) * 0.1
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=getattr(EmbOptimType, fbgemm_optimizer), learning_rate=spec.lr,
        eps=spec.eps, weight_decay=spec.weight_decay,
        weight_decay_mode=WeightDecayMode(decay_mode), pooling_mode=PoolingMode.SUM,
        device=torch.device("cpu"))
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(init)
    rows = init.clone()
    state = alloc_row_state(spec.state_widths(DIM), ROWS)
    for step in range(1, STEPS + 1):
        # a skewed draw: many ids repeat within the batch (their gradients are summed)
        ids = (torch.rand(BATCH, generator=gen) ** 3 * ROWS).long()
        grad_out = torch.randn(BATCH, DIM, generator=gen)
        out = tbe(ids, torch.arange(BATCH + 1, dtype=torch.int64))
        out.backward(grad_out)  # FBGEMM's optimizer runs here
        grad = torch.sparse_coo_tensor(ids[None], grad_out, (ROWS, DIM),
                                       check_invariants=True).coalesce()
        delta, decay = step_rows_(spec, state, grad.indices()[0], grad.values(), step)
        apply_update_(rows, grad.indices()[0], delta, decay)
    theirs_rows = tbe.split_embedding_weights()[0].detach()
    result: dict[str, Any] = {"case": name, "fbgemm": fbgemm_optimizer,
                              "rows_rel_err": _relative(rows, theirs_rows),
                              "rows_changed": float((theirs_rows - init).abs().max())}
    if state:
        (theirs_state,) = tbe.split_optimizer_states()[0][:1]
        (ours_state,) = state.values()
        result["state_rel_err"] = _relative(ours_state.flatten(),
                                            theirs_state.detach().flatten())
    errors = [v for k, v in result.items() if k.endswith("rel_err")]
    result["ok"] = all(e <= TOLERANCE for e in errors) and result["rows_changed"] > 0
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if not fbgemm_available():
        print("fbgemm_gpu is not installed: nothing to compare (pip install -e '.[bench]')")
        return 0
    results = [compare(*case) for case in CASES]
    print(f"hybridps ({kernel_name()} kernels) vs FBGEMM CPU TBE: {ROWS} x {DIM} table, "
          f"{STEPS} steps of {BATCH} ids; tolerance {TOLERANCE:g} of the largest value")
    for r in results:
        state = f"{r['state_rel_err']:.2e}" if "state_rel_err" in r else "-"
        print(f"  {r['case']:<24} ({r['fbgemm']:<21}) rows {r['rows_rel_err']:.2e}  state "
              f"{state}  {'ok' if r['ok'] else 'OUT OF TOLERANCE'}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"tolerance": TOLERANCE, "results": results},
                                        indent=1) + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
