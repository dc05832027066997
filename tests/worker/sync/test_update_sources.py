"""The update-source registry (worker/sync/update_sources.py): both kinds, their facts, and
no caller branching on a source's class."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridps.cli import ConfigError
from worker.config.train_config import TrainConfig
from worker.embedding.dynamic.ids import RowPager
from worker.sync.client import ShardClient
from worker.sync.update_sources import UPDATE_SOURCES, kind_named, source_kind
from worker.updates.source import LocalSparseOptimizer, UpdateSource

ROOT = Path(__file__).resolve().parents[1]


def test_both_kinds_and_their_facts() -> None:
    assert set(UPDATE_SOURCES) == {"server", "local"}
    server, local = UPDATE_SOURCES["server"], UPDATE_SOURCES["local"]
    assert (server.mode, server.needs_server, server.claims_resume) == ("server", True, True)
    assert (local.mode, local.needs_server, local.claims_resume) == (
        "local-optimizer", False, False)


def test_chosen_once_from_the_sync_section() -> None:
    assert source_kind(TrainConfig.of(local_optimizer=True, dim=8).sync) is UPDATE_SOURCES["local"]
    assert source_kind(TrainConfig.of(ps="127.0.0.1:1", dim=8).sync) is UPDATE_SOURCES["server"]


def test_an_unknown_kind_errors() -> None:
    with pytest.raises(ConfigError, match="unknown update source 'nope'"):
        kind_named("nope")


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
