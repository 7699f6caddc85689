"""The import boundaries of app/ and data_tools/, read from every module's `ast` (no imports run).

- DeepSpeed is imported only in app/runtime/ (the accelerator, the process group, the config,
  its ops, the engine, zero.Init) and app/checkpoint/ (its checkpoint files); the rest of the
  app, the training loop included, sees an `nn.Module`.
- data_tools/ never imports app/: the data pipeline's tools stand alone.
- app/data/ imports nothing of app/ but itself and app.runtime.device (the core count): the
  data path runs without a process group, an engine or a checkpoint.

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


@pytest.mark.parametrize("rule", [deepspeed_rule, data_tools_rule, data_rule],
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
