"""The update-source registry (worker/config/update_kinds.py: the kinds and their facts;
worker/sync/update_sources.py: a builder per kind), and no caller branching on a source's
class."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridps.cli import ConfigError
from worker.config.train_config import TrainConfig
from worker.config.update_kinds import UPDATE_KINDS, kind_named
from worker.embedding.dynamic.ids import RowPager
from worker.sync.client import ShardClient
from worker.sync.update_sources import BUILDERS
from worker.updates.source import LocalSparseOptimizer, UpdateSource

ROOT = Path(__file__).resolve().parents[3]


def test_both_kinds_and_their_facts() -> None:
    assert set(UPDATE_KINDS) == {"server", "local"}
    server, local = UPDATE_KINDS["server"], UPDATE_KINDS["local"]
    assert (server.mode, server.needs_server, server.claims_resume) == ("server", True, True)
    assert (local.mode, local.needs_server, local.claims_resume) == (
        "local-optimizer", False, False)
    assert (server.flag, local.flag) == ("", "--local-optimizer")


def test_every_kind_has_a_builder() -> None:
    assert set(BUILDERS) == set(UPDATE_KINDS)


def test_chosen_once_from_the_sync_section() -> None:
    assert TrainConfig.of(local_optimizer=True, dim=8).sync.update_kind is UPDATE_KINDS["local"]
    assert TrainConfig.of(ps="127.0.0.1:1", dim=8).sync.update_kind is UPDATE_KINDS["server"]


def test_an_unknown_kind_errors() -> None:
    with pytest.raises(ConfigError, match="unknown update source 'nope'"):
        kind_named("nope")


def test_the_kinds_import_no_torch() -> None:
    """The launcher and the preflight read the facts before torch is imported."""
    text = (ROOT / "worker" / "config" / "update_kinds.py").read_text()
    assert not re.search(r"^\s*(import|from)\s+(torch|grpc)\b", text, re.M)


@pytest.mark.parametrize("cls", [ShardClient, LocalSparseOptimizer])
def test_every_source_is_a_row_pager(cls: type) -> None:
    assert issubclass(cls, UpdateSource)
    for name in ("page", "peek_paged", "local_store", "server_security"):
        assert callable(getattr(cls, name, None)), (cls.__name__, name)
    assert {"page", "peek_paged", "local_store"} <= set(dir(RowPager))


SOURCE_CLASSES = {"ShardClient": "worker/sync/client.py",
                  "LocalSparseOptimizer": "worker/updates/source.py"}


def test_no_isinstance_on_a_source_outside_its_module() -> None:
    found = []
    for path in sorted((ROOT / "worker").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        for cls, home in SOURCE_CLASSES.items():
            if rel != home and re.search(rf"isinstance\([^)]*\b{cls}\b", text):
                found.append(f"{rel}: isinstance on {cls}")
    assert found == []
    assert (ROOT / SOURCE_CLASSES["ShardClient"]).is_file()  # the scan looks at worker/
