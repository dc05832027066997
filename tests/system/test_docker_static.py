"""Dockerfile, .dockerignore, docker-compose.yml and docker-compose.gpu.yml, checked
without a Docker engine, so that an image that would not build (a COPY of a moved
path, a package the stub lacks) fails here.

What runs in the image must exist in the tree:
- every module a `python -c` runs (Dockerfile RUN steps, compose commands, health
  checks) imports here, with the attributes the code reads from it;
- every `python -m X` names a runnable module, every script (`worker/main.py`) exists,
  and the flags and HYBRIDPS_* variables given to our programs are ones they accept
  (parsed by their own parsers, torchrun's included);
- every path the Dockerfile COPYs, a compose file mounts or builds from exists, and
  .dockerignore excludes none of what the image needs (nor names a stale path);
- the stub the Dockerfile installs to fetch the dependencies has the packages
  pyproject.toml and setup.py expect.
`scripts/compose_check.sh` builds and runs the stack on a real engine (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib
import importlib.util
import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from hybridps.cli import ConfigError, add_dataclass_flags, from_namespace, parse_config, settings
from hybridps.security import ADMIN_TOKEN_ENV, AUTH_TOKEN_ENV
from tests.system.test_compose import COMPOSE, GPU, env_of, load
from tests.testing.helpers import REPO
from worker.launch import STOP_EXIT_ENV

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PYTHONS = re.compile(r"^(?:/opt/venv/bin/)?python(?:3(?:\.\d+)?)?$")
SEPARATORS = {"&&", "||", ";", "|", "(", ")", "&"}
SHELL_WORDS = {"if", "then", "else", "elif", "fi", "do", "done", "!", "exec"}
# Variables read directly, not through a setting (hybridps/security.py, worker/runtime/faults.py).
EXTRA_ENV = {AUTH_TOKEN_ENV, ADMIN_TOKEN_ENV, STOP_EXIT_ENV}  # read outside the configs


# -- reading the files ------------------------------------------------------------------

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped (as
    Docker does, a comment line inside a continuation is dropped too)."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and pending):
            continue
        if not line:
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        keyword, _, rest = whole.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation line"
    return out


def simple_commands(shell: str) -> Iterator[list[str]]:
    """The simple commands of a shell line (split at && || ; | and parentheses), with the
    shell's keywords in front stripped."""
    lexer = shlex.shlex(shell, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    for token in [*lexer, ";"]:
        if token in SEPARATORS or set(token) <= set("&|;()"):
            while words and words[0] in SHELL_WORDS:
                words.pop(0)
            if words:
                yield words
            words = []
        else:
            words.append(token)


def exec_form(args: str) -> list[str] | None:
    """CMD/ENTRYPOINT in JSON (exec) form, else None."""
    if not args.startswith("["):
        return None
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def dockerfile_commands() -> Iterator[tuple[str, list[str]]]:
    """(where, argv) of every command the Dockerfile runs (RUN, CMD, ENTRYPOINT)."""
    for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()):
        if keyword == "RUN":
            for argv in simple_commands(args):
                yield f"Dockerfile RUN {' '.join(argv)[:60]}", argv
        elif keyword in ("CMD", "ENTRYPOINT"):
            argv = exec_form(args)
            yield f"Dockerfile {keyword}", argv if argv is not None else shlex.split(args)


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Compose's `-f a -f b` for what our files use: mappings merge key by key, the
    override's lists and scalars replace (compose merges some lists; ours do not mix)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def compose_specs() -> dict[str, dict[str, Any]]:
    base = load(COMPOSE, {})
    return {"docker-compose.yml": base,
            "docker-compose.yml + docker-compose.gpu.yml": merged(base, load(GPU, {}))}


def compose_commands(spec: dict[str, Any]) -> Iterator[tuple[str, str, list[str]]]:
    """(service, what, argv) of each service's command and health check."""
    for name, svc in spec["services"].items():
        command = svc.get("command")
        if command is not None:
            yield name, "command", command if isinstance(command, list) else shlex.split(command)
        test = (svc.get("healthcheck") or {}).get("test")
        if isinstance(test, list) and test and test[0] == "CMD":
            yield name, "healthcheck", test[1:]
        elif isinstance(test, list) and test and test[0] == "CMD-SHELL":
            for argv in simple_commands(test[1]):
                yield name, "healthcheck", argv
        elif isinstance(test, str):
            for argv in simple_commands(test):
                yield name, "healthcheck", argv


# -- what a python invocation needs -----------------------------------------------------

