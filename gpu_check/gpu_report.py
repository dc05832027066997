"""gpu_check/check.py's results as the GPU check's goals (met / missed, with the margin) and
as markdown tables."""

from __future__ import annotations

from typing import Any

BYTES_FP32, BYTES_BF16 = 4.0, 2.0    # GPU bytes per embedding element, at most
ROWS_VS_RESIDENT = 2.5               # rows per GiB over the GPU-resident Adam's, at least
SPEED_VS_RESIDENT = 0.9              # samples/s at K=1 over the GPU-resident loop's, at least
DYNAMIC_VS_STATIC = 0.8              # production job: dynamic tables over static, at least


def _fig(stages: dict[str, Any], name: str) -> dict[str, Any]:
    figures: dict[str, Any] = stages.get(name, {}).get("figures", {}) or {}
    return figures


def _goal(what: str, value: float | None, target: float, op: str, dry_run: bool,
          where: str) -> dict[str, Any]:
    met = margin = None
    if value is not None:
        met = value <= target if op == "<=" else value >= target
        if op == ">=" and target:
            margin = value / target - 1
        elif op == "<=" and value:
            margin = target / value - 1
    return {"goal": what, "value": value, "target": f"{op} {target:g}", "met": met,
            "margin": None if margin is None else round(margin, 3), "stage": where,
            "note": "dry run: not a measurement" if dry_run else ""}


def goals(stages: dict[str, Any], dry_run: bool) -> list[dict[str, Any]]:
    """The GPU check's goals from the stages' figures (value None: the stage gave none)."""
    b = _fig(stages, "default_job")
    c = _fig(stages, "table_budget").get("rows_vs_sparse_adam", {})
    d = _fig(stages, "server_threads").get("jobs", {})
    f = _fig(stages, "sync_debug")
    marginal = b.get("marginal_bytes_per_element", {})
    out = [
        _goal("GPU bytes per embedding element, fp32 rows (default job, K=1)",
              marginal.get("hybridps fp32 K=1"), BYTES_FP32, "<=", dry_run, "default_job"),
        _goal("GPU bytes per embedding element, bf16 rows (default job, K=1)",
              marginal.get("hybridps bf16 K=1"), BYTES_BF16, "<=", dry_run, "default_job"),
    ]
    for dim, found in sorted(c.items(), key=lambda kv: int(kv[0])):
        for design in ("hybridps fp32", "hybridps bf16"):
            out.append(_goal(f"rows per GiB over SparseAdam's, {design[9:]} rows, dim {dim}",
                             found.get(design), ROWS_VS_RESIDENT, ">=", dry_run,
                             "table_budget"))
    out.append(_goal("samples/s at K=1 over the GPU-resident SparseAdam loop's",
                     b.get("samples_per_s_vs_sparse_adam", {}).get("hybridps fp32 K=1"),
                     SPEED_VS_RESIDENT, ">=", dry_run, "default_job"))
    for job, v in d.items():
        key = next((k for k in v if k.startswith("served_over_needed_at_")), None)
        out.append(_goal(f"server rows/s at {key[22:] if key else '16'} threads over what a "
                         f"GPU step asks, {job}", v.get(key) if key else None, 1.0, ">=",
                         dry_run, "server_threads"))
    p = _fig(stages, "production_job").get("substages", {})
    for shape, ratio in p.get("a_both_hold", {}).get("ratio_vs_resident", {}).items():
        out.append(_goal(f"production job, {shape}: samples/s at K=1 over the GPU-resident "
                         "loop's", ratio, SPEED_VS_RESIDENT, ">=", dry_run, "production_job"))
    out.append(_goal("production job: dynamic tables' samples/s over static tables'",
                     p.get("e_dynamic", {}).get("dynamic_over_static"), DYNAMIC_VS_STATIC,
                     ">=", dry_run, "production_job"))
    unnamed = f.get("unnamed_total") if f.get("checked") else None
    out.append(_goal("synchronising calls in the loop outside the named sync points",
                     unnamed, 0, "<=", dry_run, "sync_debug"))
    return out


# -- markdown -------------------------------------------------------------------------------

def _num(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}" if abs(x) < 1000 else f"{x:,.0f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_num(c) if not isinstance(c, str) else c for c in r) + " |"
              for r in rows]
    return [*lines, ""]


