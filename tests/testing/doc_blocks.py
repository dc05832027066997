"""The shell blocks of README.md and docs/*.md, their commands, and what is wrong with them
without running them (tests/docs/test_doc_blocks.py runs the cheap ones too).

A block is a fenced block marked bash or sh. HTML comments on the lines just above it say
what the suite needs to know: `<!-- not run: REASON -->` (too long, a foreground server, a
download; still checked statically) and `<!-- given: PATH, ... -->` (inputs the reader
provides, e.g. a downloaded data set).
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import runpy
import shlex
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_BLOCK = re.compile(r"^( *)```(?:bash|sh)\n(.*?)^\1```", re.S | re.M)
_COMMENT = re.compile(r"^<!-- (not run|given): (.*?) -->$")
README_PORT = "50051"  # the port of the README's own server, which may still be running

# shell words that are no program of ours
EXTERNAL = {"docker", "pip", "tensorboard", "grpcurl", "openssl", "source", "mkdir", "rm",
            "sleep", "kill", "cat", "until", "while", "do", "done", "[", "export"}
CONSOLE_SCRIPTS = {"hybridps-ps": "ps", "hybridps-admin": "ps.admin"}
LAUNCHERS = {"torchrun", "hybridps-run"}
# flags whose value is a file or directory the command reads / writes
INPUT_FLAGS = {"--state", "--kge-results", "--checkpoint", "--resume-from", "--data-dir",
               "--tls-ca", "--tls-cert", "--tls-key"}
OUTPUT_FLAGS = {"--results", "--dump-state", "--out", "--checkpoint-dir", "--port-file",
                "--tensorboard", "--json", "--auth-token-file", "--checkpoint-root"}
SHIPPED_DATA = {"umls", "kinship"}  # --data-dir names of hybridps/data/
_SUBSTITUTION = re.compile(r"\$\(cat ([^)\s]+)\)|\$\([^)]*\)|<\([^)]*\)")
_REDIRECT = re.compile(r"\s(\d?>>?)\s*(&\d|\S+)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    text: str
    not_run: str | None = None
    given: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def first(self) -> str:
        """The block's first command line, which names it where it cannot be marked."""
        return next(line for line in self.text.splitlines()
                    if line.strip() and not line.lstrip().startswith("#"))


@dataclass
class Command:
    argv: list[str]
    text: str
    background: bool = False
    writes: list[str] = field(default_factory=list)  # redirected output files
    reads_port_of: list[str] = field(default_factory=list)  # $(cat FILE)


def blocks(page: Path, text: str | None = None) -> list[Block]:
    text = page.read_text() if text is None else text
    out = []
    for match in COMMAND_BLOCK.finditer(text):
        before = text[:match.start()].splitlines()
        not_run, given = None, ()
        for line in reversed(before):
            comment = _COMMENT.match(line.strip())
            if not comment:
                break
            if comment.group(1) == "not run":
                not_run = comment.group(2)
            else:
                given = tuple(p.strip() for p in comment.group(2).split(","))
        out.append(Block(page, len(before) + 1, match.group(2), not_run, given))
    return out


def logical_lines(text: str) -> Iterator[str]:
    """The block's lines with continuations joined and comments dropped."""
    for line in text.replace("\\\n", " ").splitlines():
        code = "" if line.lstrip().startswith("#") else re.split(r"\s#", line, maxsplit=1)[0]
        if code.strip():
            yield code.strip()


def commands(block_text: str) -> list[Command]:
    out = []
    for line in logical_lines(block_text):
        line = line + " "
        # separators kept: a part followed by a lone `&` runs in the background
        pieces = re.split(r"(&&|\|\||;|\||(?<![>&])&(?=\s))", line)
        for part, sep in zip(pieces[::2], [*pieces[1::2], ""], strict=True):
            reads = [m.group(1) for m in _SUBSTITUTION.finditer(part) if m.group(1)]
            part = _SUBSTITUTION.sub("SUBST", part)
            writes = [target for _, target in _REDIRECT.findall(" " + part)
                      if not target.startswith("&")]
            part = _REDIRECT.sub(" ", " " + part).strip()
            if part:
                out.append(Command(shlex.split(part), " ".join(part.split()), sep == "&",
                                   writes, reads))
    return out