def check_snippet(code: str, where: str) -> None:
    """`python -c CODE`: every module it imports imports here, and every attribute it reads
    off an imported name exists."""
    tree = ast.parse(code)
    names: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = importlib.import_module(alias.name)
                if alias.asname:
                    names[alias.asname] = module
                else:
                    top = alias.name.split(".")[0]
                    names[top] = importlib.import_module(top)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(
                    f"{node.module}.{alias.name}"), f"{where}: {node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in names:
            assert hasattr(names[node.value.id], node.attr), \
                f"{where}: {node.value.id}.{node.attr} does not exist"


def check_runnable_module(name: str, where: str) -> None:
    spec = importlib.util.find_spec(name)
    assert spec is not None, f"{where}: python -m {name}: no such module"
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        assert importlib.util.find_spec(f"{name}.__main__") is not None, \
            f"{where}: python -m {name}: the package has no __main__"


def parse_or_fail(parse: Any, where: str) -> Any:
    try:
        return parse()
    except SystemExit as exc:  # our parsers print one line and exit 2
        pytest.fail(f"{where}: refused its arguments (exit {exc.code}); see the captured "
                    "stderr")
    except ConfigError as exc:
        pytest.fail(f"{where}: {exc}")


def check_env_names(env: dict[str, str], cls: type, where: str) -> None:
    known = {s.env for s in settings(cls)} | EXTRA_ENV
    unknown = sorted(k for k in env if k.startswith("HYBRIDPS_") and k not in known)
    assert not unknown, f"{where}: {unknown} are not settings of {cls.__name__} (a typo is " \
                        "ignored silently)"


def check_program(argv: list[str], env: dict[str, str], where: str) -> None:
    """A command whose program is ours: the module or script exists and takes its
    arguments and HYBRIDPS_* variables."""
    from ps.admin import COMMANDS
    from ps.config import ServerConfig
    from worker.config.task_defaults import task_defaults
    from worker.config.train_config import TrainConfig

    def worker_script(script: str, args: list[str]) -> None:
        assert (REPO / script).is_file(), f"{where}: script {script} does not exist"
        assert script == "worker/main.py", f"{where}: unexpected script {script}"
        check_env_names(env, TrainConfig, where)
        parse_or_fail(lambda: parse_config(TrainConfig, args, environ=env,
                                           defaults=task_defaults), where)

    def torchrun(args: list[str]) -> None:
        from torch.distributed.run import get_args_parser

        ns = parse_or_fail(lambda: get_args_parser().parse_args(args), where)
        worker_script(ns.training_script, list(ns.training_script_args))

    if argv[0] == "torchrun":
        torchrun(argv[1:])
        return
    assert PYTHONS.match(argv[0]), f"{where}: runs {argv[0]}, not python or torchrun"
    if argv[1] == "-c":
        check_snippet(argv[2], where)
        return
    if argv[1] != "-m":
        worker_script(argv[1], argv[2:])
        return
    module, args = argv[2], argv[3:]
    check_runnable_module(module, where)
    if module == "ps":
        check_env_names(env, ServerConfig, where)
        parse_or_fail(lambda: parse_config(ServerConfig, args, environ=env), where)
    elif module == "ps.admin":
        cls = COMMANDS[args[0]][0]
        parser = argparse.ArgumentParser()
        add_dataclass_flags(parser, cls)
        ns = parse_or_fail(lambda: parser.parse_args(args[1:]), where)
        parse_or_fail(lambda: from_namespace(cls, ns, env), where)
    elif module in ("worker.launch", "torch.distributed.run"):
        torchrun(args)
    elif module not in ("pip", "venv", "ensurepip"):
        pytest.fail(f"{where}: python -m {module}: add how to check its arguments here")


def python_commands(argvs: Iterator[tuple[str, list[str]]]
                    ) -> Iterator[tuple[str, list[str]]]:
    for where, argv in argvs:
        if argv and (PYTHONS.match(argv[0]) or argv[0] == "torchrun"):
            yield where, argv


# -- the Dockerfile ---------------------------------------------------------------------

def test_dockerfile_runs_only_modules_that_exist() -> None:
    seen = []
    for where, argv in python_commands(dockerfile_commands()):
        if argv[1:2] == ["-m"] and argv[2] in ("pip", "venv"):
            continue
        env = {}  # the Dockerfile's CMD: the image's default, no compose environment
        check_program(argv, env, where)
        seen.append(argv[:3])
    assert ["python", "-m", "ps"] in seen  # the CMD
    assert any(a[1] == "-c" and "hybridps.native" in a[2] for a in seen), seen


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def setup_extensions() -> list[tuple[str, list[str]]]:
    """(module name, sources) of each Extension(...) in setup.py."""
    out = []
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Extension":
            name = ast.literal_eval(node.args[0])
            sources = next(ast.literal_eval(k.value) for k in node.keywords
                           if k.arg == "sources")
            out.append((name, sources))
    assert out, "setup.py declares no Extension: update this test"
    return out