def _summary(name: str, fig: dict[str, Any]) -> str:
    if name == "prepare":
        m = fig.get("machine", {})
        return (f"{m.get('gpu', 'no GPU')}, torch {m.get('torch')}, python {m.get('python')}, "
                f"kernel {fig.get('native', {}).get('kernel', '?')}")
    if name == "pytest_gpu":
        return " ".join(f"{k} {fig[k]}" for k in ("passed", "failed", "error", "skipped")
                        if fig.get(k))
    if name == "default_job":
        return ", ".join(f"{k} {v:.2f}x" for k, v in
                         fig.get("samples_per_s_vs_sparse_adam", {}).items()
                         if k.startswith("hybridps"))
    if name == "sync_debug":
        return (f"unnamed syncs {fig.get('unnamed_total', '-')}"
                + ("" if fig.get("checked") else " (not checkable on the CPU)"))
    if name == "table_budget":
        return "; ".join(f"dim {d}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()
                                                 if k != "sparse_adam")
                         for d, r in fig.get("rows_vs_sparse_adam", {}).items())
    if name == "server_threads":
        return "; ".join(f"{j}: keeps up from {v.get('keeps_up_from_threads')} threads"
                         for j, v in fig.get("jobs", {}).items())
    if name == "production_job":
        subs = fig.get("substages", {})
        return ", ".join(f"{n.split('_')[0]} {'ok' if r.get('ok') else 'FAILED'}"
                         for n, r in subs.items())
    if name == "nccl":
        return (f"backend {fig.get('group', {}).get('backend', '-')}, job "
                f"{fig.get('job', {}).get('backend', fig.get('job', {}).get('error', '-'))}")
    return ""


def markdown(data: dict[str, Any]) -> str:
    stages = data.get("stages", {})
    title = "GPU check" + (" (DRY RUN on the CPU: no figure here is a GPU's)"
                           if data.get("dry_run") else "")
    lines = [f"# {title}", "", f"elapsed {data.get('elapsed_s', 0):.0f} s of a "
             f"{data.get('budget_s', 0):.0f} s budget", ""]
    lines += ["## Stages", ""]
    lines += _table(["stage", "what", "ok", "s", "figures", "error"], [
        [n, s.get("what", ""), "ok" if s.get("ok") else "FAILED", s.get("seconds"),
         _summary(n, s.get("figures", {})), (s.get("error") or "")[:200].replace("|", "/")]
        for n, s in stages.items()])
    lines += ["## Goals", ""]
    lines += _table(["goal", "value", "target", "met", "margin", "note"], [
        [g["goal"], g["value"], g["target"],
         "-" if g["met"] is None else ("met" if g["met"] else "MISSED"),
         "-" if g["margin"] is None else f"{100 * g['margin']:+.1f}%", g["note"]]
        for g in data.get("goals", [])])
    b = _fig(stages, "default_job")
    if b.get("variants"):
        lines += ["## b. The default job, one GPU rank", ""]
        ratio = b.get("samples_per_s_vs_sparse_adam", {})
        marginal = b.get("marginal_bytes_per_element", {})
        lines += _table(["variant", "samples/s", "step ms", "wait ms/step", "GPU peak MiB",
                         "bytes/element (peak less dense)", "bytes/element (tables' own)",
                         "vs SparseAdam"],
                        [[n, v.get("samples_per_s"), v.get("step_ms"),
                          v.get("wait_ms_per_step"), v.get("gpu_peak_mib"),
                          v.get("gpu_bytes_per_element"), marginal.get(n), ratio.get(n)]
                         for n, v in b["variants"].items()])
    c = _fig(stages, "table_budget")
    if c.get("dims"):
        lines += [f"## c. The largest table in {c.get('budget_gib')} GiB "
                  f"({c.get('measured_by')})", ""]
        vs = c.get("rows_vs_sparse_adam", {})
        lines += _table(["dim", "design", "rows", "rows per GiB", "bytes/element",
                         "rows vs SparseAdam"],
                        [[d, k, v["rows"], v["rows_per_gib"], v["bytes_per_element"],
                          vs.get(d, {}).get(k)] for d, r in c["dims"].items()
                         for k, v in r.items()])
    d = _fig(stages, "server_threads")
    if d.get("kernel_rows_per_s"):
        threads = [str(t) for t in d.get("threads", [])]
        lines += [f"## d. The server's kernel ({d.get('kernel')}) on this host, rows/s", ""]
        lines += _table(["what", *[f"{t} threads" for t in threads]],
                        [[f"dim {dim}, {d.get('kernel_batch_rows')} rows a call",
                          *[r.get(t) for t in threads]]
                         for dim, r in d["kernel_rows_per_s"].items()]
                        + [[f"{job}: a step's pushes", *[v["server_rows_per_s"].get(t)
                                                         for t in threads]]
                           for job, v in d.get("jobs", {}).items()])
        lines += _table(["job", "rows a step", "GPU steps/s", "rows/s needed",
                         "keeps up from threads"],
                        [[job, v["rows_pushed_per_step"], v["gpu_steps_per_s"],
                          v["gpu_rows_per_s_needed"], v["keeps_up_from_threads"]]
                         for job, v in d.get("jobs", {}).items()])
    f = _fig(stages, "sync_debug")
    if f.get("runs"):
        lines += ["## Sync debug mode", "", "Named sync points entered per step: "
                  + "; ".join(f"{n}: " + ", ".join(f"{k} {v}" for k, v in
                                                  r.get("named_per_step", {}).items())
                              for n, r in f["runs"].items()), ""]
        sites: dict[str, int] = {}
        for r in f["runs"].values():
            for site, s in r.get("unnamed_syncs", {}).items():
                sites[site] = sites.get(site, 0) + s["count"]
        if sites:
            lines += _table(["unnamed synchronising call (innermost place in the repo)",
                             "count"], [[s, n] for s, n in sorted(sites.items(),
                                                                key=lambda x: -x[1])])
        lines += [f"error mode: {f.get('error_mode', '-')}", ""]
        lines += [f"run {n} FAILED: {r['error']}" for n, r in f["runs"].items() if "error" in r]
    e = _fig(stages, "nccl")
    if e:
        group = e.get("group", {})
        lines += ["## e. NCCL", "", f"one rank through init_distributed: backend "
                  f"{group.get('backend')}, checks {group.get('checks')}, all_reduce "
                  f"{group.get('all_reduce_median_us')} us; the default job through "
                  f"torchrun: {e.get('job')}", "", "Not checked on one GPU:", ""]
        lines += [f"- {item}" for item in e.get("not_checked_here", [])] + [""]
    lines += production_markdown(_fig(stages, "production_job"))
    a = _fig(stages, "pytest_gpu")
    if a.get("tests"):
        lines += ["## a. pytest -m gpu", ""]
        lines += _table(["test", "outcome", "s", "message"],
                        [[t, v["outcome"], v["seconds"], v["message"][:120].replace("|", "/")]
                         for t, v in a["tests"].items()])
    return "\n".join(lines) + "\n"


