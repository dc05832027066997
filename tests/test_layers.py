"""The layers point one way: worker -> hybridps <- ps (docs/architecture.md), and none of
them imports tests/ or the script folders (bench/, campaigns/, fuzz/, gpu_check/: what only
tests, benchmarks, fault campaigns, fuzzers and the GPU check use lives there).

Every import statement of every module is read with `ast` (including imports inside
functions and under TYPE_CHECKING), so a lazy import cannot hide a wrong edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("worker", "ps", "hybridps")
# package -> the top-level packages of this project it must never import
# The script folders are no packages: a script's folder is sys.path[0], so its modules are
# imported by their file names (`from harness import Server`); both kinds of name are listed.
SCRIPT_FOLDERS = ("bench", "campaigns", "fuzz", "gpu_check")
_NOT_PRODUCT = {"tests", "examples", *SCRIPT_FOLDERS,
                *(p.stem for folder in SCRIPT_FOLDERS for p in (ROOT / folder).glob("*.py"))}
FORBIDDEN = {"worker": {"ps", *_NOT_PRODUCT}, "ps": {"worker", *_NOT_PRODUCT},
             "hybridps": {"worker", "ps", *_NOT_PRODUCT}}


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


def test_the_script_folders_are_listed() -> None:
    """Every folder of scripts beside the packages is in SCRIPT_FOLDERS (a new one is not
    importable by the product unnoticed), and each module name is unique among them."""
    script_dirs = {p.parent.name for p in ROOT.glob("*/*.py")
                   if p.parent.name not in (*PACKAGES, "tests", "scripts", "build")
                   and not p.parent.name.startswith(".")
                   and not (p.parent / "__init__.py").exists()}
    assert script_dirs <= set(SCRIPT_FOLDERS), sorted(script_dirs - set(SCRIPT_FOLDERS))
    assert {"harness", "campaign_tools", "fuzz_messages", "gpu_common"} <= _NOT_PRODUCT
    stems = [p.stem for folder in SCRIPT_FOLDERS for p in (ROOT / folder).glob("*.py")]
    assert len(stems) == len(set(stems)), sorted(s for s in stems if stems.count(s) > 1)


def test_the_scan_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "def f():\n    from ps.core import ShardCore\n    import worker.train.trainer\n")
    assert _imported(source) == [(2, "ps"), (3, "worker")]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (absolute and relative, at any depth of the
    file: in functions and under TYPE_CHECKING too). `from pkg import name` counts as an
    import of pkg.name when that is a module, else of pkg."""
    paths = {_module_name(p): p for package in PACKAGES for p in _modules(package)}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        edges = set()
        for target in targets:
            while target and target not in paths:  # pkg.mod.attr -> pkg.mod
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (TYPE_CHECKING imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_type_checking_imports() -> None:
    graph = import_graph()
    # a TYPE_CHECKING import
    assert "worker.updates.source" in graph["worker.checkpoint.source"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


# -- inside the server: ps/core (transport-free) <- ps/edge (grpc) <- ps's entry points ----

# what a transport-free module must not reach: gRPC and its services, the generated
# messages and protobuf (a message belongs to the edge that converts it)
TRANSPORT = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "hybridps.v1")
ENTRY = ("ps.__main__", "ps.admin", "ps.config")
# room -> the modules of ps it must never import (prefixes)
PS_ROOMS = {"ps.core": ("ps.edge", *ENTRY), "ps.edge": ("ps.__main__", "ps.admin")}


def _absolute_imports(path: Path) -> set[str]:
    """The dotted names every absolute import of the file names (`from a.b import c`:
    a.b and a.b.c), at any depth of the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def reached(start: str, graph: dict[str, set[str]], imports: dict[str, set[str]],
            forbidden: tuple[str, ...]) -> list[str]:
    """'a -> b -> c imports X' for each forbidden X that `start` reaches through the
    project modules it imports, directly or through others (the transitive closure)."""
    paths = {start: [start]}
    queue = [start]
    found: list[str] = []
    while queue:
        module = queue.pop(0)
        found += [f"{' -> '.join(paths[module])} imports {name}"
                  for name in sorted(imports.get(module, ())) if _within(name, forbidden)]
        for nxt in sorted(graph.get(module, ())):
            if nxt not in paths:
                paths[nxt] = [*paths[module], nxt]
                queue.append(nxt)
    return found


def _ps_core_modules() -> list[str]:
    return [_module_name(p) for p in _modules("ps") if _module_name(p).startswith("ps.core")]


def test_ps_core_reaches_no_transport() -> None:
    graph = import_graph()
    imports = {_module_name(p): _absolute_imports(p)
               for package in PACKAGES for p in _modules(package)}
    core = _ps_core_modules()
    assert "ps.core.store" in core and "ps.core.shard_core" in core
    wrong = [line for module in core for line in reached(module, graph, imports, TRANSPORT)]
    assert not wrong, "\n".join(wrong)


def test_ps_rooms_point_one_way() -> None:
    graph = import_graph()
    wrong = [f"{module} imports {target}" for module, targets in graph.items()
             for room, banned in PS_ROOMS.items() if _within(module, (room,))
             for target in sorted(targets) if _within(target, banned)]
    assert not wrong, "\n".join(wrong)


def test_the_closure_check_sees_an_import_through_another_module() -> None:
    graph = {"ps.core.a": {"hybridps.b"}, "hybridps.b": {"hybridps.c"}, "hybridps.c": set()}
    imports = {"ps.core.a": {"torch"}, "hybridps.c": {"grpc", "grpc.aio"}}
    assert reached("ps.core.a", graph, imports, TRANSPORT) == [
        "ps.core.a -> hybridps.b -> hybridps.c imports grpc",
        "ps.core.a -> hybridps.b -> hybridps.c imports grpc.aio"]
    assert reached("ps.core.a", graph, {"hybridps.c": {"grpcio_tools"}}, TRANSPORT) == []


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_importing_ps_core_loads_no_transport() -> None:
    """What the static scan cannot see (a third-party package that imports grpc): import
    every core module in a fresh interpreter and look at what got loaded."""
    code = ("import importlib, sys\n"
            f"for m in {_ps_core_modules()!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if any(m == p or m.startswith(p + '.') "
            f"for p in {TRANSPORT!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def status_code_uses(paths: list[Path]) -> list[str]:
    """file:line of every `StatusCode` named in `paths`."""
    return [f"{path.relative_to(ROOT)}:{node.lineno}" for path in paths
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Attribute) and node.attr == "StatusCode"]


def test_status_codes_come_from_one_place() -> None:
    """The servicers and the interceptor end calls with status_for's code: only
    ps/edge/status.py names a grpc.StatusCode (the client side, ps/admin.py, reads them)."""
    server = [p for p in _modules("ps") if p.parent.name in ("core", "edge")]
    status = ROOT / "ps" / "edge" / "status.py"
    assert status in server and status_code_uses([status])
    wrong = status_code_uses([p for p in server if p != status])
    assert not wrong, "a status code outside ps/edge/status.py:\n" + "\n".join(wrong)


# worker's rooms in the order of the data flow (docs/architecture.md): a room imports only
# rooms before it; the commands at worker's top (main, launch, export, plan) import any room
# and no room imports them.
WORKER_ROOMS = ("config", "runtime", "embedding", "dense", "tasks", "data", "updates", "sync",
                "report", "checkpoint", "train")
WORKER_COMMANDS = {"worker.main", "worker.launch", "worker.export", "worker.plan"}


def worker_room(module: str) -> str:
    """The room of a worker module ("" for worker's top: the package and its commands)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WORKER_ROOMS else ""


def room_order_problems(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        if not module.startswith("worker."):
            continue
        room = worker_room(module)
        for target in sorted(t for t in targets if t.startswith("worker.")):
            to = worker_room(target)
            if room and not to:
                problems.append(f"{module} (room {room}) imports {target}, a command")
            elif room and to != room and WORKER_ROOMS.index(to) > WORKER_ROOMS.index(room):
                problems.append(f"{module} (room {room}) imports {target} of the later room {to}")
    return problems


def test_worker_rooms_import_only_rooms_before_them() -> None:
    problems = room_order_problems(import_graph())
    assert not problems, "\n".join(problems)


def test_the_room_check_sees_a_back_edge_and_an_import_of_a_command() -> None:
    assert room_order_problems({"worker.tasks.base": {"worker.embedding.sharded"}}) == []
    assert room_order_problems({"worker.embedding.sharded": {"worker.train.trainer"}}) == [
        "worker.embedding.sharded (room embedding) imports worker.train.trainer of the later room "
        "train"]
    assert room_order_problems({"worker.sync.client": {"worker.launch"}}) == [
        "worker.sync.client (room sync) imports worker.launch, a command"]


def test_worker_top_is_its_commands_and_its_rooms() -> None:
    top = {p.stem for p in (ROOT / "worker").glob("*.py")}
    assert top == {"__init__"} | {c.rpartition(".")[2] for c in WORKER_COMMANDS}
    rooms = {p.parent.name for p in (ROOT / "worker").glob("*/__init__.py")}
    assert rooms == set(WORKER_ROOMS)
    for room in WORKER_ROOMS:  # each room says what it holds and what it may import
        doc = ast.get_docstring(ast.parse((ROOT / "worker" / room / "__init__.py").read_text()))
        assert doc and ("May import" in doc or "Imports no other room" in doc), room


# The folders of tests/ that are no package's room: whole-system runs, the docs, helpers.
TEST_ONLY_FOLDERS = {"system", "docs", "testing"}


def test_tests_mirror_the_packages() -> None:
    """Every test lives in the folder of the room it tests (tests/worker/embedding/ for
    worker/embedding/), or in system/, docs/, testing/; only this file and the split's own
    check sit at the top; tests/testing/ holds helpers, no tests."""
    tests = ROOT / "tests"
    top = {p.name for p in tests.glob("test_*.py")}
    assert top == {"test_layers.py", "test_test_kinds.py"}, sorted(top)
    for folder in sorted(p for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        rel = folder.relative_to(tests)
        assert (folder / "__init__.py").exists(), f"tests/{rel} has no __init__.py"
        if rel.parts[0] in TEST_ONLY_FOLDERS:
            assert len(rel.parts) == 1, f"tests/{rel}: system/, docs/, testing/ are flat"
            continue
        assert (ROOT / rel / "__init__.py").exists(), f"tests/{rel} mirrors no package {rel}"
    assert not list((tests / "testing").glob("test_*.py"))
