"""The import boundaries of app/ and data_tools/, read from every module's `ast` (no imports run).

- DeepSpeed is imported only in app/runtime/ (the accelerator, the process group, the config,
  its ops, the engine, zero.Init) and app/checkpoint/ (its checkpoint files); the rest of the
  app, the training loop included, sees an `nn.Module`.
- data_tools/ never imports app/: the data pipeline's tools stand alone.
- app/data/ imports nothing of app/ but itself and app.runtime.device (the core count): the
  data path runs without a process group, an engine or a checkpoint.
- No import cycle among the modules of app/ and data_tools/: the layers of docs/design.md ("Where
  things live") hold only while every import points down.
- No module imports a command module (those app/__main__.py dispatches to), which only
  app/__main__.py does: a library function kept in a command is what made the last cycle.

Imports inside functions count: a lazy import is still an import.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEEPSPEED_HOMES = ("app/runtime/", "app/checkpoint/")


def modules() -> list[Path]:
    return sorted(p for top in ("app", "data_tools") for p in (REPO / top).rglob("*.py"))


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth; a from-import
    names each imported name's module too (`from app.runtime import dist` -> app.runtime.dist)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package up
                parent = package[:len(package) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(rule, paths: list[Path]) -> list[str]:
    """'file:line: module' for every import `rule(relative path, module)` refuses."""
    out = []
    for path in paths:
        rel = path.relative_to(REPO).as_posix()
        out += [f"{rel}:{line}: imports {name}" for line, name in imports(path)
                if not rule(rel, name)]
    return sorted(set(out))


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def deepspeed_rule(rel: str, name: str) -> bool:
    return not _within(name, "deepspeed") or rel.startswith(DEEPSPEED_HOMES)


def data_tools_rule(rel: str, name: str) -> bool:
    return not rel.startswith("data_tools/") or not _within(name, "app")


def data_rule(rel: str, name: str) -> bool:
    if not rel.startswith("app/data/") or not _within(name, "app") or name == "app":
        return True
    return _within(name, "app.data") or _within(name, "app.runtime.device")


def command_modules() -> set[str]:
    """The modules app/__main__.py dispatches to (its COMMANDS table, read, not imported)."""
    for node in ast.parse((REPO / "app" / "__main__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMANDS"
                                                for t in node.targets):
            return {module for module, _ in ast.literal_eval(node.value).values()}
    return set()


def command_rule(rel: str, name: str) -> bool:
    return rel == "app/__main__.py" or not any(_within(name, c) for c in command_modules())


def module_name(path: Path) -> str:
    """app/checkpoint/store.py -> app.checkpoint.store; a package's __init__ -> the package."""
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def import_graph(paths: list[Path]) -> dict[str, dict[str, str]]:
    """module -> {module it imports: 'file:line' of the first such import}, among `paths`' own
    modules (a name resolves to the longest module it starts with: `app.models.build.build_model` ->
    app.models.build). A module's own packages are no edge: Python imports them before it anyway."""
    names = {module_name(p): p for p in paths}
    graph: dict[str, dict[str, str]] = {m: {} for m in names}
    for module, path in names.items():
        for line, name in imports(path):
            while name and name not in names:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                graph[module].setdefault(name, f"{path.relative_to(REPO).as_posix()}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every
    module in one imports every other, through the rest."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_report(paths: list[Path]) -> list[str]:
    """One entry per cycle: its modules, then each import among them ('file:line: imports m')."""
    graph = import_graph(paths)
    return [" <-> ".join(c) + "".join(f"\n  {graph[a][b]}: imports {b}" for a in c
                                      for b in sorted(graph[a]) if b in c)
            for c in cycles(graph)]


def test_no_import_cycle():
    found = cycle_report(modules())
    assert not found, ("import cycles (lazy imports included); cut one import of each, moving "
                       "what it needs to a lower module:\n" + "\n".join(found))


def test_the_command_modules_are_read_from_the_dispatcher():
    """The rule below would pass on an empty list: it must hold the commands __main__ names."""
    assert {"app.train", "app.export", "app.checkpoint.convert", "app.sweep.command"} <= \
        command_modules()


@pytest.mark.parametrize("rule", [deepspeed_rule, data_tools_rule, data_rule, command_rule],
                         ids=lambda r: r.__name__)
def test_import_boundaries_hold(rule):
    bad = violations(rule, modules())
    assert not bad, "imports across a boundary (tests/test_layout.py says which):\n" + \
        "\n".join(bad)


def test_the_walk_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The rules above would pass on a walk that misses imports: it must see lazy ones, aliased
    ones, from-imports and relative ones, with their lines."""
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    module = tmp_path / "app" / "data" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text("import os\n"
                      "def f():\n"
                      "    import deepspeed.comm as dist\n"
                      "    from deepspeed import zero\n"
                      "from ..runtime import engine\n"
                      "from . import order\n")
    assert violations(deepspeed_rule, [module]) == [
        "app/data/x.py:3: imports deepspeed.comm", "app/data/x.py:4: imports deepspeed",
        "app/data/x.py:4: imports deepspeed.zero"]
    assert violations(data_rule, [module]) == [
        "app/data/x.py:5: imports app.runtime", "app/data/x.py:5: imports app.runtime.engine"]
    assert len(modules()) == 1


def test_the_cycle_check_sees_a_lazy_cycle_and_names_its_imports(tmp_path, monkeypatch):
    """The cycle rule would pass on a graph that misses edges: a cycle closed by a function's
    import is found, named by its imports, and an import of the module's own package is none."""
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    pkg = tmp_path / "app"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from app import b\n")
    (pkg / "b.py").write_text("import app\ndef f():\n    from app.c import g\n")
    (pkg / "c.py").write_text("from .a import x\n")
    (pkg / "d.py").write_text("from app import a\n")
    assert cycle_report(modules()) == [
        "app.a <-> app.b <-> app.c\n  app/a.py:1: imports app.b\n  app/b.py:3: imports app.c"
        "\n  app/c.py:1: imports app.a"]
    (pkg / "c.py").write_text("import os\n")
    assert cycle_report(modules()) == []


def test_the_tests_import_their_helpers_as_one_module():
    """`from helpers import ...` loads tests/helpers.py a second time, as another module (tests/
    is on sys.path too): with its own warm process, ~9 CPU-s more in a worker that already has
    one (tests/README.md, "The warm process")."""
    bare = {"helpers", "zygote", "conftest"}
    found = [f"{path.relative_to(REPO)}:{line}: imports {name}"
             for path in sorted((REPO / "tests").glob("*.py"))
             for line, name in imports(path) if name.split(".")[0] in bare]
    assert not found, "import them as tests.helpers, tests.zygote:\n" + "\n".join(found)
