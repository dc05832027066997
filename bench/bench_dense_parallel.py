"""The dense part alone: DDP against FSDP2 full sharding over dense sizes, side by side.

    python bench/bench_dense_parallel.py --quick
    python bench/bench_dense_parallel.py --mb 0.1,1,4,16,64 --repeats 5 --json runs/dense.json

What `--dense-parallel auto` (worker/dense/policy.py) decides between: 2 gloo ranks
(torchrun, one thread each) train an MLP of 3 square layers whose fp32 parameters take
--mb MB, with torch Adam, under `apply_ddp` and under `apply_fsdp` (one root unit, as the
bundled tasks) from worker/dense/parallel.py. Per size the two wrappers run interleaved
(ddp, fsdp, ddp, fsdp, ...), each repeat on a fresh copy of the same weights, and the
median step time of each is reported with the ratio fsdp / ddp: below 1, sharding pays
for speed at that size on this machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import REPO, TORCHRUN, bench_parser, child_env, machine, write_json

if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

LAYERS = 3
BATCH = 64
WORLD = 2


def width_for(mb: float) -> int:
    """The width h of LAYERS square layers (h*h + h each) holding `mb` MB of fp32."""
    params = mb * 1e6 / 4 / LAYERS
    return max(4, int((-1 + (1 + 4 * params) ** 0.5) / 2))


def dense_worker(sizes_mb: list[float], steps: int, repeats: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from worker.dense.parallel import apply_ddp, apply_fsdp

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    device = torch.device("cpu")
    results: list[dict[str, Any]] = []
    for mb in sizes_mb:
        h = width_for(mb)
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(LAYERS):
            layers += [nn.Linear(h, h), nn.ReLU()]
        template = nn.Sequential(*layers[:-1])
        params = sum(p.numel() for p in template.parameters())
        x_BH = torch.randn(BATCH, h)
        times: dict[str, list[float]] = {"ddp": [], "fsdp": []}
        for _ in range(repeats):
            for kind in ("ddp", "fsdp"):
                model = copy.deepcopy(template)
                wrapped = (apply_ddp(model, device, None) if kind == "ddp"
                           else apply_fsdp(model, mesh))
                opt = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
                for step in range(steps + 1):  # the first: warm-up (lazy init, state alloc)
                    if step == 1:
                        dist.barrier()
                        start = time.perf_counter()
                    wrapped(x_BH).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                dist.barrier()
                times[kind].append((time.perf_counter() - start) / steps * 1000)
                del wrapped, model, opt
        ddp, fsdp = statistics.median(times["ddp"]), statistics.median(times["fsdp"])
        results.append({"mb": mb, "width": h, "params": params, "ddp_ms": ddp,
                        "fsdp_ms": fsdp, "fsdp_over_ddp": fsdp / ddp, "repeats": times})
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results) + "\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="sizes 0.1, 1, 8 MB, 3 repeats, 10 steps")
    p.add_argument("--mb", default="0.1,1,4,16,32", help="dense fp32 parameter MB, a list")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats per wrapper")
    p.add_argument("--dense-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.mb, args.steps, args.repeats = "0.1,1,8", 10, 3
    sizes = [float(x) for x in args.mb.split(",") if x]
    if args.dense_worker:
        dense_worker(sizes, args.steps, args.repeats, args.out)
        return 0
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_dense_parallel-{os.getpid()}.json"
    load_before = os.getloadavg()
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(WORLD), str(Path(__file__)),
           "--dense-worker", "--mb", args.mb, "--steps", str(args.steps), "--repeats",
           str(args.repeats), "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, env=child_env(), check=True, timeout=3600)
    results = json.loads(out.read_text())
    out.unlink()
    print(f"dense part alone, {WORLD} gloo ranks x 1 thread, {LAYERS} square layers, batch "
          f"{BATCH}, Adam; medians of {args.repeats} interleaved repeats of {args.steps} steps")
    print(f"{'MB':>7} {'params':>10} {'ddp ms':>8} {'fsdp ms':>8} {'fsdp/ddp':>9}")
    for r in results:
        print(f"{r['mb']:>7g} {r['params']:>10,} {r['ddp_ms']:>8.2f} {r['fsdp_ms']:>8.2f} "
              f"{r['fsdp_over_ddp']:>9.2f}")
    load_after = os.getloadavg()
    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
    write_json(args.json, {"results": results, "machine": machine(load_before)}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
