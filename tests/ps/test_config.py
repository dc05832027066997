"""The server's memory settings (ps/config.py): --memory-budget-mb is the budget of
--max-state-bytes in MiB, one of the two; --run-shares at least one; the disk tier's
--spill-dir (created at start, a directory), --spill-max-gb and --spill-page-kb."""

from __future__ import annotations

from pathlib import Path

import pytest

from ps.config import ServerConfig, spill_dir_problem


def test_the_budget_in_mib_or_in_bytes() -> None:
    assert ServerConfig(memory_budget_mb=64).state_budget_bytes == 64 * 2**20
    assert ServerConfig(max_state_bytes=1000).state_budget_bytes == 1000
    assert ServerConfig().state_budget_bytes == 0  # the default share of the host


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"memory_budget_mb": 64, "max_state_bytes": 1000},
     "--memory-budget-mb 64 and --max-state-bytes 1000 are the same budget: give one"),
    ({"memory_budget_mb": -1}, "--memory-budget-mb -1 must be >= 0"),
    ({"run_shares": 0}, "--run-shares 0 must be >= 1"),
    ({"spill_max_gb": -1.0}, "--spill-max-gb -1.0 must be >= 0"),
    ({"spill_max_gb": float("inf")}, "--spill-max-gb inf must be >= 0 and finite"),
    ({"spill_page_kb": 0}, "--spill-page-kb 0 must be >= 1"),
])
def test_bad_memory_settings_are_one_line_naming_the_value(kwargs: dict[str, int],
                                                          message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(**kwargs)  # type: ignore[arg-type]


def test_the_spill_dir_is_created_and_must_be_a_writable_directory(tmp_path: Path) -> None:
    assert spill_dir_problem("") is None  # off
    assert spill_dir_problem(str(tmp_path / "a" / "b")) is None
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        ServerConfig(spill_dir=str(tmp_path / "file"))
    problem = spill_dir_problem(str(tmp_path / "file" / "x"))
    assert problem is not None and "cannot create it" in problem
