"""`bench pipeline`: the hop rows and the tables from known figures, the single process's decode on a tiny
model, and the whole benchmark on the tiny model with real pipelines (slow)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from skippy_zmq.bench.pipeline import PipelineBench, PipelineResults, _hop_rows, run_pipeline_bench, single_decode
from skippy_zmq.bench.report import Machine, Report
from skippy_zmq.telemetry import HopTiming


def _hop(stage: int, transfer_us: int, bytes_out: int = 2560) -> HopTiming:
    return HopTiming(stage_index=stage, queue_us=0, decode_us=0, compute_us=0, encode_us=0, transfer_us=transfer_us,
                     bytes_out=bytes_out)


def test_hop_rows_per_pipeline_and_stage() -> None:
    rows = _hop_rows({1: [_hop(0, 100, 8), _hop(0, 300, 8)], 2: [_hop(1, 50), _hop(0, 500), _hop(0, 700)]})
    assert rows == [
        # nearest rank: the median of two samples is the lower one
        {"row": "hop", "stages": 1, "from_stage": 0, "to": "driver", "transfer_p50_us": 100.0,
         "transfer_p99_us": 300.0, "bytes_per_token": 8},
        {"row": "hop", "stages": 2, "from_stage": 0, "to": "stage 1", "transfer_p50_us": 500.0,
         "transfer_p99_us": 700.0, "bytes_per_token": 2560},
        {"row": "hop", "stages": 2, "from_stage": 1, "to": "driver", "transfer_p50_us": 50.0, "transfer_p99_us": 50.0,
         "bytes_per_token": 2560},
    ]


def test_the_tables() -> None:
    results = PipelineResults(
        speeds={(0, 1): [40.0, 42.0, 44.0], (0, 4): [100.0], (2, 1): [30.0, 33.0, 31.0], (2, 4): [90.0]},
        hops=({"stages": 2, "from_stage": 0, "to": "stage 1", "transfer_p50_us": 512.4, "transfer_p99_us": 900.0,
               "bytes_per_token": 2560.0},),
        bare=({"payload_bytes": 2560, "gap_ms": 25.0, "one_way_p50_us": 537.0, "one_way_p99_us": 800.0},),
    )
    assert results.table() == (
        "| setup | sessions | decode tok/s, median (min-max) | vs single process |\n"
        "|---|---:|---:|---:|\n"
        "| single process | 1 | 42.00 (40.00-44.00) | 1.00 |\n"
        "| single process | 4 | 100.00 (100.00-100.00) | 1.00 |\n"
        "| 2-stage pipeline | 1 | 31.00 (30.00-33.00) | 0.74 |\n"
        "| 2-stage pipeline | 4 | 90.00 (90.00-90.00) | 0.90 |\n"
        "\n"
        "| setup | hop | transfer p50 µs | transfer p99 µs | activation bytes per token |\n"
        "|---|---:|---:|---:|---:|\n"
        "| 2-stage | 0 → stage 1 | 512 | 900 | 2560 |\n"
        "| bare pyzmq, 25 ms between messages | one way | 537 | 800 | 2560 |"
    )


def test_the_single_process_decodes_and_closes_its_sessions(tiny_gemma3_path: Path) -> None:
    from skippy_zmq.runtime.stage import StageRuntime

    runtime = StageRuntime.load(tiny_gemma3_path, 0, runtime_layers(tiny_gemma3_path), ctx_size=32)
    prompts = [[2, 10, 11], [2, 12], [2, 13, 14, 15], [2, 16]]
    assert single_decode(runtime, prompts, tokens=3, batch=4) > 0
    assert single_decode(runtime, prompts, tokens=2, batch=1) > 0
    assert runtime.session_ids() == []
    assert np.isfinite(single_decode(runtime, prompts, tokens=1, batch=2))


def runtime_layers(path: Path) -> int:
    from skippy_zmq.model.gguf_model import read_hparams

    return read_hparams(path).n_layer


@pytest.mark.slow
def test_a_tiny_model_against_its_pipelines(tiny_gemma3_path: Path) -> None:
    out = io.StringIO()
    said: list[str] = []
    options = PipelineBench(model=tiny_gemma3_path, stage_counts=(1, 2), tokens=2, rounds=1, ready_timeout_s=120,
                            bare_messages=(5, 20))
    results = run_pipeline_bench(options, Report("pipeline", out, machine=Machine("CPU", 1, ()), clock=lambda: "D"),
                                 said.append)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    speeds = [(r["stages"], r["sessions"]) for r in rows if r["row"] == "speed"]
    assert speeds == [(0, 1), (0, 4), (1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(r["median_tok_s"] > 0 for r in rows if r["row"] == "speed")
    assert [(r["stages"], r["from_stage"], r["to"]) for r in rows if r["row"] == "hop"] == [
        (1, 0, "driver"), (2, 0, "stage 1"), (2, 1, "driver")]
    assert [r["gap_ms"] > 0 for r in rows if r["row"] == "bare_zmq"] == [True, False]
    assert "| 2-stage pipeline | 4 |" in results.table()
    assert said[:2] == ["starting a 1-stage pipeline", "starting a 2-stage pipeline"]