def test_setup_py_extension_sources_exist() -> None:
    for name, sources in setup_extensions():
        for source in sources:
            assert (REPO / source).is_file(), f"setup.py: {name} source {source} is missing"
        package = name.rpartition(".")[0]
        assert (REPO / package.replace(".", "/") / "__init__.py").is_file(), package


def test_dependency_stub_has_the_packages_pyproject_and_setup_expect() -> None:
    stub = [args for keyword, args in dockerfile_instructions(DOCKERFILE.read_text())
            if keyword == "RUN" and any(argv[:3] == ["pip", "install", "."]
                                        for argv in simple_commands(args))]
    assert len(stub) == 1, "one RUN installs the project stub (`pip install .`)"
    made: set[str] = set()
    touched: set[str] = set()
    removed: set[str] = set()
    uninstalled: list[str] = []
    for argv in simple_commands(stub[0]):
        plain = [a for a in argv[1:] if not a.startswith("-")]
        if argv[0] == "mkdir":
            assert "-p" in argv, "mkdir -p: the parents too"
            for path in plain:
                parts = path.rstrip("/").split("/")
                made.update("/".join(parts[:n]) for n in range(1, len(parts) + 1))
        elif argv[0] == "touch":
            touched.update(plain)
        elif argv[0] == "rm":
            removed.update(p.rstrip("/") for p in plain)
        elif argv[:2] == ["pip", "uninstall"]:
            uninstalled += plain[1:]
    project = _pyproject()
    assert uninstalled == [project["project"]["name"]]
    assert project["project"]["readme"] in touched and project["project"]["readme"] in removed
    includes = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = [pattern.rstrip("*") for pattern in includes]
    for package in packages:
        assert package in made, f"the stub does not make package {package!r} ({includes})"
        assert f"{package}/__init__.py" in touched, f"{package}/__init__.py"
        assert package in removed, f"the stub's {package}/ is not removed after"
    for name, _ in setup_extensions():
        where = name.rpartition(".")[0].replace(".", "/")
        assert where in made, f"the stub does not make {where}/, where setup.py builds {name}"
        assert f"{where}/__init__.py" in touched, f"{where}/__init__.py"
    for path in made:  # nothing made that the project does not have (a stale path)
        assert (REPO / path).is_dir(), f"the stub makes {path}/, which the tree lacks"


def dockerignore_patterns() -> list[tuple[bool, str]]:
    out = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        out.append((negate, line.lstrip("!").strip("/")))
    return out


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """.dockerignore (Go filepath.Match plus `**`): a match also excludes what is below."""
    parts = []
    for part in pattern.split("/"):
        if part == "**":
            parts.append("(?:.*/)?")
            continue
        parts.append(fnmatch.translate(part).removeprefix("(?s:").removesuffix(")\\Z")
                     .replace(".*", "[^/]*") + "/")
    body = "".join(parts).removesuffix("/")
    body = body.replace("(?:.*/)?/", "(?:.*/)?")
    return re.compile(f"^{body}(?:/.*)?$", re.S)


def ignored(path: str, patterns: list[tuple[bool, str]]) -> bool:
    out = False
    for negate, pattern in patterns:
        if _pattern_regex(pattern).match(path):
            out = not negate
    return out


def tracked_files() -> list[str]:
    proc = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                          check=False, timeout=60)
    if proc.returncode != 0:
        pytest.skip("not a git checkout: cannot list the tracked files")
    return [p for p in proc.stdout.splitlines() if (REPO / p).exists()]


def test_dockerignore_matcher() -> None:
    pats = [(False, "**/__pycache__"), (False, "*.pt"), (False, "hybridps/native/*.so"),
            (False, ".git"), (False, "build")]
    assert ignored("ps/__pycache__/x.pyc", pats) and ignored("__pycache__/a", pats)
    assert ignored("a.pt", pats) and not ignored("ps/a.pt", pats)
    assert ignored("hybridps/native/_f.cpython-311.so", pats)
    assert not ignored("hybridps/native/__init__.py", pats)
    assert ignored(".git/HEAD", pats) and not ignored(".github/x", pats)
    assert ignored("build/lib/x", pats) and not ignored("ps/build.py", pats)