@dataclass
class Program:
    """What a command runs: a module or script of ours with its args, or a launcher's."""
    key: str  # module name ('ps', 'worker.main', 'ps.admin stats') or script path
    args: list[str]
    launcher_args: list[str] = field(default_factory=list)


SUBCOMMANDS = ("ps.admin", "worker.data")  # programs whose first word picks a command


def _module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".") if path in (
        "worker/main.py",) else path


def program(argv: Sequence[str]) -> Program | None:
    """Our program in `argv` (after VAR=value words); None for anything else."""
    words = list(argv)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    if not words or words[0] in EXTERNAL:
        return None
    head = words[0]
    if head in ("python", "python3"):
        if len(words) > 2 and words[1] == "-m":
            key, args = words[2], words[3:]
        else:
            key, args = _module_of(words[1]), words[2:]
    elif head in CONSOLE_SCRIPTS:
        key, args = CONSOLE_SCRIPTS[head], words[1:]
    elif head in LAUNCHERS:
        launcher, rest = _split_launcher(words[1:])
        if not rest:
            return Program(head, [], launcher)
        return Program(_module_of(rest[0]), rest[1:], launcher)
    elif head == "bash":
        key, args = words[1], words[2:]
    else:
        return Program(head, words[1:])
    if key in SUBCOMMANDS and args and not args[0].startswith("-"):
        key, args = f"{key} {args[0]}", args[1:]
    return Program(key, args)


@functools.cache
def _launcher_parser() -> tuple[frozenset[str], frozenset[str]]:
    """torchrun's flags (hybridps-run takes the same), and those that take no value."""
    from torch.distributed.run import get_args_parser

    flags, bare = set(), set()
    for action in get_args_parser()._actions:
        flags.update(action.option_strings)
        if action.nargs == 0:
            bare.update(action.option_strings)
    return frozenset(flags), frozenset(bare)


