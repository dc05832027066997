"""The console fits the terminal: rank 0's progress bar (worker/report/console.py) and
`ps.admin stats` (hybridps/admin.py) at 80, 100 and 160 columns, with the fields or
columns left out said elsewhere (the `progress` log line; a last line naming them)."""

from __future__ import annotations

import io
import logging

import pytest
from tqdm import tqdm

from hybridps.admin import DEFAULT_WIDTH, RUN_COLUMNS, format_shard_stats
from hybridps.v1 import admin_pb2
from hybridps.wrap import wrap_fields
from worker.report import console
from worker.report.console import bar_layout, bar_postfix, fit_fields, postfix_text, show_progress

CTR_EVALS = {"accuracy": 0.7417, "auc": 0.8137, "loss": 0.5232, "planted_auc": 0.848,
             "planted_loss": 0.4822}  # in the task's order
KGE_EVALS = {"valid_mrr": 0.8372}
RUN_IDS = ("1f0c2b7e-aaaa-4b1e-9c1d-2f3e4a5b6c7d",  # torchrun's 36-character ids
           "9a3e51d0-bbbb-4b1e-9c1d-2f3e4a5b6c7d")


def _bar(width: int, steps: int = 10_000, done: int = 4_500) -> tqdm:
    bar = tqdm(total=steps, desc="train", unit="step", file=io.StringIO(), ncols=width,
               bar_format=bar_layout()["bar_format"])
    bar.update(done)
    bar.start_t -= 3725.0  # over an hour in: the longest time fields
    return bar


def _line(bar: tqdm) -> str:
    return bar.format_meter(**bar.format_dict)


@pytest.mark.parametrize("width", [80, 100, 160])
@pytest.mark.parametrize("evals", [CTR_EVALS, KGE_EVALS], ids=["ctr", "kge"])
def test_the_bar_fits_the_terminal_most_useful_fields_first(width: int,
                                                            evals: dict[str, float]) -> None:
    fields = bar_postfix(0.5344, evals, 123_456.7, 1, 0.94, 187_000)
    bar = _bar(width)
    shown, left = fit_fields(bar, fields, width)
    bar.set_postfix_str(postfix_text(shown))
    line = _line(bar)
    assert len(line) <= width, line
    assert "|" + "#" * 3 in line or "| " in line  # a bar is still drawn
    assert list(shown) == list(fields)[:len(shown)]  # a prefix: the most useful first
    assert list(shown) + list(left) == list(fields)
    assert "loss" in shown
    headline = "auc" if evals is CTR_EVALS else "valid_mrr"
    if width >= 100:
        assert headline in shown, line
    if width >= 160:
        assert {"sps", "stale", "lag", "waits"} <= set(shown), line
    if width <= 80:
        assert left, line  # what does not fit is left for the log line


def test_fields_in_order_of_use() -> None:
    assert list(bar_postfix(0.5, CTR_EVALS, 1.0, 1, 0.5, 0)) == [
        "loss", "eval_loss", "auc", "sps", "stale", "lag", "waits", "accuracy"]
    assert list(bar_postfix(0.5, KGE_EVALS, 1.0, 1, 0.5, 0)) == [
        "loss", "valid_mrr", "sps", "stale", "lag", "waits"]


def test_fields_left_out_go_to_a_progress_line_every_tenth_update(
        caplog: pytest.LogCaptureFixture) -> None:
    fields = bar_postfix(0.5344, CTR_EVALS, 123_456.7, 1, 0.94, 187)
    bar = _bar(80)
    with caplog.at_level(logging.INFO, logger="worker.console"):
        show_progress(bar, fields, step=89, update=9)
        assert not caplog.records
        show_progress(bar, fields, step=99, update=console.PROGRESS_LINE_EVERY)
    [record] = caplog.records
    message = record.getMessage()
    assert message.startswith("event=progress step=99 ")
    shown = bar.postfix.split(", ")
    assert shown[0] == "loss=0.5344"
    for key in fields:  # each field either on the bar or on the line, never both
        assert (f"{key}=" in bar.postfix.replace("eval_loss", "")
                if key != "eval_loss" else "eval_loss=" in bar.postfix) != (
            f" {key}=" in message), (key, bar.postfix, message)
    off = tqdm(total=10, disable=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="worker.console"):
        show_progress(off, fields, step=99, update=10)  # --progress false: every field
    assert all(f" {k}=" in caplog.records[0].getMessage() for k in fields)


def test_columns_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert bar_layout()["ncols"] == 100
    assert console.terminal_columns(_bar(150)) == 100
    monkeypatch.delenv("COLUMNS")
    assert bar_layout()["dynamic_ncols"] is True
    assert console.terminal_columns(_bar(150)) == 150


# -- ps.admin stats ---------------------------------------------------------------------------

def _stats(runs: int = 2, refusals: dict[str, int] | None = None) -> admin_pb2.ShardStats:
    stats = admin_pb2.ShardStats(server_id="node0-4711-ab12cd", uptime_s=123_456.0,
                                 state_bytes_total=3 * 2**40, master_bytes_total=2**30,
                                 pushes_applied_total=12_345_678_901,
                                 rows_updated_total=987_654_321_098, runs_freed=12,
                                 partitions_freed=96)
    stats.refusals.update(refusals or {})
    for run in range(runs):
        run_id = RUN_IDS[run]
        for rank in range(8):
            for table, rows in (("user", 125_000_000), ("item", 2_500_000)):
                p = stats.partitions.add(
                    run_id=run_id, rank=rank, incarnation=1795736355830000 + rank,
                    table=table, row_start=rank * rows, row_end=(rank + 1) * rows,
                    rows_held=rows, state_bytes=rows * 1025, pushes_applied=1_234_567,
                    rows_updated=987_654_321, rows_per_second=1_234_567.0,
                    distinct_rows_touched=rows // 2, last_step=1_234_566, lag_steps=1,
                    queue_depth=2, optimizer="adam(lr=0.02, betas=(0.9, 0.999), eps=1e-08)",
                    row_dtype="fp32", run_state="active")
                p.refusals.update(refusals or {})
    return stats


