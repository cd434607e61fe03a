"""`bench experts` on small layers: both ops timed, equal where a stage runs the package's, the table."""

from __future__ import annotations

import io
import json

import pytest
from click.testing import CliRunner

from skippy_zmq.bench import experts as bench_experts
from skippy_zmq.bench.experts import ExpertsRow, experts_table, run_experts_bench
from skippy_zmq.bench.report import Machine, Report
from skippy_zmq.compute import expert_products, ggml
from skippy_zmq.errors import BenchError

pytestmark = pytest.mark.skipif(ggml.unavailable() is not None, reason=f"ggml unavailable: {ggml.unavailable()}")


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_experts, "ROUND_SECONDS", 0.001)


def _runs(type_name: str) -> None:
    found = expert_products._grouped_function(expert_products.GROUPED[type_name])
    if isinstance(found, str):
        pytest.skip(f"the grouped {type_name} op cannot run here: {found}")


@pytest.mark.parametrize("per_slot", [False, True])
@pytest.mark.parametrize(("type_name", "runs"), [("Q6_K", ["package", "ggml"]), ("Q4_K", ["ggml", "package"])])
def test_both_ops_are_timed_and_the_row_says_which_a_stage_runs(type_name: str, runs: list[str],
                                                               per_slot: bool) -> None:
    _runs(type_name)
    out = io.StringIO()
    report = Report("experts", out, machine=Machine("CPU", 1, ()), clock=lambda: "D")
    said: list[str] = []
    rows = run_experts_bench(type_name, (512, 32), 6, 2, [1, 8], 2, 2, report, said.append, per_slot=per_slot)
    assert [(r.type_name, r.k, r.n, r.experts, r.used, r.rows) for r in rows] == [
        (type_name, 512, 32, 6, 2, 1), (type_name, 512, 32, 6, 2, 8)]
    assert [r.stage_runs for r in rows] == runs
    assert all(r.ggml_ms > 0 and r.ours_ms > 0 for r in rows)
    assert said == [f"{type_name} experts: 6 of 512 x 32, quantizing", f"{type_name} experts, 1 pass row(s): 2 rounds",
                    f"{type_name} experts, 8 pass row(s): 2 rounds"]
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["rows"], line["rounds"], line["threads"], line["stage_runs"], line["per_slot"]) for line in lines] == [
        (1, 2, 2, runs[0], per_slot), (8, 2, 2, runs[1], per_slot)]


def test_outputs_that_differ_where_a_stage_runs_the_package_op_are_a_bench_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _runs("Q6_K")
    real = bench_experts._PassGraph.compute

    def spoiled(graph: bench_experts._PassGraph, name: str) -> None:
        real(graph, name)
        if name == "package":
            graph.outputs["package"][0, 0, 0] += 1.0

    monkeypatch.setattr(bench_experts._PassGraph, "compute", spoiled)
    report = Report("experts", None, machine=Machine("CPU", 1, ()), clock=lambda: "D")
    with pytest.raises(BenchError, match="Q6_K experts, 1 rows: the package's grouped op differs from ggml_mul_mat_id"):
        run_experts_bench("Q6_K", (512, 32), 6, 2, [1], 1, 1, report, lambda _text: None)


def test_more_used_than_experts_and_an_op_that_cannot_run_are_bench_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    report = Report("experts", None, machine=Machine("CPU", 1, ()), clock=lambda: "D")
    with pytest.raises(BenchError, match="--used 9 is more than --experts 8"):
        run_experts_bench("Q6_K", (512, 32), 8, 9, [1], 1, 1, report, lambda _text: None)
    monkeypatch.setattr(expert_products, "grouped", lambda *_args: None)
    with pytest.raises(BenchError, match="the package's grouped op cannot run here"):
        run_experts_bench("Q6_K", (512, 32), 6, 2, [1], 1, 1, report, lambda _text: None)


def test_the_table_names_the_layer_the_times_and_who_runs_each_count() -> None:
    rows = [ExpertsRow("Q6_K", 768, 2048, 128, 8, 1, 0.5, 0.25, "package"),
            ExpertsRow("Q6_K", 768, 2048, 128, 8, 8, 2.0, 1.0, "ggml")]
    table = experts_table(rows)
    assert "| Q6_K | 128 x 768 x 2048, 8 used | 1 | 0.500 | 0.250 | 0.50 | the package's |" in table
    assert "| 8 | 2.000 | 1.000 | 0.50 | ggml's |" in table


def test_the_command_prints_the_table_and_refuses_two_shapes() -> None:
    _runs("Q6_K")
    from skippy_zmq.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["bench", "experts", "--shape", "512x32", "--experts", "6", "--used", "2",
                                  "--rows", "1", "--rounds", "1"])
    assert result.exit_code == 0, result.output
    assert "| Q6_K | 6 x 512 x 32, 2 used | 1 |" in result.output
    result = runner.invoke(main, ["bench", "experts", "--shape", "512x32,256x8"])
    assert result.exit_code == 2 and "2 shapes; expected one KxN" in result.output
