"""llama-server's own test suite (llama.cpp's `tools/server/tests/unit/`) run offline on the packaged
model, against llama-server or against `skippy-zmq serve`.

The suite (from the llama-cpp-python sdist, `llama_sources.server_tests_dir()`) is copied into a
run directory beside llama.cpp's `models/` (its templates), and pytest runs it in this process with
the suite's `utils.ServerProcess.start` replaced: every model a test asks for (a Hugging Face repo,
a URL, a file) becomes the packaged Gemma 3 270M, and nothing is downloaded. `--target llama-server`
then starts the real llama-server with the test's options; `--target serve` starts `skippy-zmq serve
--stages 1` with the options that have an equivalent (`SERVE_OPTIONS`) and skips a test that sets
one that has none (`NO_EQUIVALENT`), naming it. The tests' assertions are untouched: with the
packaged model many of them, which expect the text of llama.cpp's tiny test models, fail on
llama-server too; what `--compare` shows is the tests llama-server passes and serve does not.

    python3 -m tools.llama_server_suite --target llama-server --server-dir BUILD/bin --out llama.json
    python3 -m tools.llama_server_suite --target serve --out serve.json
    python3 -m tools.llama_server_suite --compare llama.json serve.json
    python3 -m tools.llama_server_suite --target serve -- unit/test_tokenize.py -k detokenize

Arguments after the options go to pytest (default: `unit/ -m "not slow"`, as the suite's tests.sh).
Printed: passed, failed, skipped and errors per test file; `--out` keeps every test's outcome and
its one-line reason as JSON. Exit status: 0 when the suite ran, 2 when it could not start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import click

from tools._common import EXIT_NOT_STARTED, LlamaServer, ToolError, run_directory, skippy_command

REPO = Path(__file__).resolve().parent.parent
TARGETS = ("llama-server", "serve")
OUTCOMES = ("passed", "failed", "skipped", "error")
TEST_TIMEOUT_S = 300.0
"""A test still running after this is failed and its servers stopped (the suite's own request timeout is 600 s)."""
MODEL_SOURCES = ("model_hf_repo", "model_hf_file", "model_url", "model_file")
NO_EQUIVALENT: dict[str, str] = {
    "lora_files": "--lora",
    "model_draft": "--model-draft", "spec_type": "--spec-type", "enable_ctx_shift": "--context-shift",
    "n_ga": "--grp-attn-n", "slot_save_path": "--slot-save-path",
    "models_dir": "--models-dir",
    "models_preset": "--models-preset", "models_max": "--models-max", "no_models_autoload": "--no-models-autoload",
    "cache_ram": "--cache-ram",
    "no_cache_idle_slots": "--no-cache-idle-slots", "mmproj_url": "--mmproj-url", "media_path": "--media-path",
    "ui_mcp_proxy": "--ui-mcp-proxy", "server_tools": "--tools", "mcp_servers_config": "--mcp-servers-config",
    "mcp_servers_json": "--mcp-servers-json",
    "server_slots": "--slots",
}
"""The suite's server options serve has no equivalent for, with llama-server's flag: a test setting one
is skipped on serve. Options not named here or in SERVE_OPTIONS tune llama-server (threads, batch
sizes, flash attention, GPU layers, the web page): they are not passed."""
SERVE_OPTIONS: dict[str, str] = {
    "server_host": "--host", "server_port": "--port", "n_slots": "--lanes", "n_ctx": "--ctx-size",
    "api_key": "--api-key", "model_alias": "--alias", "model_tags": "--tags", "cors_origins": "--cors-origins",
    "pooling": "--pooling", "ctk": "--cache-type-k", "ctv": "--cache-type-v", "n_threads": "--threads",
    "n_batch": "--prefill-chunk", "seed": "--seed", "temperature": "--temp", "n_predict": "--n-predict",
    "chat_template": "--chat-template", "chat_template_file": "--chat-template-file",
    "reasoning_format": "--reasoning-format", "reasoning": "--reasoning",
    "sleep_idle_seconds": "--sleep-idle-seconds",
}
"""The suite's server options and the `serve` option each becomes (--ctx-size per lane: llama-server's
--ctx-size is shared by its --parallel slots unless --kv-unified)."""
SERVE_FLAGS: dict[str, str] = {"server_reranking": "--reranking", "no_ui": "--no-ui"}
"""The suite's switches and the `serve` flag each turns on."""


@attrs.frozen
class Target:
    """What the suite's servers are: llama-server (its build) or serve, on `model`."""

    name: str
    model: Path
    llama_server: LlamaServer | None = None


def serve_command(server: Any, model: Path) -> list[str]:
    """`skippy-zmq serve` with the equivalents of `server`'s options (a suite ServerProcess); Skipped
    naming the options that have none."""
    import pytest

    refused = [flag for attr, flag in NO_EQUIVALENT.items() if getattr(server, attr, None) not in (None, False, 0, [])]
    if all(getattr(server, attr) is None for attr in MODEL_SOURCES):
        refused.append("the router mode (no model)")
    for attr, allowed in (("pooling", ("mean", "last", "none")), ("ctk", ("f32", "f16")), ("ctv", ("f32", "f16"))):
        if getattr(server, attr) not in (None, *allowed):
            refused.append(f"{SERVE_OPTIONS[attr]} {getattr(server, attr)}")
    if refused:
        pytest.skip(f"serve has no equivalent of llama-server's {', '.join(refused)}")
    command = skippy_command("serve", "--model", str(model), "--stages", "1", "--drain-timeout", "0",
                             "--max-client-requests", "0")
    values = {attr: getattr(server, attr) for attr in SERVE_OPTIONS}
    if values["n_ctx"] and values["n_slots"] and not server.kv_unified:
        values["n_ctx"] = values["n_ctx"] // values["n_slots"]
    for attr, value in values.items():
        if value not in (None, ""):
            command += [SERVE_OPTIONS[attr], str(value)]
    command += [flag for attr, flag in SERVE_FLAGS.items() if getattr(server, attr, False)]
    if getattr(server, "jinja", None):
        command.append("--jinja")
    elif getattr(server, "jinja", None) is False or (server.chat_template and "{" not in server.chat_template):
        # llama-server runs the suite's tests without --jinja (a built-in name renders as its C++ format)
        command.append("--no-jinja")
    if getattr(server, "debug", False):  # llama-server's --verbose: more logs, and `__verbose` in OpenAI answers
        command.append("--verbose")
    return command


def _start_serve(server: Any, model: Path, timeout_seconds: float) -> None:
    """What the suite's `ServerProcess.start` does, with `serve` as the server."""
    import requests
    import utils  # the suite's, on sys.path

    command = serve_command(server, model)
    print(f"tests: starting serve with: {' '.join(command)}")
    server._log = open(server.log_path, "w") if server.log_path else sys.stdout  # noqa: SIM115 - stop() closes it
    env = dict(os.environ)
    if getattr(server, "gcp_compat", False):  # the suite's Vertex AI mode, as it starts llama-server
        env |= {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(server.server_port)}
    server.process = subprocess.Popen(command, stdout=server._log, stderr=server._log, start_new_session=True,
                                      env=env)
    utils.server_instances.add(server)
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(server.make_url("/health"), headers=headers, timeout=5).status_code == 200:
                server.ready = True
                return
        if server.process.poll() is not None:
            raise RuntimeError(f"serve exited with status {server.process.returncode} before /health answered 200")
        time.sleep(0.05)
    raise TimeoutError(f"serve did not answer /health 200 within {timeout_seconds} s")


def patch_suite(utils: types.ModuleType, target: Target) -> None:
    """Replace the suite's server start (and its preset downloads) for `target`."""
    original_start, original_stop = utils.ServerProcess.start, utils.ServerProcess.stop
    router = all(getattr(utils.ServerPreset.router(), attr) is None for attr in MODEL_SOURCES)
    assert router, "the suite's router preset names a model: the router check below would be wrong"

    def start(self: Any, timeout_seconds: float = utils.DEFAULT_HTTP_TIMEOUT) -> None:
        is_router = all(getattr(self, attr) is None for attr in MODEL_SOURCES)
        if target.llama_server is None:
            if not is_router:
                self.model_hf_repo = self.model_hf_file = self.model_url = None
                self.model_file = str(target.model)
            _start_serve(self, target.model, timeout_seconds)
            return
        if not is_router:
            self.model_hf_repo = self.model_hf_file = self.model_url = None
            self.model_file = str(target.model)
            if self.model_draft:
                self.model_draft = str(target.model)
        self.offline = True
        self.server_path = str(target.llama_server.binary)
        original_start(self, timeout_seconds)

    def stop(self: Any) -> None:
        group = self.process.pid if self.process is not None and target.llama_server is None else None
        original_stop(self)
        if group is not None:  # serve's stages, should serve have been killed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)

    utils.ServerProcess.start = start
    utils.ServerProcess.stop = stop
    utils.ServerPreset.load_all = staticmethod(lambda: None)


class _FileLock:
    """The suite's conftest serializes downloads with filelock.FileLock: an flock does the same."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.handle: Any = None

    def __enter__(self) -> _FileLock:
        self.handle = open(self.path, "w")
        fcntl.flock(self.handle, fcntl.LOCK_EX)
        return self

    def __exit__(self, *_: object) -> None:
        self.handle.close()


def _refuse_download(url: str, out: str | None = None) -> str:
    raise RuntimeError(f"offline: the suite's download of {url} is refused (no network here)")


def stub_missing_modules() -> None:
    """`filelock` and `wget`, which the suite imports, where they are not installed."""
    with contextlib.suppress(ImportError):
        import filelock  # noqa: F401
    if "filelock" not in sys.modules:
        sys.modules["filelock"] = types.SimpleNamespace(FileLock=_FileLock)  # type: ignore[assignment]
    with contextlib.suppress(ImportError):
        import wget  # noqa: F401
    if "wget" not in sys.modules:
        sys.modules["wget"] = types.SimpleNamespace(download=_refuse_download)  # type: ignore[assignment]


def copy_suite(directory: Path) -> Path:
    """The suite copied to `directory`/tools/server/tests, with its tmp/ and llama.cpp's models/ three
    levels up, where its tests look for templates: the suite's folder."""
    from skippy_zmq.testing.llama_sources import llama_models_dir, server_tests_dir

    suite = directory / "tools" / "server" / "tests"
    shutil.copytree(server_tests_dir(), suite, dirs_exist_ok=True)
    (suite / "tmp").mkdir(exist_ok=True)  # utils.TMP_DIR, where tests write files (llama.cpp's checkout has it)
    models = directory / "models"
    if not models.exists():
        models.symlink_to(llama_models_dir(), target_is_directory=True)
    return suite


class Recorder:
    """A pytest plugin: every test's outcome and its one-line reason; a test past `timeout_s` is
    interrupted (its servers stopped, so requests in other threads end too)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.tests: dict[str, dict[str, str]] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        """Keep the worst outcome of a test's phases (an error in set-up or tear-down is an error)."""
        if report.passed and report.when != "call":
            return
        outcome = "skipped" if report.skipped else "passed" if report.passed else (
            "failed" if report.when == "call" else "error")
        known = self.tests.get(report.nodeid)
        if known is not None and OUTCOMES.index(known["outcome"]) >= OUTCOMES.index(outcome):
            return
        self.tests[report.nodeid] = {"outcome": outcome, "reason": _reason(report)}

    def pytest_runtest_call(self, item: Any) -> None:
        """Arm the test's alarm (disarmed in pytest_runtest_teardown)."""
        def expire(_signum: int, _frame: Any) -> None:
            import utils

            for server in list(utils.server_instances):
                server.stop()
            raise TimeoutError(f"test still running after {self.timeout_s:g} s: its servers were stopped")

        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s)

    def pytest_runtest_teardown(self, item: Any) -> None:
        """Disarm the alarm."""
        signal.setitimer(signal.ITIMER_REAL, 0)