def _split_launcher(words: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's own words, the script and its args)."""
    _, bare = _launcher_parser()
    i = 0
    while i < len(words) and words[i].startswith("-"):
        i += 1 if words[i] in bare or "=" in words[i] else 2
    return words[:i], words[i:]


def exists(key: str) -> bool:
    if key.endswith((".py", ".sh")):
        return (ROOT / key).is_file()
    import importlib.util

    module = key.split()[0]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@functools.cache
def flags_of(key: str) -> frozenset[str]:
    """The flags `key`'s --help lists, read in this process (runpy, as `python -m` would
    run it; a program parses its flags before it does anything else)."""
    if key.endswith(".sh"):
        return frozenset()
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    words = key.split()
    out = io.StringIO()
    saved, saved_path = sys.argv, list(sys.path)
    sys.argv = [words[0], *words[1:], "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            if key.endswith(".py"):  # a script's directory is sys.path[0]
                sys.path.insert(0, str((ROOT / key).parent))
                runpy.run_path(str(ROOT / key), run_name="__main__")
            else:
                with warnings.catch_warnings():  # a module this process imported already
                    warnings.simplefilter("ignore", RuntimeWarning)
                    runpy.run_module(words[0], run_name="__main__", alter_sys=False)
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise RuntimeError(f"{key} --help exited {stop.code}") from None
    finally:
        sys.argv, sys.path[:] = saved, saved_path
    return frozenset(re.findall(r"(?<![\w-])--[a-zA-Z][\w-]*", out.getvalue()))


def worker_refusal(args: Sequence[str]) -> str | None:
    """The worker's own one-line refusal of these flags' values (its parser, in this
    process: parsing imports no torch), or None."""
    from hybridps.cli import parse_config
    from worker.config.train_config import TrainConfig

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_config(TrainConfig, [a.replace("SUBST", README_PORT) for a in args])
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        return lines[-1].split("error: ", 1)[-1] if lines else "exit 2"
    return None


def _flag_values(args: Sequence[str]) -> Iterator[tuple[str, str | None]]:
    for i, word in enumerate(args):
        if word.startswith("--"):
            if "=" in word:
                name, value = word.split("=", 1)
                yield name, value
            else:
                nxt = args[i + 1] if i + 1 < len(args) else None
                yield word, nxt if nxt is not None and not nxt.startswith("-") else None


def _made(path: str, made: set[str]) -> bool:
    path = path.rstrip("/")
    return any(path == m or path.startswith(m + "/") or m.startswith(path + "/")
               for m in made)


def _is_server(prog: Program | None) -> bool:
    return prog is not None and prog.key == "ps"


def static_problems(page_blocks: Sequence[Block], readme_log: str | None = "ps.log",
                    made: set[str] | None = None) -> list[str]:
    """What is wrong with a page's blocks without running them, one line each. `made`
    collects the paths the blocks write (and the inputs they are given)."""
    problems: list[str] = []
    made = set() if made is None else made
    waiting_for: set[str] = set()  # port files of servers started, not yet waited for
    for block in page_blocks:
        made.update(block.given)
        is_readme = block.page.name == "README.md"
        for cmd in commands(block.text):
            say = f"{block.where}: `{cmd.text}`"
            for file in cmd.reads_port_of:
                if file in waiting_for:
                    problems.append(f"{say}: reads {file} before the server wrote it "
                                    f"(wait: until [ -s {file} ]; do sleep 0.2; done)")
                elif not _made(file, made):
                    problems.append(f"{say}: reads {file}, which no block makes")
            if cmd.argv[:1] == ["until"] and "-s" in cmd.argv:
                waiting_for.discard(cmd.argv[cmd.argv.index("-s") + 1])
            if cmd.argv[:2] == ["mkdir", "-p"]:
                made.update(cmd.argv[2:])
            prog = program(cmd.argv)
            made.update(cmd.writes)
            if prog is None:
                continue
            if not exists(prog.key):
                problems.append(f"{say}: no module or script {prog.key!r}")
                continue
            if prog.launcher_args:
                flags, _ = _launcher_parser()
                problems += [f"{say}: torchrun has no flag {w.split('=')[0]}"
                             for w in prog.launcher_args
                             if w.startswith("-") and w.split("=")[0] not in flags]
            known = flags_of(prog.key)
            for name, value in _flag_values(prog.args):
                if name not in known:
                    problems.append(f"{say}: {prog.key} has no flag {name}")
                if value is None or value == "SUBST":
                    continue
                if name in OUTPUT_FLAGS:
                    made.add(value)
                    if name == "--results":
                        made.add(str(Path(value).with_suffix(".png")))
                elif (name in INPUT_FLAGS and not value.startswith("/")
                      and not (name == "--data-dir" and value in SHIPPED_DATA)
                      and not (ROOT / value).exists() and not _made(value, made)):
                    problems.append(f"{say}: reads {value}, which is neither in the "
                                    "repository nor made by an earlier block")
            if prog.key == "worker.main" and not any(n not in known for n, _ in
                                                      _flag_values(prog.args)):
                refused = worker_refusal(prog.args)
                if refused:
                    problems.append(f"{say}: the worker refuses it: {refused}")
            if prog.key == "worker.tasks.kge.hierarchy" and prog.args:
                made.add(prog.args[0])
            if _is_server(prog):
                port = dict(_flag_values(prog.args)).get("--port")
                if not is_readme and port == README_PORT:
                    problems.append(f"{say}: starts a server on {README_PORT}, the port of "
                                    "the README's server: use --port 0 --port-file FILE")
                if cmd.background and not cmd.writes:
                    problems.append(f"{say}: a server in the background with its log on "
                                    "the terminal: redirect it to a file")
                if not is_readme and readme_log in cmd.writes:
                    problems.append(f"{say}: writes {readme_log}, the README's server's "
                                    "log: name another")
                port_file = dict(_flag_values(prog.args)).get("--port-file")
                if cmd.background and port_file:
                    waiting_for.add(port_file)
    return problems
