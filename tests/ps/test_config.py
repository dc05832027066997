"""The server's memory settings (ps/config.py): --memory-budget-mb is the budget of
--max-state-bytes in MiB, one of the two; --run-shares at least one."""

from __future__ import annotations

import pytest

from ps.config import ServerConfig


def test_the_budget_in_mib_or_in_bytes() -> None:
    assert ServerConfig(memory_budget_mb=64).state_budget_bytes == 64 * 2**20
    assert ServerConfig(max_state_bytes=1000).state_budget_bytes == 1000
    assert ServerConfig().state_budget_bytes == 0  # the default share of the host


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"memory_budget_mb": 64, "max_state_bytes": 1000},
     "--memory-budget-mb 64 and --max-state-bytes 1000 are the same budget: give one"),
    ({"memory_budget_mb": -1}, "--memory-budget-mb -1 must be >= 0"),
    ({"run_shares": 0}, "--run-shares 0 must be >= 1"),
])
def test_bad_memory_settings_are_one_line_naming_the_value(kwargs: dict[str, int],
                                                          message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(**kwargs)  # type: ignore[arg-type]
