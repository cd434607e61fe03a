"""The docs' code stays true: every skippy_zmq name README's Python examples import exists, and
every module path the docs name in backticks is a module of the package."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_examples_import_names_that_exist() -> None:
    imports = [
        (match.group(1), name.strip())
        for block in _python_blocks((REPO / "README.md").read_text())
        for match in re.finditer(r"^\s*from (skippy_zmq[\w.]*) import ([\w, ]+)$", block, re.M)
        for name in match.group(2).split(",")
    ]
    assert imports, "README shows no example importing skippy_zmq"
    missing = [f"{module}.{name}" for module, name in imports if not hasattr(importlib.import_module(module), name)]
    assert missing == []


@pytest.mark.parametrize("doc", ["README.md", "docs/ARCHITECTURE.md", "docs/PROTOCOL.md", "docs/BENCHMARKS.md"])
def test_source_paths_the_docs_name_exist(doc: str) -> None:
    named = set(re.findall(r"\b(skippy_zmq/[\w/]+\.py|tests/[\w/]+\.py|tools/[\w/]+\.(?:py|sh))\b",
                           (REPO / doc).read_text()))
    assert sorted(path for path in named if not (REPO / path).exists()) == []
