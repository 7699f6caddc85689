"""The docs name the code as it is: docs/design.md's module map lists every module of app/ and
data_tools/ by its path, and no doc names a module path, a dotted module or a module's top-level
name that does not exist. Files are read, nothing is imported: a module moved or added without
its row fails here in milliseconds."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
PACKAGES = ("app", "data_tools")
PATH = re.compile(r"(?<![\w/.])(?:app|data_tools)/[\w/]*\.py(?!\w)")
DOTTED = re.compile(r"(?<![\w/.])(?:app|data_tools)(?:\.\w+)+")


def modules() -> list[str]:
    """Every module of the two packages, as a path from the repository root."""
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts and p.name not in ("__init__.py", "__main__.py"))


def unnamed(text: str, paths: list[str]) -> list[str]:
    """The paths `text` does not name as a whole path (not inside a longer one)."""
    return [p for p in paths if not re.search(r"(?<![\w/.])" + re.escape(p) + r"(?!\w)", text)]


def top_level_names(module: Path) -> set[str]:
    """What a module defines or imports at its top level (read, not imported)."""
    names = set()
    for node in ast.parse(module.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def dotted_name_exists(name: str) -> bool:
    """`app.data.loader.BatchLayout.pack`: packages, then a module, then a name it defines at
    its top level (what follows that, an attribute of it, is not checked)."""
    here, parts = ROOT, name.split(".")
    for i, part in enumerate(parts):
        if (here / part / "__init__.py").is_file():
            here = here / part
        elif (here / f"{part}.py").is_file():
            rest = parts[i + 1:]
            return not rest or rest[0] in top_level_names(here / f"{part}.py")
        else:
            return False
    return True


def dangling(text: str) -> list[str]:
    """Module paths and dotted names in `text` that name nothing in the repository."""
    paths = [p for p in PATH.findall(text) if not (ROOT / p).is_file()]
    names = [n.rstrip(".") for n in DOTTED.findall(text)]
    return paths + [n for n in names if not dotted_name_exists(n)]


def test_design_names_every_module_by_path():
    missing = unnamed(DESIGN.read_text(encoding="utf-8"), modules())
    assert not missing, f"docs/design.md's module map lacks: {', '.join(missing)}"


def test_docs_name_no_module_that_does_not_exist():
    stale = {str(doc.relative_to(ROOT)): dangling(doc.read_text(encoding="utf-8"))
             for doc in DOCS}
    assert not {doc: names for doc, names in stale.items() if names}


def test_the_checks_tell_names_apart():
    text = ("see `app/data/loader.py`, app.data.loader.BatchLayout.pack and app.data, "
            "not xapp/data/order.py")
    assert unnamed(text, ["app/data/loader.py", "app/data/order.py"]) == ["app/data/order.py"]
    assert dangling(text) == []
    assert dangling("app/checkpoint.py, app.checkpoint.load, app.nothing, app.data.loader._nope"
                    ) == ["app/checkpoint.py", "app.checkpoint.load", "app.nothing",
                          "app.data.loader._nope"]
