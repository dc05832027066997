"""The KGE sets shipped in hybridps/data: found relative to the package, named by --data-dir,
declared as package data (so a wheel carries them)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hybridps.datasets import DATA_ROOT, resolve_data_dir, shipped_dataset, shipped_names
from worker.config.train_config import TrainConfig
from worker.tasks.kge.data import load_kg_dataset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def test_shipped_sets_load_with_their_published_sizes() -> None:
    assert shipped_names() == ["kinship", "umls"]
    kin = load_kg_dataset(shipped_dataset("kinship"))
    assert (kin.num_entities, kin.num_relations) == (104, 25)
    assert (len(kin.train), len(kin.valid), len(kin.test)) == (8544, 1068, 1074)
    umls = load_kg_dataset("umls")  # the loader resolves the name itself
    assert (umls.num_entities, umls.num_relations) == (135, 46)


@pytest.mark.parametrize("name", ["umls", "UMLS", "kinship", "KINSHIP", "kinships"])
def test_names_resolve_case_insensitively_to_the_package_copy(name: str) -> None:
    path = resolve_data_dir(name)
    assert path.parent == DATA_ROOT and (path / "train.txt").is_file()
    assert DATA_ROOT.parent == Path(__file__).resolve().parents[2] / "hybridps"


def test_an_existing_directory_wins_over_a_shipped_name(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "umls").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_data_dir("umls") == Path("umls")
    # a path (with a separator) is never taken for a name; an unknown name stays as given
    assert resolve_data_dir(os.path.join("nowhere", "kinship")) == Path("nowhere/kinship")
    assert resolve_data_dir("fb15k-237") == Path("fb15k-237")
    with pytest.raises(ValueError, match=r"'fb15k' is not shipped.*kinship, umls"):
        shipped_dataset("fb15k")
    with pytest.raises(FileNotFoundError, match=r"fb15k-237/train\.txt"):
        load_kg_dataset("fb15k-237")


def test_kge_config_accepts_a_shipped_name() -> None:
    cfg = TrainConfig.of(local_optimizer=True, task="kge", data_dir="kinship")
    assert cfg.kge.data_dir == "kinship"


def test_package_data_declares_every_shipped_file() -> None:
    """pyproject's package-data globs (relative to hybridps/) match every file under
    hybridps/data: a wheel or a non-editable install carries the sets."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["hybridps"]
    package = REPO / "hybridps"
    declared = {p for g in globs for p in package.glob(g)}
    shipped = {p for p in DATA_ROOT.rglob("*") if p.is_file()}
    assert len(shipped) == 7 and shipped <= declared, sorted(map(str, shipped - declared))
