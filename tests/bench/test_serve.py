"""`bench serve`: the turns, the ratios, the tables; a run against a fake server in this process; and the
command end to end against a small `skippy-zmq serve` (slow)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from skippy_zmq.bench.clients import RunSummary
from skippy_zmq.bench.report import Machine, Report
from skippy_zmq.bench.serve import BASELINE, Ratio, ServeBench, ServeResults, Turn, ratios, run_serve_bench, turns
from tests.bench.fakes import FakeOpenAI

REPO = Path(__file__).resolve().parents[2]


def test_the_order_swaps_every_round() -> None:
    order = [(t.round, t.clients, t.server) for t in turns(3, (1, 8), ("llama-server", "serve"))]
    assert order == [
        (1, 1, "llama-server"), (1, 1, "serve"), (1, 8, "llama-server"), (1, 8, "serve"),
        (2, 1, "serve"), (2, 1, "llama-server"), (2, 8, "serve"), (2, 8, "llama-server"),
        (3, 1, "llama-server"), (3, 1, "serve"), (3, 8, "llama-server"), (3, 8, "serve"),
    ]


def test_one_server_runs_every_count_every_round() -> None:
    assert turns(2, (4, 2), ("serve",)) == [Turn(1, 4, "serve"), Turn(1, 2, "serve"), Turn(2, 4, "serve"),
                                            Turn(2, 2, "serve")]


def test_one_at_a_time_each_server_runs_every_count_of_a_round_in_a_block() -> None:
    order = [(t.round, t.clients, t.server)
             for t in turns(2, (1, 4), ("llama-server", "serve"), one_at_a_time=True)]
    assert order == [(1, 1, "llama-server"), (1, 4, "llama-server"), (1, 1, "serve"), (1, 4, "serve"),
                     (2, 1, "serve"), (2, 4, "serve"), (2, 1, "llama-server"), (2, 4, "llama-server")]


def test_one_at_a_time_starts_each_server_for_its_block_and_stops_it_first(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    from skippy_zmq.bench import serve

    alive: list[str] = []
    seen: list[tuple[str, tuple[str, ...]]] = []  # (server of the run, servers running meanwhile)

    @contextlib.contextmanager
    def started(commands: list[Any], _logs: Path, **_options: Any) -> Iterator[list[Any]]:
        with contextlib.ExitStack() as stack:
            servers = []
            for command in commands:
                fake = stack.enter_context(FakeOpenAI())
                servers.append(SimpleNamespace(command=SimpleNamespace(name=command.name, url=fake.url),
                                               check_alive=lambda: None))
                alive.append(command.name)
            try:
                yield servers
            finally:
                del alive[:]

    measure = serve.run_clients

    def run_clients(url: str, workload: Any) -> RunSummary:
        seen.append((url, tuple(alive)))
        return measure(url, workload)

    monkeypatch.setattr(serve, "started", started)
    monkeypatch.setattr(serve, "run_clients", run_clients)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")  # only its path is read: {model} in the command line
    options = ServeBench(client_counts=(1, 2), tokens=2, rounds=2, llama_server="llama-server -m {model} --port {port}",
                         model=str(model), timeout_s=10, one_at_a_time=True)
    results = run_serve_bench(options, Report("serve", io.StringIO()), lambda _text: None)
    assert [alone for _url, alone in seen] == [("llama-server",)] * 2 + [("serve",)] * 4 + [("llama-server",)] * 2
    assert [(t.round, t.clients, t.server) for t, _ in results.runs] == [
        (1, 1, "llama-server"), (1, 2, "llama-server"), (1, 1, "serve"), (1, 2, "serve"),
        (2, 1, "serve"), (2, 2, "serve"), (2, 1, "llama-server"), (2, 2, "llama-server")]
    assert [len(r.ratios) for r in results.ratios] == [2, 2]


def _summary(tok_s: float, *, failed: int = 0, tokens: int = 8) -> RunSummary:
    return RunSummary(requests=2, failed=failed, completion_tokens=tokens, expected_tokens=8, wall_s=1.0,
                      aggregate_tok_s=tok_s, decode_tok_s=tok_s, ttft_p50_ms=10.0, ttft_p99_ms=12.0,
                      itl_p50_ms=5.0, itl_p99_ms=6.5, first_error="HTTP 500: x" if failed else None)


RUNS = (
    (Turn(1, 1, "llama-server"), _summary(10.0)), (Turn(1, 1, "serve"), _summary(12.0)),
    (Turn(1, 8, "llama-server"), _summary(40.0)), (Turn(1, 8, "serve"), _summary(50.0)),
    (Turn(2, 1, "serve"), _summary(11.0)), (Turn(2, 1, "llama-server"), _summary(10.0)),
    (Turn(2, 8, "serve"), _summary(60.0)), (Turn(2, 8, "llama-server"), _summary(40.0)),
    (Turn(3, 1, "llama-server"), _summary(10.0)), (Turn(3, 1, "serve"), _summary(13.0)),
)


def test_ratios_per_round_and_their_median() -> None:
    found = ratios(RUNS, "serve", "llama-server")
    assert [(r.clients, r.ratios) for r in found] == [(1, pytest.approx((1.2, 1.1, 1.3))),
                                                      (8, pytest.approx((1.25, 1.5)))]
    assert found[0].median == pytest.approx(1.2) and found[1].median == pytest.approx(1.375)


def test_a_round_missing_a_server_or_a_baseline_without_tokens_gives_no_ratio() -> None:
    runs = ((Turn(1, 1, "llama-server"), _summary(0.0)), (Turn(1, 1, "serve"), _summary(5.0)),
            (Turn(1, 2, "serve"), _summary(5.0)))
    assert ratios(runs, "serve", "llama-server") == []


def test_the_tables_and_the_problems() -> None:
    options = ServeBench(client_counts=(1, 8), tokens=4, llama_server="llama-server -m {model}")
    runs = ((Turn(1, 1, "llama-server"), _summary(10.0)), (Turn(1, 1, "serve"), _summary(12.5, failed=1, tokens=6)))
    results = ServeResults(options, runs, (Ratio(1, (1.25,)),))
    assert results.table() == (
        "| round | clients | server | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | failed |\n"
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|\n"
        "| 1 | 1 | llama-server | 10.0 | 10.0 | 12.0 | 5.0 | 6.5 | 0 |\n"
        "| 1 | 1 | serve | 12.5 | 10.0 | 12.0 | 5.0 | 6.5 | 1 |\n"
        "\n"
        "| clients | serve / llama-server, per round | median |\n"
        "|---:|---|---:|\n"
        "| 1 | 1.250 | 1.250 |"
    )
    assert results.problems() == ["serve round 1 at 1 clients: 1 of 2 requests failed, 6 of 8 tokens "
                                  "(first error: HTTP 500: x)"]


def test_the_workload_and_the_candidate_name() -> None:
    options = ServeBench(client_counts=(2,), tokens=3, requests=2, prompt="Hi", timeout_s=5.0)
    workload = options.workload(2)
    assert (workload.clients, workload.tokens, workload.requests, workload.prompts, workload.timeout_s) == \
        (2, 3, 2, ("Hi",), 5.0)
    assert options.candidate == "serve"
    assert ServeBench(client_counts=(1,), tokens=1, url="http://h:1").candidate == "http://h:1"


def test_a_running_server_at_url_is_measured_and_reported() -> None:
    out = io.StringIO()
    report = Report("serve", out, machine=Machine("CPU", 2, ("avx2",)), clock=lambda: "2026-12-04T00:00:00Z")
    said: list[str] = []
    with FakeOpenAI() as server:
        options = ServeBench(client_counts=(1, 2), tokens=3, rounds=2, url=server.url, timeout_s=10, label="fake")
        results = run_serve_bench(options, report, said.append)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["round"], r["clients"], r["server"]) for r in rows] == [
        (1, 1, server.url), (1, 2, server.url), (2, 1, server.url), (2, 2, server.url)]
    assert all(r["bench"] == "serve" and r["row"] == "run" and r["label"] == "fake" and r["failed"] == 0
               and r["completion_tokens"] == r["expected_tokens"] == 3 * r["clients"] and r["aggregate_tok_s"] > 0
               and r["machine"] == {"cpu": "CPU", "nproc": 2, "isa": ["avx2"]} and r["date"] == "2026-12-04T00:00:00Z"
               for r in rows)
    assert results.ratios == () and results.problems() == []
    assert said[0] == f"run 1/4: {server.url}, round 1, 1 clients x 1 requests x 3 tokens"


def _bench(tmp_path: Path, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """`skippy-zmq bench ARGS` in a process of its own on this checkout (its temporary files under `tmp_path`);
    on a timeout it is sent SIGTERM first, so it stops the servers it started."""
    env = os.environ | {"PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    process = subprocess.Popen([sys.executable, "-m", "skippy_zmq.cli", "bench", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
        raise AssertionError(f"bench {args} took over {timeout_s} s:\n{stderr}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.slow
def test_bench_serve_against_a_small_local_serve(gemma3_270m_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.jsonl"
    result = _bench(tmp_path, "serve", "--serve-args", "--stages 1 --lanes 2", "--clients", "1,2", "--tokens", "4",
                    "--ready-timeout", "300", "--timeout", "120", "--json-out", str(out))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["server"], r["round"], r["clients"]) for r in rows] == [("serve", 1, 1), ("serve", 1, 2)]
    for row in rows:
        assert row["bench"] == "serve" and row["row"] == "run" and row["failed"] == 0
        assert row["completion_tokens"] == row["expected_tokens"] == 4 * row["clients"]
        assert row["aggregate_tok_s"] > 0 and row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0
        assert set(row["machine"]) == {"cpu", "nproc", "isa"} and row["date"].endswith("Z")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("serve: ") and lines[1] == ""
    assert lines[2] == "| round | clients | server | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | failed |"
    assert [line.split(" | ")[:3] for line in lines[4:]] == [["| 1", "1", "serve"], ["| 1", "2", "serve"]]
    assert "starting serve: skippy-zmq serve --stages 1 --lanes 2 --port " in result.stderr


@pytest.mark.slow
def test_bench_serve_names_a_baseline_that_does_not_start(tmp_path: Path) -> None:
    result = _bench(tmp_path, "serve", "--url", "http://127.0.0.1:9", "--llama-server",
                    f"{sys.executable} -c \"print('no model here'); raise SystemExit(1)\"", "--clients", "1",
                    timeout_s=120)
    assert result.returncode == 1
    assert "error: llama-server (" in result.stderr and "exited with status 1 before" in result.stderr
    assert result.stderr.rstrip().endswith("no model here")
    assert list(tmp_path.glob(f"skippy-bench-*/{BASELINE}.log"))  # kept: the error names it
