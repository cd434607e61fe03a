"""tools/_common.py: the processes a tool starts and stops, /health waits, a run's end,
and where llama-server comes from; no model and no server needed."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tools import _common


def test_agreeing_prefix_stops_at_the_first_difference() -> None:
    assert _common.agreeing_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert _common.agreeing_prefix([1, 2], [1, 2]) == 2
    assert _common.agreeing_prefix([3], [4]) == 0


def test_proc_status_reads_this_process_and_none_for_a_missing_one() -> None:
    assert (_common.proc_status_kib(os.getpid(), "VmRSS") or 0) > 0
    assert _common.proc_status_kib(os.getpid(), "NoSuchField") is None
    assert _common.proc_status_kib(2**22 + 12345) is None


@pytest.mark.slow
def test_a_started_process_logs_to_its_file_and_stops_on_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    code = "import sys, time; print('up', flush=True); print('err', file=sys.stderr, flush=True); time.sleep(60)"
    process = _common.start([sys.executable, "-c", code], log=log)
    try:
        deadline = time.monotonic() + 30
        while "err" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(log.read_text().split()) == ["err", "up"]
    finally:
        status = _common.stop(process, 10)
    assert status == -signal.SIGTERM


@pytest.mark.slow
def test_a_process_that_ignores_sigterm_is_killed_and_its_status_is_none() -> None:
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', file=sys.stderr, " \
           "flush=True); time.sleep(60)"
    process = _common.start([sys.executable, "-c", code], pipe_stderr=True)
    try:
        assert process.stderr is not None and process.stderr.readline() == "ready\n"  # its handler is in place
    finally:
        started = time.monotonic()
        status = _common.stop(process, 0.5)
    assert status is None and process.poll() == -signal.SIGKILL and time.monotonic() - started < 10


@pytest.mark.slow
def test_running_stops_the_process_when_the_block_ends() -> None:
    with _common.running([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=10) as process:
        assert process.poll() is None
    assert process.poll() == -signal.SIGTERM


@pytest.mark.slow
def test_waiting_for_health_names_a_process_that_exited(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    process = _common.start([sys.executable, "-c", "print('no such model'); raise SystemExit(3)"], log=log)
    process.wait(30)
    with pytest.raises(_common.ToolError, match=r"(?s)server exited with status 3 before .*/health .*no such model"):
        _common.wait_healthy("http://127.0.0.1:9", process, 30, name="server", log=log)


def test_finish_prints_json_removes_an_ok_run_and_keeps_a_failed_one(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    said: list[str] = []
    ok_dir, failed_dir = _common.run_directory(str(tmp_path / "ok"), "x-"), _common.run_directory(None, "x-")
    with pytest.raises(SystemExit) as ended:
        _common.finish({"ok": True}, str, as_json=True, directory=ok_dir, keep=False, interrupted=False, say=said.append)
    assert ended.value.code == 0 and not ok_dir.exists()
    assert json.loads(capsys.readouterr().out) == {"ok": True}
    with pytest.raises(SystemExit) as ended:
        _common.finish({"ok": False}, lambda r: f"report {r['ok']}", as_json=False, directory=failed_dir, keep=False,
                       interrupted=False, say=said.append, kept="the logs")
    assert ended.value.code == 1 and failed_dir.is_dir()
    assert capsys.readouterr().out == "report False\n" and said == [f"the logs kept in {failed_dir}"]
    with pytest.raises(SystemExit) as ended:
        _common.finish({"ok": True}, str, as_json=True, directory=failed_dir, keep=True, interrupted=True,
                       say=said.append)
    assert ended.value.code == 130 and failed_dir.is_dir()
    failed_dir.rmdir()


def test_llama_server_comes_from_the_option_then_the_environment_then_path(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    build = tmp_path / "build" / "bin"
    build.mkdir(parents=True)
    (build / "llama-server").write_text("#!/bin/sh\n")
    (build / "llama-server").chmod(0o755)
    monkeypatch.delenv(_common.LLAMA_SERVER_DIR_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(_common.ToolError, match=r"no llama-server: .*--server-dir.*\$LLAMA_SERVER_DIR.*PATH"):
        _common.LlamaServer.find()
    monkeypatch.setenv("PATH", str(build))
    assert _common.LlamaServer.find().directory == build.resolve()
    monkeypatch.setenv(_common.LLAMA_SERVER_DIR_ENV, str(tmp_path))
    with pytest.raises(_common.ToolError, match=f"llama-server not found at {tmp_path / 'llama-server'}"):
        _common.LlamaServer.find()
    server = _common.LlamaServer.find(build)
    assert server.binary == build / "llama-server"
    assert server.environment()["LD_LIBRARY_PATH"].split(":")[0] == str(build)
    assert server.command("m.gguf", 8080, threads=2, ctx_size=512, parallel=4, options=["--no-repack"]) == [
        str(build / "llama-server"), "-m", "m.gguf", "-t", "2", "-c", "512", "-np", "4", "--host", "127.0.0.1",
        "--port", "8080", "--no-repack"]