def _reason(report: Any) -> str:
    """A failure's crash line (the assertion or exception), or a skip's reason, on one line."""
    if report.passed:
        return ""
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple):
        text = str(longrepr[2]).removeprefix("Skipped: ")
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr)
    return " ".join(text.split())[:400]


def per_file(tests: dict[str, dict[str, str]]) -> dict[str, Counter[str]]:
    """Outcome counts by test file."""
    counts: dict[str, Counter[str]] = {}
    for nodeid, test in tests.items():
        counts.setdefault(nodeid.split("::")[0], Counter())[test["outcome"]] += 1
    return counts


def render_counts(target: str, tests: dict[str, dict[str, str]]) -> str:
    """A table: one row per test file, one column per outcome, and the totals."""
    counts = per_file(tests)
    total: Counter[str] = sum(counts.values(), Counter())
    rows = [f"{target}: " + ", ".join(f"{total[o]} {o}" for o in OUTCOMES),
            f"{'file':40} " + " ".join(f"{o:>8}" for o in OUTCOMES)]
    rows += [f"{name:40} " + " ".join(f"{c[o]:>8}" for o in OUTCOMES) for name, c in sorted(counts.items())]
    return "\n".join(rows)


def render_comparison(reference: dict[str, Any], candidate: dict[str, Any]) -> str:
    """Both runs' counts per file, then every test the reference passes and the candidate does not."""
    ref, cand = reference["tests"], candidate["tests"]
    ref_counts, cand_counts = per_file(ref), per_file(cand)
    short = {"passed": "P", "failed": "F", "skipped": "S", "error": "E"}
    rows = [f"{'file':36} {reference['target']:>22} {candidate['target']:>22}"]
    for name in sorted(set(ref_counts) | set(cand_counts)):
        cells = [" ".join(f"{short[o]}{counts.get(name, Counter())[o]}" for o in OUTCOMES)
                 for counts in (ref_counts, cand_counts)]
        rows.append(f"{name:36} {cells[0]:>22} {cells[1]:>22}")
    lost = [(nodeid, cand.get(nodeid, {"outcome": "missing", "reason": ""})) for nodeid, test in sorted(ref.items())
            if test["outcome"] == "passed" and cand.get(nodeid, {}).get("outcome") != "passed"]
    rows.append(f"\n{len(lost)} tests {reference['target']} passes and {candidate['target']} does not:")
    rows += [f"{test['outcome']:8} {nodeid}: {test['reason']}" for nodeid, test in lost]
    return "\n".join(rows)


