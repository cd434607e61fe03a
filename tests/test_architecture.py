"""docs/ARCHITECTURE.md's module tables are the import order: every import inside the package
points further down them, inside folders too; the stage side and the driver side never import
each other; the cores, the formats, the engines and the model file never import zmq; and no class or function
outgrows the size a reader takes in at once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "skippy_zmq"
ROW = re.compile(r"^\| `([a-z0-9_/]+)` \|")
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60
SIZE_EXEMPT: dict[str, str] = {}
"""Classes and functions allowed past the limits, by dotted name, each with the reason splitting it would hurt.
A reason is owed: comments are never cut to fit a limit, and an entry that no longer exceeds it is stale."""
TESTED_WITH: dict[str, tuple[str, str]] = {
    "driver.generate": ("tests/test_cli.py", "`generate` is the command's library side: run end to end through it"),
    "driver.lanes": ("tests/driver/test_scheduler.py", "the scheduler's own table: its rules are the scheduler's"),
    "gateway.metrics": ("tests/gateway/test_http.py", "the metrics are what /metrics answers: read through the app"),
    "gateway.options": ("tests/gateway/test_server.py", "ServeOptions and the key and TLS files: read as serve starts"),
    "gateway.starter": ("tests/gateway/test_server.py", "startup is the server's first seconds: tested with them"),
    "gateway.state": ("tests/gateway/test_http.py", "health and the attached engine: what the routes answer"),
    "gateway.zmq_requests": ("tests/gateway/test_zmq_api.py", "frames parsed and answered: through the ROUTER in-process"),
    "model.catalog": ("tests/tokens/test_tokenizer.py", "the packaged model resolved and read: the tokenizer's tests"),
    "security.admission": ("tests/security/test_curve.py", "ZAP decisions with the keys and sockets they decide for"),
    "security.keys": ("tests/security/test_curve.py", "key files made and read for the CURVE sockets that use them"),
    "stage.final": ("tests/stage/test_core.py", "the final stage's answers: through the core that sends them"),
    "stage.sessions": ("tests/stage/test_core.py", "the session table's rules: through the core that applies them"),
    "wire.replies": ("tests/wire/test_messages.py", "replies beside messages: golden bytes, round trips, hostile"),
    "wire.request_api": ("tests/test_client.py", "the request API's frames: between the client and a gateway"),
    "wire.trace": ("tests/wire/test_messages.py", "trace records ride in messages: tested in their frames"),
}
"""Modules without a test module of their own (tests/<folder>/test_<module>.py), each with the one that tests
them and why there."""


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
    """Dotted module names in the documented order: each folder row expands to its own table."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    order: list[str] = []
    for name in _table_after(text, "## Modules"):
        if name.endswith("/"):
            folder = name.removesuffix("/")
            order += [f"{folder}.{n}" for n in _table_after(text, f"`{name}` in the same top-down order")]
        else:
            order.append(name)
    return order


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _imports(path: Path) -> set[str]:
    """Package modules `path` imports, for type hints too (`from skippy_zmq import x` counts as module x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "skippy_zmq":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("skippy_zmq."):
            found.add(node.module.removeprefix("skippy_zmq."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("skippy_zmq.") for a in node.names if a.name.startswith("skippy_zmq.")}
    return found


def _modules() -> list[Path]:
    # Package __init__ files are facades (the top one exports Client): only modules are layered.
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"]


def test_every_module_is_in_the_tables_and_every_row_is_a_module() -> None:
    order = documented_order()
    modules = {_module_name(p) for p in _modules()}
    assert sorted(modules - set(order)) == []
    assert sorted(set(order) - modules) == []
    assert len(order) == len(set(order))


def test_every_import_points_down_the_documented_tables() -> None:
    order = documented_order()
    rank = {name: index for index, name in enumerate(order)}
    upward = []
    for path in _modules():
        module = _module_name(path)
        for imported in _imports(path):
            if imported in rank and rank[imported] <= rank[module]:
                upward.append(f"{module} imports {imported}")
    assert upward == []


def test_the_stage_side_and_the_driver_side_never_import_each_other() -> None:
    forbidden = {"stage": ("driver.", "gateway."), "driver": ("stage.",)}
    crossings = []
    for path in _modules():
        module = _module_name(path)
        banned = forbidden.get(module.split(".")[0], ())
        crossings += [f"{module} imports {i}" for i in _imports(path) if i.startswith(banned)]
    assert crossings == []


def test_cores_formats_engines_and_the_model_never_import_zmq() -> None:
    cores = ["config", "stage/core", "stage/forwarding", "driver/scheduler", "driver/recovery", "driver/watch", "driver/generation",
             "gateway/openai_api", "gateway/chat", "gateway/zmq_requests", "security/admission",
             "launch/supervisor", "launch/planner"]
    paths = [PACKAGE / f"{name}.py" for name in cores]
    for folder in ("wire", "runtime", "float32", "compute", "tokens", "model", "testing"):
        paths += sorted((PACKAGE / folder).glob("*.py"))
    # pyzmq's Z85 codec is a text encoding of keys, not a socket: admission decodes keys with it.
    offenders = [str(p.relative_to(PACKAGE)) for p in paths
                 if any((i == "zmq" or i.startswith("zmq.")) and i != "zmq.utils.z85" for i in _raw_imports(p))]
    assert offenders == []


def _raw_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from zmq import x` counts as zmq.x
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def oversized(text: str, module: str) -> list[str]:
    """Classes over MAX_CLASS_LINES and functions over MAX_FUNCTION_LINES in one module's source."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        lines = (node.end_lineno or node.lineno) - node.lineno + 1  # decorators (click options) not counted
        limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
        name = f"{module}.{node.name}"
        if lines > limit and name not in SIZE_EXEMPT:
            found.append(f"{name}: {lines} lines (limit {limit})")
    return found