REFUSALS = {"stale_step": 3, "row_out_of_range": 12, "unauthenticated": 1}


@pytest.mark.parametrize("width", [80, 100, 160])
@pytest.mark.parametrize("refusals", [{}, REFUSALS], ids=["none", "three-kinds"])
def test_stats_fit_the_terminal(width: int, refusals: dict[str, int]) -> None:
    text = format_shard_stats(_stats(refusals=refusals), width=width)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), "\n".join(
        f"{len(line)}: {line}" for line in lines)
    header = next(line for line in lines if line.startswith("run "))
    columns = header.split()
    assert columns[:2] == ["run", "state"] and "step" in columns
    missing = [c for c in RUN_COLUMNS if c not in columns]
    if missing:  # named on the last line
        assert f"{', '.join(missing)} left out to fit {width} columns" in " ".join(
            line.strip() for line in lines[-2:])
    if width >= 100:
        assert columns == list(RUN_COLUMNS), header
    if width >= 160:
        assert "left out" not in text
    refusal_lines = " ".join(lines[:5])
    for reason, count in refusals.items():
        assert f"{reason}={count}" in refusal_lines  # the header keeps every kind


def test_stats_default_width_is_100_and_wide_says_a_shared_optimizer_once() -> None:
    assert DEFAULT_WIDTH == 100
    assert all(len(line) <= 100 for line in format_shard_stats(_stats()).splitlines())
    wide = format_shard_stats(_stats(runs=1), wide=True, width=80).splitlines()
    assert "optimizer (every row): adam(lr=0.02, betas=(0.9, 0.999), eps=1e-08)" in wide
    header = next(line for line in wide if line.startswith("run "))
    assert header.split()[-1] == "master_MB"  # the optimizer is not repeated per row
    rows = [line.split() for line in wide[wide.index(header) + 1:]]
    assert len(rows) == 16 and rows[0][:3] == [RUN_IDS[0], "0", "user"]
    mixed = _stats(runs=1)
    mixed.partitions[0].optimizer = "sgd(lr=0.1)"
    header = next(line for line in format_shard_stats(mixed, wide=True).splitlines()
                  if line.startswith("run "))
    assert header.split()[-1] == "optimizer"


# -- the summary and the stats header: cut between fields, never inside a word --------------

SUMMARY = [
    "hybridps worker: task=synthetic mode=server world=2 device=cpu run_id=" + RUN_IDS[0],
    "stopped early after step 573 (574 of 4100 steps; best step 409, restored)  loss "
    "0.6745 -> 0.5344  samples/s 19705  train 26.0s  wall 27.9s",
    "step time (ms, rank 0): apply 1.2  data 2.0  forward 7.6  a2a 4.9  backward 5.7  "
    "optimizer 2.3  push 1.0  log 0.3  eval 0.4",
    "dense: parallel fsdp  mesh [2]  compile False  wrapped True  precision fp32  "
    "embedding_grad_scale 0.5  clip_grad_norm 0.0  reshard_after_forward True",
    "  step 99: ck/" + "x" * 90 + "  1.2 KiB  0.01s",
]


def _words(lines: list[str]) -> list[str]:
    return " ".join(lines).split()


@pytest.mark.parametrize("width", [40, 80, 100])
def test_summary_lines_are_cut_between_fields(width: int) -> None:
    for line in SUMMARY:
        parts = wrap_fields(line, width)
        assert _words(parts) == line.split(), parts  # every word whole, in order
        assert all(len(p) <= width or " " not in p.strip() for p in parts), parts
        if len(line) <= width:
            assert parts == [line]
        else:
            lead = line[:len(line) - len(line.lstrip())]
            assert all(p.startswith(lead + "  ") for p in parts[1:]), parts
    dense = wrap_fields(SUMMARY[3], 80)
    # a field (`name value`) stays on one line: a line ends where a field does
    assert all(f"{p.strip()}  " in SUMMARY[3] + "  " for p in dense), dense
    assert wrap_fields(SUMMARY[1], None) == [SUMMARY[1]]  # a file or a pipe: as it is


def test_the_summary_width_is_the_terminals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert console.summary_width() == 80
    monkeypatch.delenv("COLUMNS")
    assert console.summary_width() is None  # pytest's captured stdout: not a terminal
    assert console.wrap_summary(SUMMARY[:2], None) == "\n".join(SUMMARY[:2])


def test_the_stats_header_wraps_between_fields_never_inside_a_word() -> None:
    stats = _stats(refusals={f"reason_number_{i}": i for i in range(8)})
    stats.server_id = "a-rather-long-host-name.example.org-4711-ab12cd34ef56"
    for width in (80, 40):
        lines = format_shard_stats(stats, width=width).splitlines()
        header = lines[:lines.index(next(x for x in lines if x.startswith("run ")))]
        assert all(len(line) <= width or " " not in line.strip() for line in lines), lines
        assert any(line.strip() == stats.server_id or f"server {stats.server_id}" in line
                   for line in header), header  # the id whole, not cut at the width
        for field in ("uptime 34h17m", "partitions 32", "rows updated 987654321098"):
            assert any(field in line for line in header), header
        refusals = " ".join(line.strip() for line in header)
        assert all(f"reason_number_{i}={i}" in refusals for i in range(8))
