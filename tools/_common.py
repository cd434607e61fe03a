"""What the tools share: a server's HTTP routes and /health, the processes a tool
starts and stops (`skippy-zmq up`, `serve`, llama-server), a run's directory and its end (a
summary as text or one JSON object, the exit status), and llama.cpp beside us (llama-server's
command line, llama-cpp-python with plain CPU buffers, a GGUF's F32 copy).

The tools import it (`from tools import _common`); the package never does. Heavy imports
(gguf, llama_cpp, the package's model code) wait inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import json
import os
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
from typing import Any, NoReturn

import attrs
import click

from skippy_zmq.launch.processes import die_with_parent

EXIT_OK, EXIT_FAILED, EXIT_NOT_STARTED, EXIT_INTERRUPTED = 0, 1, 2, 130
"""A campaign's exit statuses: all well, a finding, the run could not start, Ctrl-C or SIGTERM."""
STOP_TIMEOUT_S = 40.0
"""How long a stopped process may take after SIGTERM before it gets SIGKILL."""
LLAMA_SERVER_DIR_ENV = "LLAMA_SERVER_DIR"
"""The variable naming the directory of a llama-server build (the binary and its shared libraries)."""


class ToolError(click.ClickException):
    """A run that could not start or go on: the message says what, with the value and where."""

    exit_code = EXIT_NOT_STARTED


# --- figures ------------------------------------------------------------------------------------


def agreeing_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens equal from the start until the first difference."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def proc_status_kib(pid: int, field: str = "VmRSS") -> int | None:
    """A /proc/PID/status memory field (VmRSS, VmHWM, RssAnon) in KiB; None when unreadable."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


# --- a server over HTTP -------------------------------------------------------------------------


def http_get(url: str, timeout_s: float) -> tuple[int, str]:
    """GET `url`: its status and body; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace")
    except OSError:
        return 0, ""


