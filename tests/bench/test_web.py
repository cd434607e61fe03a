"""Tests of skippy_zmq.bench.web (`bench web`): the CPU time read from /proc, the windows and their figures, and
short runs against the gateway's app on a real port in this process (a fake engine behind it)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from skippy_zmq.bench.report import Report
from skippy_zmq.bench.web import WebBench, Window, cpu_seconds_of, measure, problems, process_cpu_seconds, run_web_bench
from skippy_zmq.cli import main
from skippy_zmq.errors import BenchError
from skippy_zmq.gateway import http
from skippy_zmq.gateway.metrics import GatewayMetrics
from tests.gateway.fakes import AppServer, FakeEngine
from tests.gateway.test_http import KEY, make_backend


def test_the_cpu_time_is_fields_14_and_15_after_a_name_that_may_hold_anything() -> None:
    stat = "4242 (python3 (serve) x) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 75 3 4 20 0 9 0 123 456 789"
    assert cpu_seconds_of(stat, 100) == 3.25  # utime 250 + stime 75 ticks
    assert process_cpu_seconds(os.getpid()) > 0
    with pytest.raises(BenchError, match=r"cannot read the CPU time of process 999999999 from /proc/999999999/stat"):
        process_cpu_seconds(999_999_999)


def test_a_window_gives_its_share_of_a_core_and_its_latencies() -> None:
    window = Window("polling", 60.0, 0.6, tuple(float(n) for n in range(1, 101)), failed=2)
    row = window.as_json()
    assert window.core_percent == pytest.approx(1.0)
    assert (row["polls"], row["failed"], row["latency_p50_ms"], row["latency_p99_ms"], row["latency_max_ms"]) == (
        100, 2, 50.0, 99.0, 100.0)
    assert Window("idle", 60.0, 0.3).as_json()["latency_p50_ms"] is None


@pytest.fixture
def app() -> Iterator[AppServer]:
    server = AppServer(http.make_app(make_backend(FakeEngine()), GatewayMetrics(), api_key=KEY))
    try:
        yield server
    finally:
        server.close()


def test_pages_poll_at_their_pace_and_the_cpu_is_read_around_each_window(app: AppServer) -> None:
    readings = iter([10.0, 10.3, 10.3, 10.9])  # idle: 0.3 s of CPU, polling: 0.6 s
    options = WebBench(pages=3, interval_s=0.1, seconds=0.5, api_key=KEY)
    idle, polling = measure(app.url, 1, options, lambda _text: None, cpu=lambda _pid: next(readings))
    assert (idle.name, idle.cpu_s, idle.latencies_ms) == ("idle", pytest.approx(0.3), ())
    assert (polling.name, polling.cpu_s, polling.failed) == ("polling", pytest.approx(0.6), 0)
    assert len(polling.latencies_ms) == 3 * 5  # every page, every 0.1 s of 0.5 s
    assert all(latency > 0 for latency in polling.latencies_ms)


def test_polls_without_the_key_fail_and_say_so(app: AppServer) -> None:
    options = WebBench(pages=1, interval_s=0.1, seconds=0.2, baseline=False, url=app.url, pid=os.getpid())
    results = run_web_bench(options, Report("web", None), lambda _text: None)
    assert results.windows[0].failed == 2 and results.windows[0].latencies_ms == ()
    assert problems(results) == ["2 of the polling window's polls failed"]
    with pytest.raises(BenchError, match="--url needs --pid"):
        run_web_bench(WebBench(url=app.url), Report("web", None), lambda _text: None)


def test_bench_web_through_the_command_line(app: AppServer, tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    result = CliRunner().invoke(main, ["bench", "web", "--url", app.url, "--pid", str(os.getpid()), "--pages", "2",
                                       "--interval", "0.1", "--seconds", "0.3", "--api-key", KEY, "--json-out",
                                       str(out)])
    assert result.exit_code == 0, result.output
    assert "| idle |" in result.stdout and "| polling |" in result.stdout
    assert "2 pages polling /stages every 0.1 s: " in result.stdout and "% of a core on top of the idle" in result.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["bench"], row["window"]) for row in rows] == [("web", "idle"), ("web", "polling")]
    assert rows[1]["polls"] == 2 * 3 and rows[1]["failed"] == 0 and rows[1]["core_percent"] >= 0
