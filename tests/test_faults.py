"""worker/faults.py: the fault points a test or a failure campaign can trigger (no processes)."""

from __future__ import annotations

import pytest

from worker import faults
from worker.faults import FAULT_ENV, KILL_ENV, Fault


def test_both_variables_parse_into_faults_at_their_points() -> None:
    env = {KILL_ENV: "1:5", FAULT_ENV: "7:rows:sleep=0.5"}
    assert faults.faults_from(env) == [
        Fault("pushed", 5, 1, "kill", first_incarnation_only=True, source=KILL_ENV),
        Fault("checkpoint.rows", 7, None, "sleep", 0.5, source=FAULT_ENV)]
    assert faults.faults_from({FAULT_ENV: "0:3:manifest"}) == [
        Fault("checkpoint.manifest", 3, 0, "exit", source=FAULT_ENV)]


@pytest.mark.parametrize(("env", "match"), [
    ({KILL_ENV: "x:1"}, "is not RANK:STEP"),
    ({FAULT_ENV: "1:2:3:4:5"}, r"is not \[RANK:\]STEP:PHASE"),
    ({FAULT_ENV: "a:2:rows"}, "RANK, STEP integers"),
    ({FAULT_ENV: "2:rows:sleep=soon"}, "SEC a number"),
])
def test_a_malformed_fault_fails_at_start(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        faults.check_environment(env)


def test_a_fault_fires_only_at_its_rank_step_and_point(monkeypatch: pytest.MonkeyPatch) -> None:
    fired: list[tuple[str, int, int]] = []
    monkeypatch.setattr(Fault, "fire", lambda self, rank, step: fired.append(
        (self.point, rank, step)))
    env = {FAULT_ENV: "1:7:optim"}
    for point in ("checkpoint.rows", "checkpoint.optim"):
        for rank in (0, 1):
            for step in (6, 7):
                faults.reached(point, rank, step, env)
    assert fired == [("checkpoint.optim", 1, 7)]


def test_a_new_kind_of_fault_is_one_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a campaign adds: a variable, its parser, and a point the loop announces."""
    monkeypatch.setitem(faults.PARSERS, "HYBRIDPS_FAULT_TEST",
                        lambda spec: [Fault("test.point", int(spec), None, "sleep", 0.0)])
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    faults.reached("test.point", 3, 4, {"HYBRIDPS_FAULT_TEST": "4"})
    faults.reached("test.point", 3, 5, {"HYBRIDPS_FAULT_TEST": "4"})
    assert slept == [0.0]


def test_firing_says_what_where_and_when(monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """tests/test_restart.py finds "SIGKILL at step N" in the worker's log."""
    done: list[tuple[str, int]] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: done.append(("kill", sig)))
    monkeypatch.setattr(faults.os, "_exit", lambda code: done.append(("exit", code)))
    with caplog.at_level("WARNING", logger="worker.faults"):
        faults.reached("pushed", 1, 13, {KILL_ENV: "1:13"})
        faults.reached("checkpoint.dense", 0, 9, {FAULT_ENV: "9:dense"})
    assert "rank 1: HYBRIDPS_FAULT_KILL: SIGKILL at step 13 (pushed)" in caplog.text
    assert "rank 0: HYBRIDPS_FAULT_CHECKPOINT: exiting at step 9 (checkpoint.dense)" in (
        caplog.text)
    assert done[-1] == ("exit", faults.FAULT_EXIT_CODE)