def test_dockerfile_copies_what_exists_and_dockerignore_keeps_it() -> None:
    patterns = dockerignore_patterns()
    for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()):
        if keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(args)
        if any(w.startswith("--from") for w in words):
            continue  # from another stage
        sources = [w for w in words if not w.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert source == "." or not ignored(source, patterns), \
                f"COPY {source}: excluded by .dockerignore"
    needed = [p for p in tracked_files()
              if p.split("/")[0] in ("ps", "worker", "hybridps", "proto")
              or p in ("pyproject.toml", "setup.py", "README.md")]
    assert "hybridps/native/fused_adam.c" in needed
    excluded = [p for p in needed if ignored(p, patterns)]
    assert not excluded, f".dockerignore excludes files the image needs: {excluded[:10]}"


def test_dockerignore_names_no_stale_path() -> None:
    """A pattern with a directory in it names a directory the tree has (the kernel's .so
    moved with it to hybridps/native)."""
    for _, pattern in dockerignore_patterns():
        head = pattern.rpartition("/")[0]
        if not head or "*" in head:
            continue
        assert (REPO / head).is_dir(), f".dockerignore: {pattern}: {head}/ does not exist"


def test_dockerfile_checks_the_kernel_of_the_package_it_lives_in() -> None:
    """The RUN that builds the kernels imports each module setup.py builds (by its full
    name, so a kernel that moved or failed to build stops the image build)."""
    snippets = [argv[2] for _, argv in python_commands(dockerfile_commands())
                if argv[1] == "-c"]
    for name, _ in setup_extensions():
        assert any("import" in code and name in code for code in snippets), (name, snippets)


# -- the compose files ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["docker-compose.yml",
                                  "docker-compose.yml + docker-compose.gpu.yml"])
def test_compose_runs_only_modules_and_flags_that_exist(name: str) -> None:
    spec = compose_specs()[name]
    ran = set()
    for service, what, argv in compose_commands(spec):
        env = env_of(spec["services"][service])
        check_program(argv, env, f"{name}: {service} {what}")
        ran.add((service, what))
    assert ran == {("ps", "command"), ("ps", "healthcheck"), ("worker", "command")}, ran


@pytest.mark.parametrize("name", ["docker-compose.yml",
                                  "docker-compose.yml + docker-compose.gpu.yml"])
def test_compose_paths_exist(name: str) -> None:
    spec = compose_specs()[name]
    named = set(spec.get("volumes") or {})
    for service, svc in spec["services"].items():
        build = svc.get("build")
        if build is not None:
            context = REPO / (build if isinstance(build, str) else build.get("context", "."))
            dockerfile = "Dockerfile" if isinstance(build, str) else build.get(
                "dockerfile", "Dockerfile")
            assert (context / dockerfile).is_file(), f"{service}: build {context}/{dockerfile}"
        for env_file in ([svc["env_file"]] if isinstance(svc.get("env_file"), str)
                         else svc.get("env_file") or []):
            assert (REPO / env_file).is_file(), f"{service}: env_file {env_file}"
        for volume in svc.get("volumes") or []:
            source = volume.get("source", "") if isinstance(volume, dict) \
                else volume.split(":")[0]
            if source.startswith((".", "/", "~")):
                assert source.startswith("./"), f"{service}: {volume}: only repo paths"
                assert (REPO / source).exists(), f"{service}: mounts {source}: missing"
            else:
                assert source in named, f"{service}: volume {source} is not declared"


def test_compose_files_name_only_repo_paths_that_exist() -> None:
    """Every ./path in the files, in comments too (the optional Prometheus service)."""
    for path in (COMPOSE, GPU):
        for rel in re.findall(r"(?<![\w.])\./([\w./-]+\w)", path.read_text()):
            assert (REPO / rel).exists(), f"{path.name}: ./{rel} does not exist"


@pytest.mark.parametrize("name", ["docker-compose.yml",
                                  "docker-compose.yml + docker-compose.gpu.yml"])
def test_compose_exit_codes_are_the_workers(name: str) -> None:
    """The worker is not in the server's PID namespace (the server's exit would kill
    it: 137), the server outlives the workers after the run, and both services end with
    the same launcher, so `up --exit-code-from worker` returns the job's result."""
    spec = compose_specs()[name]
    ps, worker = spec["services"]["ps"], spec["services"]["worker"]
    assert "pid" not in worker and "pid" not in ps
    assert worker["ipc"] == "service:ps"  # the shared-memory pushes (ps/core/maintenance.py)
    assert worker["command"][:3] == ["python", "-m", "worker.launch"]
    from ps.config import ServerConfig

    server = parse_config(ServerConfig, ps["command"][3:], environ=env_of(ps))
    assert server.exit_after_run and server.exit_after_run_delay_s >= 10
