"""Serving processes a benchmark starts: their command lines (`skippy-zmq serve`, a llama-server command
with `{model}` and `{port}`), each in a process group of its own with a log file, `/health` awaited
within a bound, and stopped (SIGTERM, then SIGKILL) whatever happens."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import attrs

from skippy_zmq.errors import BenchError

HEALTH_POLL_S = 0.2
"""Between two `/health` probes."""
PROBE_TIMEOUT_S = 2.0
"""One `/health` probe: a server that takes longer is not ready."""
STOP_GRACE_S = 30.0
"""How long a server may drain after SIGTERM before it is killed; as long again for the kill."""
LOG_TAIL_LINES = 20
"""Lines of a server's log an error quotes."""
CLI = (sys.executable, "-m", "skippy_zmq.cli")
"""This interpreter's `skippy-zmq`: the package it runs."""


@attrs.frozen
class ServerCommand:
    """A serving command line: a name for tables, its argv, the port its `/health` answers on and the
    address that reaches it (loopback unless given)."""

    name: str
    argv: tuple[str, ...]
    port: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        """The base URL (without /v1)."""
        return f"http://{self.host}:{self.port}"

    @property
    def shown(self) -> str:
        """The command line as a user would type it (this interpreter's module run shown as `skippy-zmq`,
        also behind a prefix such as `ip netns exec NS`)."""
        argv = self.argv
        for at in range(len(argv) - len(CLI) + 1):
            if argv[at:at + len(CLI)] == CLI:
                argv = (*argv[:at], "skippy-zmq", *argv[at + len(CLI):])
                break
        return shlex.join(argv)

    @classmethod
    def skippy_serve(cls, serve_args: str, *, port: int, model: str | None) -> ServerCommand:
        """`skippy-zmq serve SERVE_ARGS [--model MODEL] --port PORT`, by this interpreter."""
        model_args = ("--model", model) if model is not None else ()
        return cls("serve", (*CLI, "serve", *_split(serve_args, "--serve-args"), *model_args, "--port", str(port)),
                   port)

    @classmethod
    def from_template(cls, name: str, template: str, *, model: str, port: int) -> ServerCommand:
        """A command line given as text: `{model}` and `{port}` substituted in every word; `--port PORT`
        appended when it names no port (one it names itself is the port awaited)."""
        words = _split(template, f"the {name} command line")
        argv = [word.replace("{model}", model).replace("{port}", str(port)) for word in words]
        if not argv:
            raise BenchError(f"the {name} command line is empty")
        named = _named_port(argv, name)
        if named is None:
            argv += ["--port", str(port)]
        return cls(name, tuple(argv), port if named is None else named)


def _split(text: str, what: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:  # an unclosed quote
        raise BenchError(f"{what} {text!r} cannot be split into words: {exc}") from None


def _named_port(argv: Sequence[str], name: str) -> int | None:
    """The port `--port N` or `--port=N` names in argv, else None."""
    for index, word in enumerate(argv):
        value = argv[index + 1] if word == "--port" and index + 1 < len(argv) else None
        if word.startswith("--port="):
            value = word.removeprefix("--port=")
        if value is not None:
            if not value.isdigit() or not 0 < int(value) < 65536:
                raise BenchError(f"the {name} command line names port {value!r}; expected 1..65535 or {{port}}")
            return int(value)
    return None


def http_status(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> int:
    """The HTTP status of GET `url`; 0 when nothing answered within `timeout_s`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:  # refused, reset, timed out
        return 0


class Server:
    """One started server: its own process group (so its children stop with it) and its log file."""

    def __init__(self, command: ServerCommand, log_path: Path, *, env: Mapping[str, str] | None = None) -> None:
        self.command = command
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        try:
            self.process = subprocess.Popen(command.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            env=dict(env) if env is not None else None)
        except OSError as exc:  # no such program, not executable
            self._log.close()
            raise BenchError(f"cannot start {command.name} ({command.shown}): {exc}") from None
        self.started = time.monotonic()

    def wait_healthy(self, timeout_s: float, progress: Callable[[str], None], *,
                     poll_s: float = HEALTH_POLL_S, companions: Sequence[Server] = ()) -> float:
        """Wait until `/health` answers 200 (probed every `poll_s`); returns the seconds since the start.
        BenchError with the log's tail when the process, or one of the `companions` it needs (a
        gateway's stages), exits first or `timeout_s` passes."""
        health = f"{self.command.url}/health"
        progress(f"waiting up to {timeout_s:g} s for {self.command.name} to answer 200 on {health}")
        deadline = self.started + timeout_s
        while True:
            if self.process.poll() is not None:
                raise self.failure(f"exited with status {self.process.returncode} before {health} answered 200")
            for other in companions:
                if other.process.poll() is not None:
                    raise other.failure(f"exited with status {other.process.returncode} before {self.command.name} "
                                        f"answered 200 on {health}")
            if http_status(health) == 200:
                return time.monotonic() - self.started
            if time.monotonic() >= deadline:
                raise self.failure(f"did not answer 200 on {health} within --ready-timeout {timeout_s:g} s")
            time.sleep(poll_s)

    def check_alive(self) -> None:
        """BenchError with the log's tail when the server has exited."""
        if self.process.poll() is not None:
            raise self.failure(f"exited with status {self.process.returncode} during the benchmark")

    def failure(self, what: str) -> BenchError:
        """An error naming the server, its command line and what went wrong, with its log's tail."""
        return BenchError(f"{self.command.name} ({self.command.shown}) {what}; the last lines of its log "
                          f"{self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the log (`(empty)` when it has none)."""
        self._log.flush()
        try:
            text = self.log_path.read_bytes().decode("utf-8", errors="replace")
        except OSError as exc:
            return f"(unreadable: {exc})"
        return "\n".join(text.splitlines()[-lines:]) or "(empty)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`, reap the process; close the log."""
        try:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if self.process.poll() is not None:
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(grace_s)
            # the group outlives its leader when a child ignored the leader's end: nothing may stay
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        finally:
            self._log.close()


@contextlib.contextmanager
def log_directory() -> Iterator[Path]:
    """A directory for the servers' logs: kept when the block fails with a BenchError, so the log its
    message names is still there to read; removed otherwise."""
    path = Path(tempfile.mkdtemp(prefix="skippy-bench-"))
    try:
        yield path
    except BenchError:
        raise  # its message may name a log in here
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def started(commands: Sequence[ServerCommand], log_dir: Path, *, ready_timeout_s: float,
            progress: Callable[[str], None], env: Mapping[str, str] | None = None) -> Iterator[list[Server]]:
    """Start the commands one at a time, each healthy before the next (two loads at once would slow
    both starts); every one started is stopped at the end, whatever ends the block."""
    servers: list[Server] = []
    try:
        for command in commands:
            if http_status(f"{command.url}/health") != 0:
                raise BenchError(f"something already answers on port {command.port}, where {command.name} "
                                 f"({command.shown}) would serve; stop it or give the command another port")
            progress(f"starting {command.name}: {command.shown}")
            servers.append(Server(command, log_dir / f"{command.name}.log", env=env))
            ready_s = servers[-1].wait_healthy(ready_timeout_s, progress)
            progress(f"{command.name} ready in {ready_s:.1f} s")
        yield servers
    finally:
        for server in servers:
            server.stop()
