"""The README and docs/ stay usable: commands paste as they are, links resolve, the front
page fits on a screen, and no absolute path of a development machine appears."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A command block is a fenced block marked bash or sh; unmarked blocks show output.
COMMAND_BLOCK = re.compile(r"^( *)```(?:bash|sh)\n(.*?)^\1```", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# What cannot be pasted: elided arguments, optional-argument brackets, placeholders.
PLACEHOLDER = re.compile(r"(?<![\w.])\.\.\.(?![\w.])|\[--|\bHOST:PORT\b|<[A-Z][A-Z_]*>")


def _command_lines(text: str) -> list[str]:
    lines = []
    for match in COMMAND_BLOCK.finditer(text):
        for line in match.group(2).splitlines():
            code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
            if code.strip():
                lines.append(code)
    return lines


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_paste_as_they_are(page: Path) -> None:
    bad = [line for line in _command_lines(page.read_text()) if PLACEHOLDER.search(line)]
    assert not bad, f"{page.relative_to(ROOT)}: commands with placeholders:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    missing = [target for target in LINK.findall(page.read_text())
               if "://" not in target and not (page.parent / target).exists()]
    assert not missing, f"{page.relative_to(ROOT)}: links to missing files: {missing}"


def test_the_front_page_fits_on_a_screen() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) < 12 * 1024, "README.md is over 12 KB: move detail to docs/"
    assert "<!--FILL" not in text, "README.md still has a placeholder to fill"
    fences = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    setup = [line for block in fences for line in block.splitlines()
             if line.startswith("bash scripts/")]
    assert [line.split()[1] for line in setup] == ["scripts/run_default_job.sh",
                                                   "scripts/test.sh"]
    assert "source .venv/bin/activate" in text


def test_no_absolute_path_of_a_development_machine() -> None:
    # Built from parts so that this file does not match itself.
    pattern = re.compile("|".join(["/" + "work/(?:shared|main|wt-)", "/" + "root/",
                                   "/" + r"home/\w+/"]))
    files = [p for p in ROOT.rglob("*") if p.suffix in {".py", ".md", ".sh", ".yml", ".toml"}
             and not {".venv", ".git", "build", "runs"} & set(p.relative_to(ROOT).parts)]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in files
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if pattern.search(line)]
    assert not found, "absolute machine paths:\n" + "\n".join(found)


def test_the_checks_catch_what_they_should() -> None:
    sample = "```bash\ntorchrun ... --resume\npython -m ps  # ok ... in a comment\n```\n"
    assert [line for line in _command_lines(sample) if PLACEHOLDER.search(line)] == [
        "torchrun ... --resume"]
    assert PLACEHOLDER.search("python -m ps.admin stats --ps HOST:PORT")
    assert not PLACEHOLDER.search("torchrun worker/main.py --ps 127.0.0.1:50051")
