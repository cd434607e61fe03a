"""Serving processes a benchmark starts: command lines in-process; starting, health and stopping with real
processes (slow)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from skippy_zmq.bench.servers import Server, ServerCommand, http_status, log_directory, started
from skippy_zmq.errors import BenchError
from tests.bench.fakes import fake_server_script


def test_model_and_port_are_substituted_and_the_port_appended() -> None:
    command = ServerCommand.from_template("llama-server", "llama-server -m {model} -t 2 -np 16 -c 8192",
                                          model="/m/x y.gguf", port=8123)
    assert command.argv == ("llama-server", "-m", "/m/x y.gguf", "-t", "2", "-np", "16", "-c", "8192", "--port",
                            "8123")
    assert command.port == 8123 and command.url == "http://127.0.0.1:8123"
    assert command.shown == "llama-server -m '/m/x y.gguf' -t 2 -np 16 -c 8192 --port 8123"


def test_a_port_placeholder_is_not_appended_again() -> None:
    command = ServerCommand.from_template("b", "env LD_LIBRARY_PATH=/l /l/llama-server --port {port} -m {model}",
                                          model="m.gguf", port=9000)
    assert command.argv == ("env", "LD_LIBRARY_PATH=/l", "/l/llama-server", "--port", "9000", "-m", "m.gguf")


@pytest.mark.parametrize("template", ["srv --port 8080 -m x", "srv --port=8080"])
def test_a_port_the_command_names_is_the_one_awaited(template: str) -> None:
    command = ServerCommand.from_template("b", template, model="m", port=9000)
    assert command.port == 8080 and "9000" not in command.argv


@pytest.mark.parametrize(("template", "message"), [
    ("", "the b command line is empty"),
    ("srv 'unclosed", "the b command line \"srv 'unclosed\" cannot be split into words: No closing quotation"),
    ("srv --port x", "the b command line names port 'x'; expected 1..65535 or {port}"),
    ("srv --port 70000", "names port '70000'"),
])
def test_a_bad_command_line_is_refused(template: str, message: str) -> None:
    with pytest.raises(BenchError) as caught:
        ServerCommand.from_template("b", template, model="m", port=9000)
    assert message in str(caught.value)


def test_serve_runs_on_this_interpreter_and_shows_as_skippy_zmq() -> None:
    command = ServerCommand.skippy_serve("--stages 2 --lanes 4", port=8200, model="/m.gguf")
    assert command.argv == (sys.executable, "-m", "skippy_zmq.cli", "serve", "--stages", "2", "--lanes", "4",
                            "--model", "/m.gguf", "--port", "8200")
    assert command.shown == "skippy-zmq serve --stages 2 --lanes 4 --model /m.gguf --port 8200"
    assert ServerCommand.skippy_serve("", port=1, model=None).shown == "skippy-zmq serve --port 1"


def test_a_command_behind_a_namespace_prefix_shows_as_skippy_zmq_and_names_its_host() -> None:
    command = ServerCommand("serve", ("ip", "netns", "exec", "ns0", sys.executable, "-m", "skippy_zmq.cli", "serve",
                                      "--port", "8000"), 8000, "10.78.3.2")
    assert command.shown == "ip netns exec ns0 skippy-zmq serve --port 8000"
    assert command.url == "http://10.78.3.2:8000"


def test_nothing_listening_is_status_0() -> None:
    from skippy_zmq.launch.topology import free_tcp_ports

    assert http_status(f"http://127.0.0.1:{free_tcp_ports(1)[0]}/health", 1.0) == 0


def test_the_log_directory_is_kept_only_for_a_bench_error() -> None:
    with log_directory() as path:
        assert path.is_dir()
    assert not path.exists()
    with pytest.raises(BenchError), log_directory() as path:
        raise BenchError("x")
    assert path.is_dir()
    path.rmdir()
    with pytest.raises(KeyboardInterrupt), log_directory() as path:
        raise KeyboardInterrupt
    assert not path.exists()


def _fake(tmp_path: Path, *extra: str) -> ServerCommand:
    from skippy_zmq.launch.topology import free_tcp_ports

    return ServerCommand.from_template("fake", f"{sys.executable} {fake_server_script(tmp_path)} {' '.join(extra)}",
                                       model="", port=free_tcp_ports(1)[0])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_a_server_is_awaited_and_stopped(tmp_path: Path) -> None:
    command = _fake(tmp_path, "--delay 0.5")
    with started([command], tmp_path, ready_timeout_s=30, progress=lambda _t: None) as servers:
        assert http_status(f"{command.url}/health") == 200
        pid = servers[0].process.pid
        servers[0].check_alive()
    assert servers[0].process.returncode is not None and _gone(pid)
    assert "fake server starting" in (tmp_path / "fake.log").read_text()


@pytest.mark.slow
def test_a_server_that_exits_is_named_with_its_log(tmp_path: Path) -> None:
    command = ServerCommand.from_template("broken", f"{sys.executable} -c \"print('cannot load'); raise SystemExit(3)\"",
                                          model="", port=9)
    server = Server(command, tmp_path / "broken.log")
    try:
        with pytest.raises(BenchError) as caught:
            server.wait_healthy(30, lambda _t: None)
    finally:
        server.stop()
    text = str(caught.value)
    assert text.startswith(f"broken ({command.shown}) exited with status 3 before http://127.0.0.1:9/health answered "
                           f"200; the last lines of its log {tmp_path / 'broken.log'}:\n")
    assert text.endswith("cannot load")


@pytest.mark.slow
def test_a_companion_that_exits_fails_the_wait_with_its_own_log(tmp_path: Path) -> None:
    gateway = Server(_fake(tmp_path, "--delay 60"), tmp_path / "fake.log")
    stage = Server(ServerCommand("stage-1", (sys.executable, "-c", "print('no layers'); raise SystemExit(2)"), 1),
                   tmp_path / "stage-1.log")
    try:
        with pytest.raises(BenchError) as caught:
            gateway.wait_healthy(30, lambda _t: None, companions=[stage])
    finally:
        gateway.stop()
        stage.stop()
    assert str(caught.value).startswith(f"stage-1 ({stage.command.shown}) exited with status 2 before fake answered "
                                        f"200 on {gateway.command.url}/health; the last lines of its log ")
    assert str(caught.value).endswith("no layers")


@pytest.mark.slow
def test_a_server_that_never_gets_healthy_times_out_and_is_killed(tmp_path: Path) -> None:
    command = _fake(tmp_path, "--delay 60")
    said: list[str] = []
    began = time.monotonic()
    with pytest.raises(BenchError, match=r"did not answer 200 on .*/health within --ready-timeout 1 s"), \
            started([command], tmp_path, ready_timeout_s=1, progress=said.append):
        pass
    assert time.monotonic() - began < 30
    assert said[1] == f"waiting up to 1 s for fake to answer 200 on {command.url}/health"


@pytest.mark.slow
def test_a_program_that_does_not_exist_is_a_bench_error(tmp_path: Path) -> None:
    command = ServerCommand.from_template("llama-server", "no-such-program-here -m {model}", model="m", port=9)
    with pytest.raises(BenchError, match=r"cannot start llama-server \(no-such-program-here -m m --port 9\): "):
        Server(command, tmp_path / "x.log")


@pytest.mark.slow
def test_a_port_already_answering_is_refused(tmp_path: Path) -> None:
    command = _fake(tmp_path)
    with started([command], tmp_path, ready_timeout_s=30, progress=lambda _t: None), \
            pytest.raises(BenchError, match=f"something already answers on port {command.port}"), \
            started([command], tmp_path, ready_timeout_s=30, progress=lambda _t: None):
        pass
