"""The layers point one way: worker -> hybridps <- ps (docs/architecture.md).

Every import statement of every module is read with `ast` (including imports inside
functions and under TYPE_CHECKING), so a lazy import cannot hide a wrong edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("worker", "ps", "hybridps")
# package -> the top-level packages of this project it must never import
FORBIDDEN = {"worker": {"ps"}, "ps": {"worker"}, "hybridps": {"worker", "ps"}}


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py")
                  if "v1" not in p.relative_to(ROOT / package).parts)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the file."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_against_the_layers(package: str) -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {top}"
             for path in _modules(package) for line, top in _imported(path)
             if top in FORBIDDEN[package]]
    assert not wrong, "\n".join(wrong)


def test_the_scan_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from ps.core import ShardCore\n    import worker.train\n")
    assert _imported(source) == [(2, "ps"), (3, "worker")]
