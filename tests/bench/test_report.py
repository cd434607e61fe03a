"""The report every benchmark shares: the machine, percentiles, tables, JSON lines."""

from __future__ import annotations

import io
import json
import math
import re

import pytest

from skippy_zmq.bench.report import Machine, Report, cell, json_line, markdown_table, percentile, utc_now

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2
"""


def test_the_machine_comes_from_the_first_processor_of_cpuinfo() -> None:
    machine = Machine.from_cpuinfo(CPUINFO, nproc=2)
    assert machine == Machine(cpu="Intel(R) Xeon(R) Processor", nproc=2, isa=("avx2", "avx512", "avx512_vnni", "amx"))
    assert machine.describe() == "Intel(R) Xeon(R) Processor, nproc 2, avx2 avx512 avx512_vnni amx"
    assert machine.as_json() == {"cpu": "Intel(R) Xeon(R) Processor", "nproc": 2,
                                 "isa": ["avx2", "avx512", "avx512_vnni", "amx"]}


def test_a_machine_without_the_instruction_sets_says_so() -> None:
    machine = Machine.from_cpuinfo("model name : AMD EPYC\nflags : fpu sse2 avx\n", nproc=1)
    assert machine == Machine(cpu="AMD EPYC", nproc=1, isa=())
    assert machine.describe() == "AMD EPYC, nproc 1, no avx2"
    assert Machine.from_cpuinfo("", nproc=4).cpu == "unknown"


def test_this_host_has_a_description() -> None:
    machine = Machine.of_host()
    assert machine.nproc >= 1 and machine.cpu


def test_the_date_is_utc_to_the_second() -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", utc_now())


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([5.0], 0.5, 5.0),
    ([5.0], 0.99, 5.0),
    ([3.0, 1.0, 2.0], 0.5, 2.0),
    ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),  # rank 2 of 4: the lower middle
    ([0.5, 30.0], 0.5, 0.5),
    ([0.5, 30.0], 0.9, 30.0),
    ([float(i) for i in range(1, 11)], 0.9, 9.0),
    ([float(i) for i in range(101)], 0.99, 99.0),  # rank ceil(99.99) = 100
    ([float(i) for i in range(100)], 0.99, 98.0),  # rank 99
    ([float(i) for i in range(100)], 0.0, 0.0),
    ([float(i) for i in range(100)], 1.0, 99.0),
])
def test_percentile_is_the_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == expected


def test_percentile_of_nothing_is_nan_and_a_quantile_outside_0_1_is_refused() -> None:
    assert math.isnan(percentile([], 0.5))
    with pytest.raises(ValueError, match="quantile 50 is outside"):
        percentile([1.0], 50)


def test_cells_and_a_table() -> None:
    assert [cell(1.25), cell(1.25, 2), cell(None), cell(math.nan), cell(3), cell("x")] == \
        ["1.2", "1.25", "-", "-", "3", "x"]
    assert markdown_table(("name", "value"), [("a", "1.0"), ("b", "-")], "lr") == (
        "| name | value |\n|---|---:|\n| a | 1.0 |\n| b | - |")


def test_json_lines_hold_no_nan() -> None:
    line = json_line({"a": math.nan, "b": [1.0, math.inf], "c": {"d": -math.inf}, "e": "é"})
    assert json.loads(line) == {"a": None, "b": [1.0, None], "c": {"d": None}, "e": "é"}
    assert "\n" not in line and "NaN" not in line


def test_every_row_is_stamped_and_written_at_once() -> None:
    out = io.StringIO()
    machine = Machine(cpu="CPU", nproc=2, isa=("avx2",))
    report = Report("codecs", out, machine=machine, clock=lambda: "2026-12-04T00:00:00Z")
    stamped = report.add({"size": 4096, "gbps": math.nan})
    assert stamped == {"bench": "codecs", "size": 4096, "gbps": math.nan,
                       "machine": {"cpu": "CPU", "nproc": 2, "isa": ["avx2"]}, "date": "2026-12-04T00:00:00Z"}
    report.add({"size": 8192, "gbps": 1.5})
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [row["size"] for row in rows] == [4096, 8192]
    assert rows[0]["gbps"] is None and rows[1]["machine"]["isa"] == ["avx2"]
    assert report.heading() == "codecs: CPU, nproc 2, avx2, 2026-12-04T00:00:00Z"
    assert len(report.rows) == 2


def test_a_report_without_a_file_keeps_its_rows() -> None:
    report = Report("step", None, machine=Machine("CPU", 1, ()), clock=lambda: "D")
    report.add({"x": 1})
    assert report.rows == [{"bench": "step", "x": 1, "machine": {"cpu": "CPU", "nproc": 1, "isa": []}, "date": "D"}]
