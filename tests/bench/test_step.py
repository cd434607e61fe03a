"""`bench step` on a tiny random model in this process: the whole model, a middle stage, the table."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from skippy_zmq.bench.report import Machine, Report
from skippy_zmq.bench.step import StepBench, StepRow, run_step_bench, step_table
from tests.conftest import TINY_GEMMA3_LAYERS


def _run(options: StepBench) -> tuple[list[StepRow], list[dict[str, object]], list[str]]:
    out = io.StringIO()
    said: list[str] = []
    rows = run_step_bench(options, Report("step", out, machine=Machine("CPU", 1, ()), clock=lambda: "D"), said.append)
    return rows, [json.loads(line) for line in out.getvalue().splitlines()], said


def test_the_whole_model_has_a_head(tiny_gemma3_path: Path) -> None:
    options = StepBench(model=tiny_gemma3_path, layers=None, session_counts=(1, 3), prompt=3, steps=2, threads=1,
                        ctx_size=32)
    rows, lines, said = _run(options)
    assert [r.sessions for r in rows] == [1, 3]
    assert rows[0].prefill_others_s is None and rows[1].prefill_others_s is not None
    assert all(r.head_s is not None and r.decode_s > 0 and r.tok_s == pytest.approx(r.sessions / r.step_s)
               for r in rows)
    assert lines[0]["layers"] == [0, TINY_GEMMA3_LAYERS] and lines[0]["kernel"] and lines[0]["sessions"] == 1
    assert lines[1]["prefill_others_s"] is not None and lines[1]["bench"] == "step"
    assert "1 sessions: 3-token prompts, 2 decode steps" in said


def test_a_middle_stage_takes_activations_and_has_no_head(tiny_gemma3_path: Path) -> None:
    options = StepBench(model=tiny_gemma3_path, layers=(2, 4), session_counts=(2,), prompt=2, steps=2, threads=1,
                        gap_s=0.001, repack=False, ctx_size=16)
    rows, lines, said = _run(options)
    assert rows[0].head_s is None and rows[0].step_s == rows[0].decode_s
    assert lines[0]["layers"] == [2, 4] and lines[0]["head_s"] is None and lines[0]["repack"] is False
    assert said[-1] == "2 sessions: 2-token prompts, 2 decode steps, 0.001 s idle before each"


def test_the_table_in_milliseconds() -> None:
    rows = [StepRow(1, 0.5, 0.01, None, 0.02, 0.005), StepRow(4, 0.5, 0.01, 0.03, 0.04, None)]
    assert step_table(rows) == (
        "| sessions | prompt ms | again ms | others' prompts ms | decode step ms | head ms | tok/s |\n"
        "|---:|---:|---:|---:|---:|---:|---:|\n"
        "| 1 | 500.0 | 10.0 | - | 20.0 | 5.0 | 40.0 |\n"
        "| 4 | 500.0 | 10.0 | 30.0 | 40.0 | - | 100.0 |"
    )
