"""worker/runtime/faults.py: the fault points a test or a failure campaign can trigger (no
processes)."""

from __future__ import annotations

import pytest

from worker.runtime import faults
from worker.runtime.faults import FAULT_ENV, KILL_ENV, Fault


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
    """tests/worker/checkpoint/test_restart.py finds "SIGKILL at step N" in the worker's log."""
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


def test_cut_fires_every_nth_step_on_the_registered_connection() -> None:
    """HYBRIDPS_FAULT_CUT=EVERY[:RANK]: the update source's cut, every EVERY-th step."""
    assert faults.faults_from({faults.CUT_ENV: "5"}) == [
        Fault("pushed", 4, None, "cut", source=faults.CUT_ENV, every=5)]
    cuts: list[str] = []
    forget = faults.on_cut(lambda: cuts.append("cut"))
    try:
        for step in range(12):
            faults.reached("pushed", step % 2, step, {faults.CUT_ENV: "5:1"})
        assert cuts == ["cut"]  # step 9 (rank 1); step 4 was rank 0's
        for step in range(12):
            faults.reached("pushed", 0, step, {faults.CUT_ENV: "3",
                                               "TORCHELASTIC_RESTART_COUNT": "2"})
        assert len(cuts) == 1 + 4  # steps 2, 5, 8, 11, in any incarnation
    finally:
        forget()
    faults.reached("pushed", 0, 2, {faults.CUT_ENV: "3"})
    assert len(cuts) == 5  # unregistered: nothing to cut
    for bad in ("0", "x", "3:y", "-2"):
        with pytest.raises(ValueError, match="is not EVERY"):
            faults.check_environment({faults.CUT_ENV: bad})
