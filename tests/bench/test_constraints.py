"""`bench constraints` on a tiny model: every figure is measured, the table shows each, and the
decode loop it times is a real final stage answering constrained sessions."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from skippy_zmq.bench.constraints import (
    SCHEMAS,
    STEP_SCHEMA,
    ConstraintBench,
    DecodeLoop,
    constraint_table,
    run_constraint_bench,
)
from skippy_zmq.bench.report import Report
from skippy_zmq.tokens.constraint import Constraint

pytest.importorskip("llguidance")


def test_every_figure_is_measured_and_shown(tiny_gemma3_path: Path) -> None:
    out = io.StringIO()
    report = Report("constraints", out)
    options = ConstraintBench(model=tiny_gemma3_path, sessions=2, steps=2, rounds=1, threads=1)
    trie_s, compiles, steps = run_constraint_bench(options, report, lambda _: None)
    assert trie_s > 0 and [name for name, _, _ in compiles] == list(SCHEMAS)
    assert all(first > 0 and again >= 0 for _, first, again in compiles)
    assert steps.sessions == 2 and steps.plain_s > 0 and steps.constrained_s > 0
    table = constraint_table(trie_s, compiles, steps)
    assert len(table.splitlines()) == 2 + 1 + len(SCHEMAS) + 3 and "constraint overhead" in table
    (row,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert row["sessions"] == 2 and set(row["compile_ms"]) == set(SCHEMAS)


def test_the_loop_runs_constrained_sessions_through_a_real_final_stage(tiny_gemma3_path: Path) -> None:
    from skippy_zmq.tokens.grammar import GrammarBook
    from skippy_zmq.tokens.tokenizer import eog_ids_of

    book = GrammarBook(tiny_gemma3_path, sorted(eog_ids_of(tiny_gemma3_path)))
    loop = DecodeLoop.build(tiny_gemma3_path, 3, 1, book, ctx_size=128)
    assert len(loop.run("Notes:", 4, Constraint.json_schema(STEP_SCHEMA))) == 4
    assert book.compiles == 1
