"""`bench memory`: /proc reading, a stage against the estimate on a tiny model in this process, and a serving
command's start and tree (slow, with a fake server)."""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

from skippy_zmq.bench.memory import (
    CommandMemory,
    StageMemory,
    _vm_rss_kib,
    command_table,
    measure_command,
    measure_stage,
    rss_mib,
    stage_table,
    tree_rss_mib,
)
from skippy_zmq.bench.report import Machine, Report
from skippy_zmq.errors import BenchError
from tests.bench.fakes import fake_server_script


def _report() -> tuple[Report, io.StringIO]:
    out = io.StringIO()
    return Report("memory", out, machine=Machine("CPU", 1, ()), clock=lambda: "D"), out


def test_vm_rss_is_read_from_a_status_text() -> None:
    assert _vm_rss_kib("Name:\tpython3\nVmPeak:\t 9 kB\nVmRSS:\t  51200 kB\n") == 51200
    assert _vm_rss_kib("Name:\tkthreadd\n") == 0


def test_this_process_and_its_tree_are_resident() -> None:
    assert rss_mib() > 10
    assert tree_rss_mib(os.getpid()) >= rss_mib() * 0.5
    assert tree_rss_mib(2**22 + 12345) == 0  # no such process


def test_a_stage_against_the_estimate(tiny_gemma3_path: Path) -> None:
    report, out = _report()
    result = measure_stage(tiny_gemma3_path, (0, 3), ctx_size=64, lanes=2, prompt=5, report=report,
                           progress=lambda _t: None)
    assert result.layers == (0, 3) and result.kernel
    # the load hands freed heap back to the OS, so RSS after it may be below RSS before it
    assert min(result.after_imports_mib, result.after_load_mib, result.after_prompts_mib) > 0
    assert result.estimate_mib > 0
    assert "weights" in result.estimate
    row = json.loads(out.getvalue())
    assert row["row"] == "stage" and row["lanes"] == 2 and row["layers"] == [0, 3] and row["bench"] == "memory"


def test_the_tables() -> None:
    stage = StageMemory("m.gguf", (0, 12), "ggml", 51.0, 300.04, 320.0, 400.0, "weights ...")
    assert stage_table(stage).splitlines()[-1] == "| 0..12 | ggml | 51.0 | 300.0 | 320.0 | 400.0 |"
    command = CommandMemory("skippy-zmq serve --port 8131", 2.345, 584.4, (2.9, 2.5))
    assert command_table(command).splitlines()[-1] == "| `skippy-zmq serve --port 8131` | 2.35 | 584 | 2.90, 2.50 |"
    assert command.as_json() == {"command": "skippy-zmq serve --port 8131", "ready_s": 2.35, "tree_rss_mib": 584,
                                 "warmup_ready_s": [2.9, 2.5]}


@pytest.mark.slow
def test_a_serving_command_is_started_measured_and_stopped(tmp_path: Path) -> None:
    from skippy_zmq.launch.topology import free_tcp_ports

    port = free_tcp_ports(1)[0]
    report, out = _report()
    said: list[str] = []
    argv = [sys.executable, str(fake_server_script(tmp_path)), "--port", str(port), "--delay", "0.3"]
    result = measure_command(argv, port=port, warmup=1, ready_timeout_s=30, timeout_s=10, report=report,
                             progress=said.append)
    assert result.ready_s >= 0.3 and len(result.warmup_ready_s) == 1 and result.tree_rss_mib > 8
    assert json.loads(out.getvalue())["row"] == "command"
    assert said[0].startswith("start 1/2 (warm-up): ") and any(s.startswith("start 2/2 (measured): ") for s in said)


@pytest.mark.slow
def test_a_command_that_never_serves_is_an_error_with_its_log(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the log directory it keeps
    report, _ = _report()
    argv = [sys.executable, "-c", "print('bad flag'); raise SystemExit(2)"]
    with pytest.raises(BenchError, match=r"exited with status 2 before .* answered 200; .*\nbad flag$"):
        measure_command(argv, port=9, warmup=0, ready_timeout_s=30, timeout_s=10, report=report,
                        progress=lambda _t: None)
