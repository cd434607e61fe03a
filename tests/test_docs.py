"""The docs' code stays true: every skippy_zmq name README's Python examples import exists, every
module path the docs name is a file of the repository, and every section the repository cites by its
heading is a heading of that document (or names the commit it was read at)."""

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


DOCS = ["README.md", "docs/ARCHITECTURE.md", "docs/PROTOCOL.md", "docs/BENCHMARKS.md", "docs/DEPLOY.md", "docs/CODECS.md"]
# `BENCHMARKS.md, "Huge pages"` or `ARCHITECTURE.md "Kernels"`: a document, then a quoted heading (or its start)
CITATION = re.compile(r"\b(BENCHMARKS|ARCHITECTURE|DEPLOY|CODECS)(?:\.md)?(?P<commit> at commit [0-9a-f]{7,})?,?\s+\(?\"([^\"]+)\"")


def _headings(doc: str) -> list[str]:
    return [h.strip() for h in re.findall(r"^#+ (.*)$", (REPO / "docs" / f"{doc}.md").read_text(), re.M)]


def _citations(path: Path) -> list[tuple[str, str, bool]]:
    """(document, quoted heading, whether a commit is named) for each citation in one file, lines joined."""
    text = re.sub(r"\s*\n\s*(#\s*)?", " ", path.read_text())  # a citation may break across lines or comments
    return [(m.group(1), m.group(3), m.group("commit") is not None) for m in CITATION.finditer(text)]


def test_every_cited_section_is_a_heading_of_its_document() -> None:
    files = [p for p in REPO.glob("**/*") if p.suffix in (".py", ".md", ".sh", ".toml", ".yml")
             and not any(part.startswith(".") for part in p.relative_to(REPO).parts) and p.is_file()]
    cited = [(p, doc, heading) for p in files for doc, heading, at_commit in _citations(p) if not at_commit]
    assert len(cited) > 20  # the pattern still finds the repository's citations
    headings = {doc: _headings(doc) for doc in {doc for _, doc, _ in cited}}
    unknown = [f"{p.relative_to(REPO)}: {doc} \"{heading}\"" for p, doc, heading in cited
               if not any(h == heading or h.startswith(heading) for h in headings[doc])]
    assert unknown == []


@pytest.mark.parametrize("doc", DOCS)
def test_source_paths_the_docs_name_exist(doc: str) -> None:
    named = set(re.findall(r"\b(skippy_zmq/[\w/]+\.py|tests/[\w/]+\.py|tools/[\w/]+\.(?:py|sh))\b",
                           (REPO / doc).read_text()))
    assert sorted(path for path in named if not (REPO / path).exists()) == []
