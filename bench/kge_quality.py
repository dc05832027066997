"""KGE quality table: hybridps (2 ranks, real shard server, --staleness 0 and 1) vs the
single-process reference (bench/kge_reference.py) vs dicee's figures.

    python bench/kge_quality.py                       # every setting of the data README
    python bench/kge_quality.py --only UMLS-DistMult-32 --seeds 0,1,2 --out runs/kge

For each setting (data set, model, dim, epochs; KvsAll, reciprocal triples, Adam lr 0.1,
global batch 1024, as hybridps/data/README.md, on the copies shipped there) it runs
bench/kge_reference.py and
`torchrun --nproc_per_node 2 worker/main.py --task kge` for each variant against one
`python -m ps` server, then prints a markdown table (filtered test MRR and wall times) and
writes everything to <out>/kge_quality.json. A variant is STALENESS:ROW_LR[:COMPENSATION]
(the entity rows' Adam lr, relations always use lr 0.1; --staleness-compensation none |
predict, default none): the default runs --staleness 0, and --staleness 1 without and with
weight prediction (worker/updates/staleness.py), all at dicee's lr 0.1 (a one-step-stale Adam step
of 0.1 on every row, every step, overshoots: see the report). With several seeds the table
shows the mean test MRR over seeds (per-seed values are in the JSON). A variant passes when
its mean test MRR is >= the dicee figure (rerun on CPU) - 0.01.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from harness import REPO, Server, child_env, run_worker  # bench/ is sys.path[0]

from hybridps.datasets import shipped_dataset
from worker.config.train_config import Compensation

TOLERANCE = 0.01
COMPENSATIONS: tuple[str, ...] = get_args(Compensation)  # --staleness-compensation


@dataclass(frozen=True)
class Setting:
    data: str
    model: str
    dim: int
    epochs: int
    dicee_mrr: float            # dicee 0.3.3 rerun on a 2-core CPU (the README)
    published: float | None = None

    @property
    def name(self) -> str:
        return f"{self.data}-{self.model}-{self.dim}"


SETTINGS = [
    Setting("UMLS", "DistMult", 32, 100, 0.703),
    Setting("UMLS", "Keci", 32, 100, 0.788),
    Setting("UMLS", "ComplEx", 256, 300, 0.667, published=0.680),
    Setting("UMLS", "Keci", 256, 300, 0.549, published=0.543),
    Setting("KINSHIP", "DistMult", 32, 100, 0.507),
    Setting("KINSHIP", "Keci", 32, 100, 0.721),
]


def run_reference(s: Setting, seed: int, entity_init: str = "torch") -> dict[str, Any]:
    cmd = [sys.executable, str(REPO / "bench" / "kge_reference.py"), "--data",
           str(shipped_dataset(s.data)), "--model", s.model.lower(), "--dim", str(s.dim),
           "--epochs", str(s.epochs), "--seed", str(seed), "--entity-init", entity_init]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"reference failed:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = wall
    return out


@dataclass(frozen=True)
class Variant:
    staleness: int
    row_lr: float
    compensation: str = "none"

    @classmethod
    def parse(cls, text: str) -> Variant:
        """STALENESS:ROW_LR[:COMPENSATION]; ValueError naming the text when it is not."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or not parts[0].isdigit():
            raise ValueError(f"variant {text!r} is not STALENESS:ROW_LR[:COMPENSATION]")
        try:
            row_lr = float(parts[1])
        except ValueError:
            raise ValueError(f"variant {text!r}: ROW_LR {parts[1]!r} is not a number") from None
        compensation = parts[2] if len(parts) == 3 else "none"
        if row_lr <= 0 or compensation not in COMPENSATIONS:
            raise ValueError(f"variant {text!r}: ROW_LR must be > 0 and COMPENSATION one of "
                             f"{', '.join(COMPENSATIONS)}")
        return cls(int(parts[0]), row_lr, compensation)

    @property
    def label(self) -> str:
        return (f"K={self.staleness}" + ("" if self.row_lr == 0.1 else f" lr {self.row_lr:g}")
                + ("" if self.compensation == "none" or self.staleness == 0
                   else f" {self.compensation}"))


