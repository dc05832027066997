"""The generated samples in docs/ say what the runs recorded (scripts/doc_samples.py).
The dynamic example's counters are compared with a fresh run where its block runs
(tests/docs/test_doc_blocks.py), kge.md's plan with a fresh plan; the 5000-step table, too
slow for the suite, with its record."""

from __future__ import annotations

import json
import re

import pytest

from scripts.doc_samples import (
    KGE_PAGE,
    OPERATIONS_PAGE,
    RECORD,
    check,
    dynamic_lines,
    main,
    operations_table,
    page_sample,
    plan_command,
    run_plan,
    with_sample,
    without_run_ids,
)
from scripts.readme_sample import README, readme_block

# a rerun at --staleness 1 differs in the third decimal (docs/operations.md says so)
RERUN_TOLERANCE = 0.005


def test_the_operations_table_is_the_one_of_its_record() -> None:
    assert check() == []
    table = page_sample(OPERATIONS_PAGE.read_text(), "operations")
    assert table == operations_table(json.loads(RECORD.read_text()))
    stale = with_sample(OPERATIONS_PAGE.read_text(), "operations",
                        [*table[:-1], "| 5000 | 0.516 | 0.482 | 0.822 | 0.848 | 0.674 -> 0.506 |"],
                        fence=False)
    assert page_sample(stale, "operations") != table  # a hand-edited row is found


def test_the_check_runs_as_the_scripts_doc_says(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check"]) == 0
    assert "the samples match their records" in capsys.readouterr().err
    for argv, says in (([], "name a sample to regenerate (dynamic, operations, plan)"),
                       (["dynamc"], "no sample 'dynamc': the samples are dynamic, ")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_the_tables_default_row_agrees_with_the_readmes_run() -> None:
    row = next(r for r in json.loads(RECORD.read_text())["rows"] if r["steps"] == 1000)
    eval_line = next(line for line in readme_block(README.read_text())
                     if line.startswith("eval:"))
    readme = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)", eval_line)}
    for doc_key, key in [("eval_loss", "loss"), ("auc", "auc"), ("planted_loss",
                                                                 "planted_loss")]:
        assert row[doc_key] == pytest.approx(readme[key], abs=RERUN_TOLERANCE), doc_key


def test_the_dynamic_lines_are_read_from_the_servers_report() -> None:
    output = "\n".join([
        "runs freed 0 (0 partitions); each run's state and when it is freed: --json",
        "dynamic run-81c173aaaa2a rank 0 user: occupied 40/40  admissions 221  ",
        "  page-ins 46  hit rate 0.434",
        "run               state   ranks", "  not a continuation"])
    assert without_run_ids(dynamic_lines(output)) == [
        "dynamic RUN rank 0 user: occupied 40/40  admissions 221",
        "  page-ins 46  hit rate 0.434"]
    with pytest.raises(ValueError, match=r"no 'dynamic \.\.\.' line"):
        dynamic_lines("steps 30")
    with pytest.raises(ValueError, match="no sample 'nope'"):
        page_sample("text", "nope")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_kge_plan_sample_is_what_the_plan_prints() -> None:
    """Every line of the plan, not a hand-picked few; the host's memory is given on the
    command line, so that the capacity and the verdict are the same on every machine."""
    page = page_sample(KGE_PAGE.read_text(), "plan")
    assert page[:2] == plan_command() and "--host-memory-gb 32" in page[1]
    assert page == run_plan(), ("docs/kge.md's plan drifted; run `python "
                                "scripts/doc_samples.py plan`")
