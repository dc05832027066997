"""Write docs/flags.md from the config dataclasses (the worker's and the server's).

    python scripts/gen_flags_doc.py            # rewrite docs/flags.md
    python scripts/gen_flags_doc.py --check    # exit 1 when docs/flags.md is out of date

tests/docs/test_flags_doc.py runs the check, like tests/system/test_proto_codegen.py for gRPC code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from hybridps.cli import EVERYDAY, Setting, format_choices, sections, settings  # noqa: E402
from ps.config import ServerConfig  # noqa: E402
from worker.config.task_defaults import TASK_DEFAULTS  # noqa: E402
from worker.config.train_config import TrainConfig  # noqa: E402

OUT = ROOT / "docs" / "flags.md"

HEADER = """\
# Flags

Generated from the config dataclasses by `python scripts/gen_flags_doc.py`; do not edit
by hand (tests/docs/test_flags_doc.py fails when this file is out of date).

**Naming rule.** Every setting is a flag and an environment variable: the setting
`foo_bar` is `--foo-bar` and `HYBRIDPS_FOO_BAR`, whatever section it lives in. Names are
unique within a program, so the section is not part of the name: it is where the setting
lives in code (`cfg.sync.staleness`) and the heading it is listed under here and in
`--help`. Precedence: flag > environment variable > the task's default (worker, below) >
the default in the table. A bool flag given alone (`--resume`) means true; as a value or a
variable it takes 1/0, true/false, yes/no, on/off. A bad value stops the program before
torch is imported, with one error line naming it (exit code 2).

**How to add a flag.** Add a field to the section it belongs to, with
`setting(default, "help", "METAVAR")` (hybridps/cli.py): worker settings live in
worker/config/train_config.py (run, sync, same-node, security, checkpoints, logging, memory plan),
worker/config/dense_options.py (dense part) and worker/config/task_options.py (one section per task;
a new task's own settings go in a new section there, added to `TrainConfig`); the
server's in ps/config.py. Give choices as a `Literal[...]` type (the one list of them)
and a lower bound as `at_least=N`: the section's `__post_init__` calls `check_settings`
first; put any other check after it, raising ValueError that names the value (a check
that spans sections goes in `TrainConfig.__post_init__`). Read it as
`cfg.<section>.<name>`. Then run `python scripts/gen_flags_doc.py` and commit
docs/flags.md. A flag that goes away is simply deleted: using it then stops with
"unrecognized arguments" and the nearest flag that exists as a hint.
"""


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(s: Setting) -> str:
    if s.default == "" or s.default is None:
        return ""
    if isinstance(s.default, bool):
        return "true" if s.default else "false"
    low = "" if s.at_least is None else f" (>= {s.at_least:g})"
    return f"`{s.default}`{low}"


def _table(rows: list[Setting]) -> list[str]:
    out = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for s in rows:
        value = f"{{{format_choices(s.choices)}}}" if s.choices else s.metavar
        everyday = " (everyday)" if s.everyday else ""
        out.append(f"| `{s.flag} {_cell(value)}` | `{s.env}` | {_cell(_default(s))} | "
                   f"{_cell(s.help)}{everyday} |")
    return out


def _by_heading(cls: type) -> dict[str, list[Setting]]:
    groups: dict[str, list[Setting]] = {}
    for s in settings(cls):
        groups.setdefault(s.heading, []).append(s)
    return groups


def worker_part() -> list[str]:
    found = settings(TrainConfig)
    lines = ["## Worker: `torchrun ... worker/main.py` (`TrainConfig`, "
             "worker/config/train_config.py)", "",
             f"{len(found)} settings. The {EVERYDAY} (listed first by `--help`): "
             + ", ".join(f"`{s.flag}`" for s in found if s.everyday) + ".", ""]
    where = {attr: cls for attr, cls in sections(TrainConfig)}
    groups = _by_heading(TrainConfig)
    for attr, cls in where.items():
        rows = [s for s in found if s.path[0] == attr]
        heading = rows[0].heading
        doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        lines += [f"### {heading}", "",
                  f"`cfg.{attr}`: `{cls.__name__}` ({cls.__module__.replace('.', '/')}.py). "
                  f"{doc}", "", *_table(groups[heading]), ""]
    lines += ["### Task defaults", "",
              "Used when neither the flag nor the variable is given "
              "(worker/config/task_defaults.py):", "",
              "| task | defaults |", "|---|---|"]
    for task, values in TASK_DEFAULTS.items():
        lines.append(f"| `{task}` | " + ", ".join(
            f"`--{k.replace('_', '-')} {v}`" for k, v in values.items()) + " |")
    return [*lines, ""]


def server_part() -> list[str]:
    found = settings(ServerConfig)
    lines = ["## Shard server: `python -m ps` (`ServerConfig`, ps/config.py)", "",
             f"{len(found)} settings. The {EVERYDAY}: "
             + ", ".join(f"`{s.flag}`" for s in found if s.everyday) + ".", ""]
    for heading, rows in _by_heading(ServerConfig).items():
        lines += [f"### {heading}", "", *_table(rows), ""]
    return lines


def render() -> str:
    return "\n".join([HEADER, *worker_part(), *server_part()]).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is out of date: run `python scripts/gen_flags_doc.py`",
                  file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
