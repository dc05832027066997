"""docs/flags.md is generated from the config dataclasses and committed up to date."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_flags_doc.py"


def _render() -> str:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gen_flags_doc
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return str(gen_flags_doc.render())


def test_committed_flags_doc_is_up_to_date() -> None:
    assert (ROOT / "docs" / "flags.md").read_text() == _render(), (
        "docs/flags.md differs from the config dataclasses: run "
        "`python scripts/gen_flags_doc.py` and commit")


def test_the_doc_lists_every_flag_with_its_variable() -> None:
    from hybridps.cli import settings
    from ps.config import ServerConfig
    from worker.config.train_config import TrainConfig

    text = _render()
    for cls in (TrainConfig, ServerConfig):
        for s in settings(cls):
            assert f"`{s.flag} " in text and f"`{s.env}`" in text, s.name


@pytest.mark.e2e
def test_check_mode_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "flags.md"
    stale.write_text("old\n")
    run = [sys.executable, str(SCRIPT), "--check", "--out", str(stale)]
    assert subprocess.run(run, capture_output=True, check=False).returncode == 1
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(stale)], check=True,
                   capture_output=True)
    assert subprocess.run(run, capture_output=True, check=False).returncode == 0
