"""The fuzzer's coverage check (fuzz/fuzz_messages.py), without a
server. Its builders make a message of every RPC of the proto services and register
every optimizer kind of hybridps/optim_kinds.py with static and dynamic tables; a kind or
an RPC it never exercised is a gap (fuzz/fuzz_proto.py then fails), including a kind
added to the registry or an RPC added to the proto that no builder makes."""

from __future__ import annotations

import importlib.util
import random
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from hybridps.optim_kinds import KINDS
from hybridps.v1 import admin_pb2, shard_pb2

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"


@pytest.fixture(scope="module")
def fm() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_messages", FUZZ / "fuzz_messages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_messages"] = module
    spec.loader.exec_module(module)
    return module


def _all_methods() -> list[str]:
    return [m.name for pb, svc in ((shard_pb2, "ShardService"), (admin_pb2, "AdminService"))
            for m in pb.DESCRIPTOR.services_by_name[svc].methods]


def _offline_labels(fm: ModuleType, items: int) -> Counter[str]:
    """The coverage labels of `items` built calls (nothing sent)."""
    gen = fm.Generator(random.Random(3), ["fuzz/c0"], admin_token="t" * 24)
    sent: Counter[str] = Counter()
    for _ in range(items):
        item = gen.item()
        if item.built:
            sent.update(gen.labels(item.method, item.requests))
    return sent


def test_the_builders_make_every_rpc_and_register_every_kind_and_table_mode(
        fm: ModuleType) -> None:
    sent = _offline_labels(fm, 3000)
    assert not [m for m in _all_methods() if not sent[f"rpc {m}"]], sent
    assert not [k for k in KINDS if not sent[f"register {k}"]], sent
    assert sent["register table static"] and sent["register table dynamic"], sent
    assert sent["page move"] and sent["page peek"], sent
    # every registry kind is one of the proto's, and both lists are required
    assert set(fm.optimizer_kinds()) == set(KINDS)
    need = fm.required_coverage()
    assert {f"rpc {m}" for m in _all_methods()} <= set(need)
    assert {f"register {k}" for k in KINDS} | {f"push {k}" for k in KINDS} <= set(need)


def test_a_gap_is_named(fm: ModuleType) -> None:
    full = Counter(dict.fromkeys(fm.required_coverage(), 1))
    assert fm.coverage_gaps(full, full) == []
    for missing in ("rpc Page", "register rowwise_adagrad", "push adagrad",
                    "register table dynamic", "page peek"):
        ok = full.copy()
        del ok[missing]
        assert [g for g in fm.coverage_gaps(full, ok) if g.startswith(f"{missing}:")], missing
    sent = full.copy()
    del sent["rpc DropRun"]
    assert fm.coverage_gaps(sent, full) == ["rpc DropRun: never sent (no builder makes it?)"]


def test_a_kind_or_rpc_the_fuzzer_does_not_know_is_a_gap(
        fm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind added to the registry (not to the proto) and an RPC added to the proto (no
    builder): the campaign's coverage check names both."""
    full = Counter(dict.fromkeys(fm.required_coverage(), 1))
    monkeypatch.setattr(fm, "KINDS", (*KINDS, "lamb"))
    methods = fm.service_methods
    monkeypatch.setattr(fm, "service_methods", lambda: [*methods(), "Evict"])
    gaps = fm.coverage_gaps(full, full)
    assert any(g.startswith("register lamb:") for g in gaps), gaps
    assert any(g.startswith("push lamb:") for g in gaps), gaps
    assert any(g.startswith("rpc Evict: never sent") for g in gaps), gaps
    with pytest.raises(ValueError):
        fm.proto_kind("lamb")  # the generator's Register of such a run fails loudly
