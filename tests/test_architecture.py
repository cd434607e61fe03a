"""docs/ARCHITECTURE.md's module tables are the import order: every import inside the package
points further down them, and the format and runtime layers never import zmq."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "skippy_zmq"
ROW = re.compile(r"^\| `([a-z_/]+)` \|")


def _table_after(text: str, heading: str) -> list[str]:
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if ROW.match(line))
    names = []
    for line in lines[start:]:
        match = ROW.match(line)
        if not match:
            break
        names.append(match.group(1))
    return names


def documented_order() -> list[str]:
    """Dotted module names (or package prefixes ending in '.') in the documented order."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    order: list[str] = []
    for name in _table_after(text, "## Modules"):
        if name == "runtime/":
            order += [f"runtime.{n}" for n in _table_after(text, "`runtime/` in the same top-down order")]
        else:
            order.append(name.replace("/", "."))
    return order


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _entry(module: str, order: list[str]) -> int:
    for index, name in enumerate(order):
        if module == name or (name.endswith(".") and (module + ".").startswith(name)):
            return index
    raise AssertionError(f"skippy_zmq.{module} is missing from docs/ARCHITECTURE.md's module tables")


def _runtime_nodes(path: Path) -> list[ast.AST]:
    """Every node but those under `if TYPE_CHECKING:` (type hints only, never imported)."""
    tree = ast.parse(path.read_text())
    hidden = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    return [node for node in ast.walk(tree) if id(node) not in hidden]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in _runtime_nodes(path):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("skippy_zmq."):
            found.add(node.module.removeprefix("skippy_zmq."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("skippy_zmq.") for a in node.names if a.name.startswith("skippy_zmq.")}
    return found


def _modules() -> list[Path]:
    # Package __init__ files are facades (the top one exports Client): only modules are layered.
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"]


def test_every_import_points_down_the_documented_tables() -> None:
    order = documented_order()
    upward = []
    for path in _modules():
        module = _module_name(path)
        here = _entry(module, order)
        for imported in _imports(path):
            there = _entry(imported, order)
            same_package = order[here].endswith(".") and here == there
            if there <= here and not same_package:
                upward.append(f"{module} imports {imported}")
    assert upward == []


def test_formats_and_the_runtime_never_import_zmq() -> None:
    quiet = ["config", "frames", "wire", "codecs", "stage_core", "scheduler", "session", "openai_api", "chat"]
    paths = [PACKAGE / f"{name}.py" for name in quiet] + sorted((PACKAGE / "runtime").glob("*.py"))
    offenders = [p.name for p in paths if any(i == "zmq" or i.startswith("zmq.") for i in _raw_imports(p))]
    assert offenders == []


def _raw_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found
