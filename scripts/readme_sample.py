"""README.md's sample output, taken from a real run of the default job.

    python scripts/readme_sample.py                 # run scripts/run_default_job.sh (1-3 min),
                                                    # put its summary into README.md
    python scripts/readme_sample.py --from-log LOG  # the summary of a captured run's stdout
    python scripts/readme_sample.py --check LOG     # exit 1 when README.md's block differs
                                                    # from LOG's (numbers and ids aside)

The block is the worker's summary on standard output, from its first line
(`hybridps worker: task=...`) to `wrote ...`, between the markers below in README.md, with
the repository's absolute path made relative. tests/docs/test_readme_sample.py runs the same job
briefly and fails when README.md's block no longer matches what the console prints.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN_MARK = "<!-- sample output: scripts/readme_sample.py -->"
END_MARK = "<!-- end of sample output -->"
FIRST = "hybridps worker: task="
LAST = "wrote "

# what changes from run to run, in the order applied: ids, then numbers
_VARYING = [
    (re.compile(r"run_id=\S+"), "run_id=ID"),
    (re.compile(r"^server \S+"), "server ID"),
    (re.compile(r"\b[0-9a-f]{8}(?:-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})?\b"),
     "ID"),
    (re.compile(r"\b\d+h\d\dm|\b\d+m\d\ds|\b\d+(?:\.\d+)?s\b"), "N"),  # durations
    (re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"), "N"),
    (re.compile(r"\s+"), " "),
]


def console_block(output: str, root: Path = ROOT) -> list[str]:
    """The summary lines of a run's standard output (the last run in it), paths relative
    to `root`."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(FIRST)]
    if not starts:
        raise ValueError(f"no line starting {FIRST!r}: not the stdout of a worker run")
    block = lines[starts[-1]:]
    ends = [i for i, line in enumerate(block) if line.startswith(LAST)]
    block = block[:ends[0] + 1] if ends else block
    prefix = str(root) + "/"
    return [line.replace(prefix, "").rstrip() for line in block]


def skeleton(line: str) -> str:
    """`line` without what varies from run to run: ids, numbers, column widths."""
    for pattern, replacement in _VARYING:
        line = pattern.sub(replacement, line)
    return line.strip()


def readme_block(text: str) -> list[str]:
    """The sample output's lines in README.md's text (inside the code fence)."""
    if BEGIN_MARK not in text or END_MARK not in text:
        raise ValueError(f"README.md lacks the markers {BEGIN_MARK!r} ... {END_MARK!r}")
    inner = text.split(BEGIN_MARK, 1)[1].split(END_MARK, 1)[0].strip().splitlines()
    return [line for line in inner if not line.startswith("```")]


def with_block(text: str, lines: Sequence[str]) -> str:
    """README.md's text with the sample output replaced by `lines`."""
    head, rest = text.split(BEGIN_MARK, 1)
    tail = rest.split(END_MARK, 1)[1]
    return head + BEGIN_MARK + "\n```\n" + "\n".join(lines) + "\n```\n" + END_MARK + tail


def differences(readme: Sequence[str], console: Sequence[str]) -> list[str]:
    """Lines whose skeletons differ (README's, then the console's); [] when they match."""
    out = []
    for i in range(max(len(readme), len(console))):
        a = readme[i] if i < len(readme) else "(none)"
        b = console[i] if i < len(console) else "(none)"
        if skeleton(a) != skeleton(b):
            out += [f"README.md: {a}", f"console:   {b}"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-log", metavar="LOG", help="a captured run's stdout")
    parser.add_argument("--check", metavar="LOG",
                        help="compare README.md with LOG's summary instead of writing it")
    args = parser.parse_args(argv)
    if args.check:
        found = differences(readme_block(README.read_text()),
                            console_block(Path(args.check).read_text()))
        print("\n".join(found) or "README.md's sample output matches", file=sys.stderr)
        return 1 if found else 0
    if args.from_log:
        output = Path(args.from_log).read_text()
    else:
        # a pipe's summary, one line per item: no COLUMNS to wrap it to
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "run_default_job.sh")],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                              check=False)
        if proc.returncode != 0:
            print(f"the default job failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        output = proc.stdout
    block = console_block(output)
    README.write_text(with_block(README.read_text(), block))
    print(f"README.md: the sample output is now {len(block)} lines from this run",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
