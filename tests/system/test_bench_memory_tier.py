"""bench/bench_memory_tier.py's own arithmetic, without training: the fixed overhead's job
(its tables cut to one spill page of state a rank, its other flags the same), the excess
over budget + overhead and its verdict, and the sampled parts of a process's memory."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # a script folder: its modules import by file name

import bench_memory_tier as tier  # noqa: E402

MIB = 2**20


def test_the_overhead_job_keeps_every_flag_but_cuts_the_tables_to_a_page_a_rank() -> None:
    every = tier.jobs(100_000, 0.05)
    ids20 = tier.minimal_job(every["ids20"])
    # Adam at dim 64: 512 bytes a row, 7 rows a 4 KiB page (header and row ids), 2 ranks
    assert ids20 == ["--tables", "t0:14:20", "--dim", "64", "--batch-size", "1024"]
    dlrm = tier.minimal_job(every["dlrm"])
    tables = tier.parse_table_list(tier.flag(dlrm, "--tables"))
    full = tier.parse_table_list(tier.flag(every["dlrm"], "--tables"))
    assert [(n, p) for n, _, p in tables] == [(n, p) for n, _, p in full]  # pools kept
    # dim 16: 128 bytes a row, 30 a page; a table of fewer rows keeps them
    assert [r for _, r, _ in tables] == [min(r, 60) for _, r, _ in full]
    assert {r for _, r, _ in tables} > {60, 25, 2}
    assert tier.state_bytes(ids20) < 16 * 2**10 < tier.state_bytes(every["ids20"]) // 1000
    assert dlrm[2:] == every["dlrm"][2:]


def _run(hwm_mib: float, counted_mib: float, sps: float = 1000.0) -> dict[str, Any]:
    parts = dict.fromkeys(tier.RSS_PARTS, 0)
    return {"samples_per_s": sps, "vm_hwm_bytes": int(hwm_mib * MIB),
            "server_state_bytes": int(counted_mib * MIB), "server_master_bytes": 0,
            "spill_hit_rate": 0.5, "spill_fills": 10,
            "rss": {"peaks_bytes": parts, "at_peak_bytes": parts, "samples": 1}}


@pytest.mark.parametrize(("tier_hwm", "within"), [(411, True), (412, True), (413, False)])
def test_excess_is_the_tier_peak_less_budget_and_the_jobs_own_overhead(
        tier_hwm: float, within: bool) -> None:
    budgets = {"ids20": {"state_bytes": 48 * MIB, "budget_mb": 12, "budget_bytes": 12 * MIB}}
    overheads = {"ids20": _run(400, 0.01)}
    results = {"ids20/zipf": {"memory": [_run(500, 48)], "tier": [_run(tier_hwm, 12, 900)]}}
    text, summary = tier.summarize(results, budgets, overheads)
    s = summary["ids20/zipf"]
    assert s["budget_plus_overhead_bytes"] == 412 * MIB
    assert s["excess_bytes"] == (tier_hwm - 412) * MIB
    assert s["within"] is within
    assert s["memory_excess_bytes"] == (500 - 48 - 400) * MIB
    assert s["ratio"] == pytest.approx(0.9)
    assert (" yes " if within else " NO ") in text.splitlines()[1]
    rows = tier.breakdown(results, overheads).splitlines()
    assert [r.split()[0] for r in rows[1:]] == ["ids20/overhead", "ids20/zipf/memory",
                                              "ids20/zipf/tier"]
    assert rows[3].split()[1:5] == [f"{tier_hwm}", "12.0", "400", f"{tier_hwm - 12 - 400}"]


def test_the_sampler_reads_this_process_parts_and_their_peaks() -> None:
    sampler = tier.RssSampler(os.getpid())
    held = bytearray(64 * MIB)  # 64 MiB resident, then freed
    for i in range(0, len(held), 4096):
        held[i] = 1
    seen = sampler.samples
    while sampler.samples < seen + 2:  # sampled while it is held
        sampler._stop.wait(tier.SAMPLE_S)
    del held
    got = sampler.stop()
    peaks, at = got["peaks_bytes"], got["at_peak_bytes"]
    assert set(peaks) == set(tier.RSS_PARTS) and got["samples"] >= 3
    assert peaks["VmRSS"] >= peaks["RssAnon"] >= 64 * MIB
    assert at["VmRSS"] == peaks["VmRSS"]
    assert at["VmRSS"] == at["RssAnon"] + at["RssFile"] + at["RssShmem"]
    # the kernel's counters lag by a few pages a thread: VmHWM is the peak, about
    assert tier.vm_hwm_bytes(os.getpid()) >= 64 * MIB