def _sizes() -> dict[str, tuple[int, int]]:
    """Lines and limit of every class and function in the package, by dotted name."""
    sizes = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                sizes[f"{_module_name(path)}.{node.name}"] = ((node.end_lineno or node.lineno) - node.lineno + 1, limit)
    return sizes


def test_no_class_or_function_is_oversized() -> None:
    assert [entry for path in _modules() for entry in oversized(path.read_text(), _module_name(path))] == []


def test_every_size_exemption_names_a_reason_and_is_still_needed() -> None:
    sizes = _sizes()
    stale = [name for name in SIZE_EXEMPT if name not in sizes or sizes[name][0] <= sizes[name][1]]
    assert stale == []
    assert all(len(reason.split()) >= 5 for reason in SIZE_EXEMPT.values())


def _test_module(module: str) -> Path:
    folder, _, name = module.rpartition(".")
    return REPO / "tests" / folder.replace(".", "/") / f"test_{name}.py"


def test_every_module_has_a_test_module_or_names_the_one_that_tests_it() -> None:
    modules = [_module_name(path) for path in _modules()]
    missing = [m for m in modules if not _test_module(m).exists() and m not in TESTED_WITH]
    assert missing == []
    stale = [m for m in TESTED_WITH if m not in modules or _test_module(m).exists()]
    assert stale == []
    assert [m for m, (test, _) in TESTED_WITH.items() if not (REPO / test).exists()] == []


def test_every_test_folder_mirrors_a_package_folder() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    tests = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert sorted(tests - folders - {"tools"}) == []


def test_the_size_check_sees_one_line_too_many() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 2))
    fits = f"@staticmethod\ndef f() -> None:\n    x = 0\n{body}\n"
    assert oversized(fits, "probe") == []
    assert oversized(fits + "    return None\n", "probe") == [f"probe.f: {MAX_FUNCTION_LINES + 1} lines (limit 60)"]