@contextlib.contextmanager
def _inside(suite: Path) -> Iterator[None]:
    """The suite's folder as the working directory and the first import path, as its tests.sh runs it."""
    before = Path.cwd()
    os.chdir(suite)
    sys.path.insert(0, str(suite))
    try:
        yield
    finally:
        os.chdir(before)
        sys.path.remove(str(suite))


def run_suite(target: Target, directory: Path, pytest_args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run the suite against `target` from a copy in `directory`: {"target", "exit", "tests"}."""
    import pytest

    suite = copy_suite(directory)
    stub_missing_modules()
    recorder = Recorder(timeout_s)
    with _inside(suite):
        import utils

        patch_suite(utils, target)
        args = ["-c", str(suite / "pytest.ini"), "--rootdir", str(suite), "-p", "no:cacheprovider", "-rN",
                *(pytest_args or ["unit/", "-m", "not slow"])]
        status = pytest.main(args, plugins=[recorder])
    return {"target": target.name, "exit": int(status), "tests": recorder.tests}


def _free_port() -> int:
    from skippy_zmq.launch.topology import free_tcp_ports

    return int(free_tcp_ports(1)[0])


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", type=click.Choice(TARGETS), help="The server the suite's tests start.")
@click.option("--server-dir", default=None, help="llama-server's build directory (else $LLAMA_SERVER_DIR, PATH).")
@click.option("--model", default="gemma3-270m-q4_k_m", show_default=True, help="GGUF every test's model becomes.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write every test's outcome here (JSON).")
@click.option("--log-dir", default=None, help="Where the suite is copied (default: a new temporary directory).")
@click.option("--test-timeout", type=click.FloatRange(min=1), default=TEST_TIMEOUT_S, show_default=True,
              help="Seconds a test may run before its servers are stopped and it fails.")
@click.option("--compare", nargs=2, type=click.Path(exists=True, dir_okay=False), default=None,
              help="Two --out files (llama-server's, serve's): counts side by side and what the second loses.")
@click.argument("pytest_args", nargs=-1, type=click.UNPROCESSED)
def main(target: str | None, server_dir: str | None, model: str, out: str | None, log_dir: str | None,
         test_timeout: float, compare: tuple[str, str] | None, pytest_args: tuple[str, ...]) -> None:
    """Run llama-server's test suite against llama-server or serve, offline, on one model."""
    if compare is not None:
        reference, candidate = (json.loads(Path(p).read_text()) for p in compare)
        click.echo(render_comparison(reference, candidate))
        return
    if target is None:
        raise ToolError("give --target (llama-server or serve) or --compare")
    from skippy_zmq.model.catalog import resolve_model

    resolved = resolve_model(model)
    llama_server = LlamaServer.find(server_dir) if target == "llama-server" else None
    if llama_server is not None:
        os.environ.update(llama_server.environment())
    os.environ["PORT"] = str(_free_port())
    # serve runs from the suite's folder: it must import this checkout's package all the same
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    report = run_suite(Target(target, resolved, llama_server), run_directory(log_dir, "llama-server-suite-"),
                       list(pytest_args), test_timeout)
    if out:
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    click.echo(render_counts(target, report["tests"]))
    if report["exit"] not in (0, 1):  # 1: some tests failed, which is the point
        sys.exit(EXIT_NOT_STARTED)


if __name__ == "__main__":
    main()