def run_hybridps(s: Setting, seed: int, v: Variant, server: Server, out: Path
                 ) -> dict[str, Any]:
    staleness, row_lr = v.staleness, v.row_lr
    results = out / (f"{s.name}-k{staleness}-lr{row_lr:g}"
                     + ("" if v.compensation == "none" else f"-{v.compensation}")
                     + f"-s{seed}.json")
    res = run_worker(
        ["--ps", server.address, "--task", "kge", "--data-dir", str(shipped_dataset(s.data)),
         "--model", s.model.lower(), "--dim", str(s.dim), "--epochs", str(s.epochs),
         "--training", "kvsall", "--batch-size", "512", "--lr", str(row_lr), "--dense-lr", "0.1",
         "--init-std", "1", "--staleness", str(staleness), "--seed", str(seed),
         "--staleness-compensation", v.compensation, "--eval-every", "0"],
        results, results.with_suffix(".log"))
    ev = res["eval"]
    return {"results": str(results), "process_wall_s": res["process_wall_s"],
            "train_time_s": res["train_time_s"],
            "wall_time_s": res["wall_time_s"], "samples_per_s": res["samples_per_s"],
            "final_loss": res["final_loss"], "steps": res["steps"],
            **{k: ev[k] for k in ev if k.startswith(("valid_", "test_"))}}


def mean(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def variant_label(v: str) -> str:
    return Variant.parse(v).label


def table(report: list[dict[str, Any]], variants: list[str]) -> str:
    head = ["setting", "dicee MRR", "reference MRR", "ref train s / wall s"]
    for v in variants:
        head += [f"hybridps {variant_label(v)} MRR", "train s / wall s"]
    head.append(f">= dicee - {TOLERANCE}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for item in report:
        s = item["setting"]
        dicee = f"{s['dicee_mrr']:.3f}" + (f" ({s['published']:.3f} publ.)"
                                           if s["published"] else "")
        ref = item["reference"]
        row = [item["name"] + f" {s['epochs']} ep", dicee, f"{mean(ref, 'test_mrr'):.3f}",
               f"{mean(ref, 'train_seconds'):.1f} / {mean(ref, 'process_wall_s'):.1f}"]
        ok = []
        for v in variants:
            runs = item["hybridps"][v]
            m = mean(runs, "test_mrr")
            ok.append(m >= s["dicee_mrr"] - TOLERANCE)
            row += [f"{m:.3f}", f"{mean(runs, 'train_time_s'):.1f} / "
                                f"{mean(runs, 'process_wall_s'):.1f}"]
        row.append(" ".join(f"{variant_label(v)}: {'yes' if good else 'NO'}"
                            for v, good in zip(variants, ok, strict=True)))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma list of setting names, e.g. "
                    + ",".join(s.name for s in SETTINGS))
    ap.add_argument("--seeds", default="0", help="comma list of seeds")
    ap.add_argument("--variants", default="0:0.1,1:0.1:none,1:0.1:predict",
                    help="comma list of STALENESS:ROW_LR[:COMPENSATION] (none | predict)")
    ap.add_argument("--reference-init", choices=("torch", "hybridps"), default="torch",
                    help="the reference's entity rows: torch (dicee's stream) or hybridps "
                         "(the same start as hybridps per seed: a paired comparison)")
    ap.add_argument("--out", default=str(REPO / "runs" / "kge_quality"))
    args = ap.parse_args()
    wanted = {n for n in args.only.split(",") if n}
    settings = [s for s in SETTINGS if not wanted or s.name in wanted]
    if wanted - {s.name for s in settings}:
        ap.error(f"unknown settings {sorted(wanted - {s.name for s in settings})}")
    seeds = [int(v) for v in args.seeds.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        try:
            Variant.parse(v)
        except ValueError as exc:
            ap.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = Server(out / "ps", "--log-level", "WARNING", startup_timeout_s=120)
    report: list[dict[str, Any]] = []
    try:
        for s in settings:
            item: dict[str, Any] = {"name": s.name, "setting": s.__dict__, "reference": [],
                                    "hybridps": {v: [] for v in variants}}
            for seed in seeds:
                item["reference"].append(
                    {"seed": seed, **run_reference(s, seed, args.reference_init)})
                for v in variants:
                    item["hybridps"][v].append(
                        {"seed": seed, **run_hybridps(s, seed, Variant.parse(v), server, out)})
                print(f"{s.name} seed {seed}: reference {item['reference'][-1]['test_mrr']:.4f}"
                      + "".join(f"  {variant_label(v)} {item['hybridps'][v][-1]['test_mrr']:.4f}"
                                for v in variants), flush=True)
            report.append(item)
    finally:
        server.close()
    text = table(report, variants)
    print(text)
    (out / "kge_quality.json").write_text(json.dumps(
        {"seeds": seeds, "variants": variants, "tolerance": TOLERANCE, "settings": report,
         "table": text, "cpu_count": os.cpu_count()}, indent=2) + "\n")
    print(f"wrote {out / 'kge_quality.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
