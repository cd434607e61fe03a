"""`bench codecs` on tiny arrays: every codec's rows, the ratio to copyto, the table."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from skippy_zmq.bench import codecs as bench_codecs
from skippy_zmq.bench.codecs import (
    REFERENCE,
    CodecRow,
    activations,
    bench_size,
    codecs_table,
    format_size,
    run_codecs_bench,
)
from skippy_zmq.bench.report import Machine, Report
from skippy_zmq.wire.codecs import CODECS, ActivationCodec


@pytest.fixture(autouse=True)
def _short_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_codecs, "MIN_BATCH_SECONDS", 0.001)


@pytest.mark.parametrize(("nbytes", "text"), [(16 << 20, "16 MiB"), (4096, "4 KiB"), (1 << 30, "1 GiB"),
                                              (1000, "1000 B"), (1536, "1536 B")])
def test_sizes_read_as_written(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


def test_activations_come_in_rows_when_they_fill_them() -> None:
    rng = np.random.default_rng(0)
    assert activations(640 * 4 * 3, rng).shape == (3, 640)
    assert activations(4096, rng).shape == (1024,)
    assert activations(4096, rng).dtype == np.float32


def test_every_codec_but_raw_is_timed_both_ways() -> None:
    rows = bench_size(4096, 1, np.random.default_rng(0))
    expected = [(row.codec.wire_name, op) for row in CODECS if row.codec is not ActivationCodec.RAW_F32_V1
                for op in ("encode", "decode")]
    assert [(r.codec, r.op) for r in rows[: len(expected)]] == expected
    assert [(r.codec, r.op) for r in rows[len(expected):]] == [
        (REFERENCE, "encode"), (REFERENCE, "decode"), ("bf16-exact -> bf16-rne-v1", "select"),
        ("f16-exact -> f16-rne-v1", "select")]
    assert all(r.size_bytes == 4096 and r.gbps > 0 and r.copy_gbps > 0 for r in rows)


def test_the_rows_reported_and_tabled() -> None:
    out = io.StringIO()
    report = Report("codecs", out, machine=Machine("CPU", 1, ()), clock=lambda: "D")
    said: list[str] = []
    rows = run_codecs_bench([4096, 2560], 1, report, said.append)
    assert said == ["size 1/2: 4 KiB, best of 1", "size 2/2: 2560 B, best of 1"]
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == len(rows) and {r.size_bytes for r in rows} == {4096, 2560}
    assert lines[0]["bench"] == "codecs" and lines[0]["repeat"] == 1 and lines[0]["size_bytes"] == 4096
    assert set(lines[0]) == {"bench", "repeat", "numpy", "size_bytes", "codec", "op", "gbps", "copy_gbps", "ratio",
                             "machine", "date"}


def test_the_table() -> None:
    table = codecs_table([CodecRow(16 << 20, "bf16-rne-v1", "encode", 3.5, 14.0)])
    assert table == ("| size | codec | op | GB/s | copyto GB/s | ratio to copyto |\n"
                     "|---:|---|---|---:|---:|---:|\n"
                     "| 16 MiB | bf16-rne-v1 | encode | 3.50 | 14.00 | 25.0% |")
