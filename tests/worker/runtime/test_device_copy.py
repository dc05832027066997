"""worker/runtime/device_copy.py: the named places where the loop waits for the device, and the
pushes that wait in an outbox until their gradients reached the host (a GPU's copies are
stood in for by events the test completes; the CUDA run itself is gpu_check/check.py's
sync_debug stage and tests/system/test_gpu.py)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.sync.test_sync import FakeRpc, FakeShard, client, never, steps
from worker.runtime import device_copy
from worker.runtime.device_copy import (
    SYNC_HITS,
    SYNC_POINTS,
    HostGrads,
    PushOutbox,
    grads_to_host,
    sync_point,
    to_device,
)

REPO = Path(__file__).resolve().parents[3]

# Every place the training loop may wait for the device, by name. A new one is a decision:
# add it here and to SYNC_POINTS, with why.
NAMED = {"check_ids", "input_dist", "dynamic_ids", "pop_grads", "push_grads_ready",
         "update_ids", "log_loss", "stop_flag", "evaluate", "checkpoint"}


def used_sync_points() -> dict[str, list[str]]:
    """name -> the places in worker/ and hybridps/ that enter sync_point(name)."""
    out: dict[str, list[str]] = {}
    for package in ("worker", "hybridps"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "sync_point"):
                    arg = node.args[0] if node.args else None
                    name = arg.value if isinstance(arg, ast.Constant) else repr(arg)
                    out.setdefault(str(name), []).append(
                        f"{path.relative_to(REPO)}:{node.lineno}")
    return out


def test_the_named_sync_points() -> None:
    assert set(SYNC_POINTS) == NAMED
    assert all(why.strip() for why in SYNC_POINTS.values())


def test_every_sync_point_entered_is_named_and_every_name_is_entered() -> None:
    used = used_sync_points()
    assert set(used) == NAMED, {n: w for n, w in used.items() if n not in NAMED}


def test_an_unnamed_sync_point_is_refused_naming_it() -> None:
    with pytest.raises(KeyError, match="'no_such_place'"):
        sync_point("no_such_place")


def test_sync_points_are_counted_and_cost_no_cuda_call_outside_a_debug_run() -> None:
    SYNC_HITS.clear()
    for _ in range(3):
        with sync_point("log_loss"):
            pass
    assert SYNC_HITS["log_loss"] == 3
    assert device_copy._debug_mode == 0 and device_copy._inside == 0


def test_sync_debug_refuses_a_bad_mode() -> None:
    with pytest.raises(ValueError, match="'loud'"):
        device_copy.sync_debug("loud")


def test_on_the_cpu_the_copies_are_the_tensors_themselves() -> None:
    ids_U = torch.tensor([1, 4, 9])
    grads_UD = torch.randn(3, 2, requires_grad=True)
    host = grads_to_host({"t": (ids_U, grads_UD)})
    assert host.ready() and host.event is None
    got_ids, got_grads = host.grads["t"]
    assert got_ids.data_ptr() == ids_U.data_ptr() and torch.equal(got_ids, ids_U)
    assert got_grads.data_ptr() == grads_UD.data_ptr() and not got_grads.requires_grad
    assert to_device(ids_U, torch.device("cpu")) is ids_U


class FakeEvent:
    """A CUDA event stand-in: done when the test says so; synchronize() waits (= done)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[FakeEvent]:
    """grads_to_host copies (clones) and hands out a FakeEvent per push."""
    made: list[FakeEvent] = []

    def copy_later(grads: Any) -> HostGrads:
        made.append(FakeEvent())
        return HostGrads({n: (i.clone(), g.detach().clone()) for n, (i, g) in grads.items()},
                         made[-1])

    monkeypatch.setattr(device_copy, "grads_to_host", copy_later)
    return made


def test_the_outbox_keeps_step_order_and_waits_only_for_due_steps(
        events: list[FakeEvent]) -> None:
    box = PushOutbox()
    grads = {"t": (torch.tensor([0]), torch.ones(1, 2))}
    for step in range(3):
        box.add(step, grads, None)
    events[0].done = events[2].done = True
    assert [s for s, _, _ in box.ready()] == [0]  # step 2 is copied, but step 1 is not
    assert len(box) == 2 and not events[1].waited
    SYNC_HITS.clear()
    assert [s for s, _, _ in box.ready(through_step=1)] == [1, 2]
    assert events[1].waited and not events[2].waited
    assert SYNC_HITS["push_grads_ready"] == 1


def test_a_push_is_sent_once_its_gradients_are_on_the_host(events: list[FakeEvent]) -> None:
    shard = FakeShard()
    c = client(FakeRpc(shard, never))
    c.start()
    data = steps(4)
    try:
        c.push(0, data[0])
        c.poll()
        assert shard.applied == [], "sent before its gradients reached the host"
        events[0].done = True
        c.poll()
        assert shard.applied == [(0, "a"), (0, "b")]
        c.push(1, data[1])
        c.push(2, data[2])
        events[2].done = True  # step 1 is not: neither goes, order first
        c.poll()
        assert shard.applied[-1] == (0, "b")
        updates, _ = c.take(1)  # due now: waits for step 1's copy, not for step 2's
        assert [(u.step, u.table) for u in updates] == [(0, "a"), (0, "b"), (1, "a"),
                                                        (1, "b")]
        assert events[1].waited and not events[2].waited
        assert (2, "b") in shard.applied, "step 2 was copied: sent along"
        c.push(3, data[3])
        c.finish(3)  # a Flush sends (waiting for) every push first
        assert events[3].waited and shard.applied[-2:] == [(3, "a"), (3, "b")]
        assert [(u.step, u.table) for u in c.take(3)[0]] == [(2, "a"), (2, "b"), (3, "a"),
                                                            (3, "b")]
        for u in updates:  # the answers are those of the gradients pushed
            want = data[u.step][u.table]
            assert torch.equal(u.ids_U, want[0])
            assert torch.equal(u.delta_UD, -want[1] * (u.step + 1))
    finally:
        c.close()
    assert len(c.outbox) == 0
