"""The README and docs/ stay usable: commands paste as they are, links resolve, the front
page fits on a screen, and no absolute path of a development machine appears."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# A command block is a fenced block marked bash or sh; unmarked blocks show output.
# tests/docs/test_doc_blocks.py checks and runs them.
from tests.testing.doc_blocks import COMMAND_BLOCK, PAGES, ROOT, blocks, commands

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


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_ranks_are_launched_with_hybridps_run(page: Path) -> None:
    # several nodes too: hybridps-run takes torchrun's rendezvous flags (worker/plan.py's
    # run commands use it so)
    plain = [f"{block.where}: {cmd.text[:70]}" for block in blocks(page)
             for cmd in commands(block.text) if "torchrun" in cmd.argv[:3]]
    assert not plain, "plain torchrun where hybridps-run gives one line:\n" + "\n".join(plain)


def test_the_custom_model_page_names_the_real_task_api() -> None:
    import inspect

    from worker import export
    from worker.tasks import base

    page = (ROOT / "docs" / "custom_model.md").read_text()
    for doc in (page, base.__doc__ or ""):
        assert "model.lookups" in doc and "model.embedding.lookup" not in doc
    for method in ("lookup", "lookup_bag", "lookup_many", "local_block"):
        assert f"`{method}`" in page and hasattr(base.EmbeddingLookups, method), method
    for hook in ("eval_batch", "evaluate"):
        signature = f"def {hook}{inspect.signature(getattr(base.Task, hook))}"
        assert signature.replace("'", "") in page, signature
    for prefix in (export.EMBEDDING_PREFIX, export.DYNAMIC_PREFIX, export.DENSE_PREFIX):
        assert f"`{prefix}" in page, prefix
    assert "--init-std" in page


def test_the_custom_model_pages_export_keys_are_its_models() -> None:
    code = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "custom_model.md").read_text(),
                      flags=re.S)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "my_model.py", "exec"), namespace)
    towers = namespace["Towers"](8)  # type: ignore[operator]
    page = (ROOT / "docs" / "custom_model.md").read_text()
    named = re.findall(r"`dense\.([\w.]+)`", page)
    assert named and all(key in towers.state_dict() for key in named), named


def test_the_custom_model_pages_file_task_is_the_example_module() -> None:
    """docs/custom_model.md#training-from-files shows examples/two_tower.py's FileTowers as
    it is (the page points to the file; the block cannot drift from it)."""
    page = (ROOT / "docs" / "custom_model.md").read_text()
    section = page[page.index("## Training from files"):]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert code.startswith("class FileTowers(FilesTask):")
    assert code in (ROOT / "examples" / "two_tower.py").read_text()
    assert "examples/two_tower.py" in section and "--task examples.two_tower:FileTowers" in section