def post_json(url: str, body: Mapping[str, Any], timeout_s: float) -> tuple[int, Any]:
    """POST `body` as JSON: the status and the answer's JSON (its text when it is not JSON);
    status 0, with the reason, when nothing answered."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, data = int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        status, data = int(exc.code), exc.read()
    except OSError as exc:
        return 0, f"no answer within {timeout_s:g} s: {exc}"
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode(errors="replace")


def wait_healthy(url: str, process: subprocess.Popen[Any], timeout_s: float, *, name: str,
                 log: Path | None = None) -> None:
    """Wait until `url`/health answers 200; ToolError (with the end of `log`) if `process` exits or
    `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while http_get(url + "/health", 5.0)[0] != 200:
        if process.poll() is not None:
            raise ToolError(f"{name} exited with status {process.returncode} before {url}/health answered 200"
                            + _log_tail(log))
        if time.monotonic() > deadline:
            raise ToolError(f"{name}: {url}/health not 200 within {timeout_s:g} s" + _log_tail(log))
        time.sleep(0.05)  # fine enough for the start times tools report


def _log_tail(log: Path | None, lines: int = 15) -> str:
    if log is None or not log.is_file():
        return ""
    return f"; {log} ends:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# --- processes ----------------------------------------------------------------------------------


def skippy_command(*args: str) -> list[str]:
    """`skippy-zmq ARGS` run by this interpreter (from the repository's root: this checkout's package)."""
    return [sys.executable, "-m", "skippy_zmq.cli", *args]


def start(command: Sequence[str], *, log: Path | None = None, pipe_stderr: bool = False,
          env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """Start `command` in a session of its own that gets SIGTERM when this tool dies (Linux): stdin
    closed; stdout and stderr appended to `log` (else dropped), or stderr piped as text lines."""
    sink = log.open("ab") if log is not None else None  # the child keeps its own descriptor
    try:
        return subprocess.Popen(
            list(command), stdin=subprocess.DEVNULL, stdout=sink or subprocess.DEVNULL,
            stderr=subprocess.PIPE if pipe_stderr else sink or subprocess.DEVNULL,
            env=None if env is None else dict(env), text=True, errors="replace", bufsize=1, start_new_session=True,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - one prctl call, resolved before the fork
        )
    finally:
        if sink is not None:
            sink.close()


def stop(process: subprocess.Popen[Any], timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """SIGTERM to the process group `start` made, up to `timeout_s`, then SIGKILL to it; the exit
    status after SIGTERM (None: it had to be killed)."""
    def signal_group(signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum)

    if process.poll() is None:
        signal_group(signal.SIGTERM)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(10)
        return None


@contextlib.contextmanager
def running(command: Sequence[str], *, log: Path | None = None, env: Mapping[str, str] | None = None,
            timeout_s: float = STOP_TIMEOUT_S) -> Iterator[subprocess.Popen[str]]:
    """`start(command)` for the block; stopped at its end, however it ends."""
    process = start(command, log=log, env=env)
    try:
        yield process
    finally:
        stop(process, timeout_s)


def tiny_gemma3(directory: Path) -> Path:
    """The tests' tiny random Gemma 3 (7 layers, sliding window 8), written into `directory`."""
    from skippy_zmq.testing.tiny import write_tiny_model

    return write_tiny_model(directory / "tiny-gemma3.gguf", arch="gemma3", n_layer=7, seed=2, sliding_window=8)


# --- a campaign's run ---------------------------------------------------------------------------


def interrupt_on_sigterm() -> None:
    """SIGTERM from now on raises KeyboardInterrupt, as Ctrl-C: what the tool started is stopped and
    the summary of what ran is printed."""
    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def progress(quiet: bool) -> Callable[[str], None]:
    """Where progress lines go: stderr, or nowhere with `quiet`."""
    return (lambda _text: None) if quiet else (lambda text: click.echo(text, err=True))


def run_directory(log_dir: str | None, prefix: str) -> Path:
    """`log_dir` (made if missing), else a new temporary directory named after the tool."""
    directory = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=prefix))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def finish(report: Mapping[str, Any], render: Callable[[Any], str], *, as_json: bool, directory: Path,
           keep: bool, interrupted: bool, say: Callable[[str], None], kept: str = "the run's logs") -> NoReturn:
    """Print the report (one JSON object, or `render`'s text), remove `directory` when the run was ok
    and not asked to `keep` it (else say where `kept` is), and exit: 130 interrupted, 0 ok, else 1."""
    click.echo(json.dumps(report) if as_json else render(report))
    ok = bool(report["ok"])
    if ok and not keep:
        shutil.rmtree(directory, ignore_errors=True)
    elif not ok:
        say(f"{kept} kept in {directory}")
    sys.exit(EXIT_INTERRUPTED if interrupted else EXIT_OK if ok else EXIT_FAILED)


# --- llama.cpp beside us ------------------------------------------------------------------------


@attrs.frozen
class LlamaServer:
    """A llama-server build: a directory holding the `llama-server` binary and its shared libraries
    (llama-cpp-python's build/bin, or any llama.cpp build)."""

    directory: Path

    @classmethod
    def find(cls, directory: str | os.PathLike[str] | None = None) -> LlamaServer:
        """`directory`, else $LLAMA_SERVER_DIR, else where `llama-server` is on PATH; ToolError naming
        the three when none holds the binary."""
        where = directory or os.environ.get(LLAMA_SERVER_DIR_ENV) or None
        if where is None:
            found = shutil.which("llama-server")
            if found is None:
                raise ToolError(f"no llama-server: give its build directory (--server-dir), set "
                                f"${LLAMA_SERVER_DIR_ENV} to it, or put llama-server on PATH")
            return cls(Path(found).resolve().parent)
        server = cls(Path(where).expanduser())
        if not server.binary.is_file():
            raise ToolError(f"llama-server not found at {server.binary}; --server-dir or ${LLAMA_SERVER_DIR_ENV} "
                            "must name the directory holding it")
        return server

    @property
    def binary(self) -> Path:
        """The llama-server executable."""
        return self.directory / "llama-server"

    def command(self, model: str | os.PathLike[str], port: int, *, threads: int = 2, ctx_size: int = 4096,
                parallel: int = 1, options: Sequence[str] = ()) -> list[str]:
        """llama-server serving `model` on 127.0.0.1:`port` with `threads` threads, `ctx_size` positions over
        `parallel` slots, and `options` after them."""
        return [str(self.binary), "-m", str(model), "-t", str(threads), "-c", str(ctx_size), "-np", str(parallel),
                "--host", "127.0.0.1", "--port", str(port), *options]

    def environment(self) -> dict[str, str]:
        """This process's environment with the build's shared libraries found first."""
        libraries = os.pathsep.join(filter(None, [str(self.directory), os.environ.get("LD_LIBRARY_PATH")]))
        return dict(os.environ, LD_LIBRARY_PATH=libraries)


def llama_cpp_plain_buffers(path: str | os.PathLike[str], n_ctx: int, threads: int = 2, **options: Any) -> Any:
    """llama-cpp-python's `Llama` on `path` with CPU weight buffers only, an F32 KV cache, `threads`
    threads and logits of every position; `options` add to or replace those `Llama` arguments."""
    import llama_cpp.llama_cpp as low
    from llama_cpp import Llama

    # No AMX (or other repacked) weight buffers: a native build's AMX kernels die with an illegal
    # instruction on the Intel machines this project meets (docs/ARCHITECTURE.md, "Kernels"), and
    # the CPU kernels are the ones to compare with. Llama() takes no such argument: set the default.
    default_params = low.llama_model_default_params

    def plain_buffers() -> Any:
        params = default_params()
        params.use_extra_bufts = False
        return params

    arguments = {"n_batch": 512, "n_threads": threads, "n_threads_batch": threads, "type_k": 0, "type_v": 0,
                 "logits_all": True, "verbose": False, **options}
    low.llama_model_default_params = plain_buffers
    try:
        return Llama(model_path=str(path), n_ctx=n_ctx, **arguments)
    finally:
        low.llama_model_default_params = default_params


def write_f32_copy(src: Path, dst: Path) -> None:
    """Write `dst`: `src` with every tensor dequantized to F32 and all metadata copied."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # header fields and the architecture are written by GGUFWriter itself
        value_type = field.types[0]
        if name == "general.alignment":
            writer.data_alignment = int(field.contents())  # the key alone would not move the data
        if name == "general.file_type":
            writer.add_key_value(name, int(gguf.LlamaFileType.ALL_F32), value_type)
        elif value_type == gguf.GGUFValueType.ARRAY:
            sub_type = field.types[-1]
            if sub_type == gguf.GGUFValueType.STRING:
                # Raw bytes: a vocab entry need not be valid UTF-8.
                items: list[Any] = [bytes(field.parts[i]) for i in field.data]
            else:
                items = field.contents()
            writer.add_key_value(name, items, value_type, sub_type=sub_type)
        elif value_type == gguf.GGUFValueType.STRING:
            writer.add_key_value(name, bytes(field.parts[-1]), value_type)
        else:
            writer.add_key_value(name, field.contents(), value_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        # (..., ne0) in numpy order; GGUFWriter reverses it back to ggml's ne.
        values = values.reshape(tuple(int(d) for d in reversed(tensor.shape.tolist())))
        writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def f32_copy(model: Path, directory: Path | None = None, say: Callable[[str], None] | None = None) -> Path:
    """`model`'s F32 copy (`write_f32_copy`) in `directory` (default: the model cache,
    $SKIPPY_ZMQ_CACHE or ~/.cache/skippy-zmq), written on first use."""
    from skippy_zmq.model.catalog import cache_dir

    say = say or progress(quiet=False)
    target = (directory or cache_dir()) / (model.stem + "-f32.gguf")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        say(f"writing {target} (every tensor of {model.name} dequantized to F32)")
        started = time.perf_counter()
        scratch = target.with_suffix(f".{os.getpid()}.tmp")
        write_f32_copy(model, scratch)
        scratch.replace(target)
        say(f"wrote {target} ({target.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - started:.1f} s")
    return target
