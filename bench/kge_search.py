"""Hyper-parameter search for the KGE recipes, on VALID only.

Runs trials one after the other, each a world of one (`python -m worker.main
--local-optimizer`: the same task, model, loss and schedule code as the 2-rank + server run,
without the server) or `--nproc` ranks with --local-optimizer, with `--eval-test false` so
that test is never evaluated. Each
trial's valid-MRR curve and times are appended to <out>/search.jsonl; the table printed at the
end has valid figures only.

    python bench/kge_search.py --data-dir DIR/FB15k-237 --out runs/search \\
        --base "--model complex --training kvsall --dim 256 --epochs 6" \\
        --trial "lr=0.003 loss=ce reg=n3 reg_weight=0.01" --trial "lr=0.01 loss=ce"

A trial is space-separated SETTING=VALUE pairs (flag names with underscores); --lr sets
--dense-lr too unless the trial sets it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def trial_flags(base: list[str], trial: str) -> list[str]:
    fields = dict(item.split("=", 1) for item in trial.split())
    if "lr" in fields and "dense_lr" not in fields:
        fields["dense_lr"] = fields["lr"]
    fields["eval_test"] = "false"  # tuning never computes test
    flags = list(base)
    for key, value in fields.items():
        flags += [f"--{key.replace('_', '-')}", value]
    return flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", default="runs/kge_search")
    ap.add_argument("--base", default="", help="flags shared by every trial")
    ap.add_argument("--trial", action="append", default=[], help="FIELD=VALUE ...")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process")
    ap.add_argument("--nproc", type=int, default=1,
                    help="ranks (torchrun --local-optimizer when > 1; --batch-size is per rank)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = ["--task", "kge", "--data-dir", args.data_dir, "--local-optimizer",
            "--progress", "true", *shlex.split(args.base)]
    rows = []
    for i, trial in enumerate(args.trial):
        name = f"{int(time.time())}-{i}"
        results = out / f"{name}.json"
        flags = [*trial_flags(base, trial), "--results", str(results)]
        t0 = time.perf_counter()
        log = out / f"{name}.log"  # the progress bar (loss, valid MRR): `tail -c 300 LOG`
        with log.open("w") as stream:
            launcher = ([sys.executable, "-m", "worker.main"] if args.nproc == 1 else
                        [str(Path(sys.executable).with_name("torchrun")), "--standalone",
                         "--nproc_per_node", str(args.nproc), str(REPO / "worker/main.py")])
            proc = subprocess.run([*launcher, *flags], cwd=REPO,
                                  stdout=stream, stderr=subprocess.STDOUT, text=True,
                                  check=False, env={"OMP_NUM_THREADS": str(args.threads),
                                                    "PATH": "/usr/bin:/bin"})
        wall = time.perf_counter() - t0
        record: dict[str, object] = {"trial": trial, "base": args.base, "wall_s": round(wall, 1),
                                     "returncode": proc.returncode}
        if proc.returncode == 0:
            res = json.loads(results.read_text())
            record.update(
                valid_curve=[[s, round(m["valid_mrr"], 4)] for s, m in res["eval_curve"]
                             if "valid_mrr" in m],
                final_valid_mrr=round(res["eval"]["valid_mrr"], 4),
                best=res["hooks"], train_s=round(res["train_time_s"], 1),
                eval_s=round(res["eval_time_s"], 1), final_loss=res["final_loss"])
            assert not any(k.startswith("test") for k in res["eval"]), "test was evaluated"
        else:
            record["error"] = log.read_text()[-2000:]
        with (out / "search.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        rows.append(record)
        print(json.dumps(record), flush=True)
    print("| trial | valid MRR (best) | train s |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['trial']} | {r.get('final_valid_mrr')} | {r.get('train_s')} |")


if __name__ == "__main__":
    main()