def production_markdown(p: dict[str, Any]) -> list[str]:
    """Stage production_job: a line or a table per sub-stage."""
    subs = p.get("substages", {})
    if not subs:
        return []
    cap = p.get("cap", {})
    lines = ["## f. The production-sized job", "",
             f"emulated device: {p.get('emulated')}; the resident design's bound "
             f"{_num(cap.get('resident_bound_elements'))} elements; a: "
             f"{_num(cap.get('both_hold_elements'))}, b: {_num(cap.get('larger_elements'))}", ""]
    a = subs.get("a_both_hold", {})
    rows = []
    for shape, run in a.get("runs", {}).items():
        if isinstance(run, dict):
            r, h = run["resident"], run["hybridps K=1"]
            rows.append([shape, r.get("samples_per_s"), h.get("samples_per_s"),
                         a.get("ratio_vs_resident", {}).get(shape), h.get("wait_ms_per_step"),
                         r.get("gpu_peak_mib"), h.get("gpu_peak_mib")])
    if rows:
        lines += _table(["a. job", "resident samples/s", "hybridps K=1 samples/s", "ratio",
                         "wait ms/step", "resident peak MiB", "hybridps peak MiB"], rows)
    c = subs.get("c_server_threads", {})
    if isinstance(c.get("threads"), dict):
        lines += _table([f"c. server threads ({c.get('job')})", "samples/s", "waits",
                         "wait ms/step", "step ms", "rows/s applied"],
                        [[n, f.get("samples_per_s"), f.get("waits"), f.get("wait_ms_per_step"),
                          f.get("step_ms"), f.get("rows_per_s_applied")]
                         if isinstance(f, dict) else [n, f, "", "", "", ""]
                         for n, f in c["threads"].items()])
    for name, key in (("d_bf16", "samples_per_s_bf16_over_fp32"),
                      ("e_dynamic", "dynamic_over_static")):
        r = subs.get(name, {})
        lines += [f"{name}: {key} {_num(r.get(key))} {r.get('note', '')}".rstrip(), ""]
    e = subs.get("e_dynamic", {})
    if e.get("device_prefetch"):
        lines += [f"e. prefetched lookups {e.get('prefetched_lookups')}; the device path of "
                  f"the prefetch: {e['device_prefetch']}", ""]
    f = subs.get("f_parquet", {})
    lines += [f"f_parquet: samples/s {_num(f.get('run', {}).get('samples_per_s'))}, data "
              f"ms/step {_num(f.get('data_ms_per_step'))} {f.get('note', '')}".rstrip(), ""]
    g = subs.get("g_profile", {})
    if g.get("top_device_ops_ms") or g.get("top_host_ops_ms"):
        top = g.get("top_device_ops_ms") or g.get("top_host_ops_ms")
        lines += _table(["g. top ops (device, else host)", "ms"], [[k, v] for k, v in top.items()])
        lines += [f"device gaps: {g.get('device_gaps')}", ""]
    b = subs.get("b_larger", {})
    run = b.get("hybridps K=1", {})
    lines += [f"b_larger: {_num(b.get('elements'))} elements ({b.get('hybridps_rows_gib')} GiB "
              f"of fp32 rows; resident would need {b.get('resident_needs_gib')} GiB): resident "
              f"{b.get('resident', '-')}; hybridps samples/s {_num(run.get('samples_per_s'))}, "
              f"max_memory_allocated {b.get('max_memory_allocated_gib', '-')} GiB "
              f"{b.get('note', '')}".rstrip(), ""]
    bad = [f"{n}: {r.get('error')}" for n, r in subs.items() if not r.get("ok")]
    return lines + [f"sub-stage FAILED or not run: {x}" for x in bad] + ([""] if bad else [])
