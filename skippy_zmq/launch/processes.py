"""Start, watch and stop local worker processes: one per stage, all started at once."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from skippy_zmq import defaults
from skippy_zmq.config import TopologyConfig
from skippy_zmq.errors import StageError, StageTimeout
from skippy_zmq.launch.supervisor import GiveUp, Kill, RestartPolicy, StageStatus, Start, Supervisor
from skippy_zmq.launch.topology import blas_threads_per_stage, check_topology_memory, has_experts, launch_threads
from skippy_zmq.telemetry import parse_event, plain_line

READY_TIMEOUT_S = defaults.READY_TIMEOUT_S
STOP_TIMEOUT_S = 15.0
# OpenBLAS threads spin for 2^THREAD_TIMEOUT cycles after a call before they sleep (default 28,
# about 0.1 s): on a shared host an idle stage's spinning threads take the cores the busy stage
# needs. 2^4 cycles: they sleep at once and wake on the next call's signal.
BLAS_THREAD_TIMEOUT = "4"
# ggml's threads (OpenMP in llama-cpp-python's build, GCC's libgomp) meet at a barrier after every
# operation of a graph. GOMP's default spins 300,000 times (about 3 ms) there and after each graph
# before it sleeps, so two stages busy at once on shared cores fought spinning threads (12B-shaped
# file, 4 stages on 2 cores, 4 clients: first token 23.2 s against 6.1 s with PASSIVE). PASSIVE
# sleeps at once, but then every barrier is a futex wake-up: a 270M decode step 16 % longer. 20,000
# spins (about 0.2 ms) catch the barriers of a busy graph and still let an idle stage sleep
# (docs/BENCHMARKS.md, "OpenMP's spinning").
GOMP_SPINCOUNT = "20000"
# An expert layer's graph is many short products (each selected expert's rows); sleeping after 2,000
# spins (about 20 µs) leaves the cores to the other stages and the gateway sooner. A Qwen3-30B-A3B-shaped
# file over 4 stages served 4 clients 3-8 % faster with it and 1 client 0-2 %; the 12B-shaped dense file
# lost 6 % (docs/BENCHMARKS.md, "OpenMP's spinning").
EXPERT_GOMP_SPINCOUNT = "2000"
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""Variables that say how OpenMP threads wait; when the environment sets one, it is left alone."""


def openmp_wait_environment(environ: Mapping[str, str], *, experts: bool = False) -> dict[str, str]:
    """The variables a local pipeline adds to its stages' environment for OpenMP's waiting: the
    bounded spin above (shorter for a file with expert layers), unless `environ` already says how
    OpenMP threads wait."""
    if any(name in environ for name in OPENMP_VARIABLES):
        return {}
    return {"GOMP_SPINCOUNT": EXPERT_GOMP_SPINCOUNT if experts else GOMP_SPINCOUNT}


_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[[int, int], int] | None:
    try:
        prctl: Callable[[int, int], int] = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux/glibc: stages outlive a killed launcher there
    return prctl


_PRCTL = _load_prctl()


def die_with_parent() -> None:
    """In the child before exec (`preexec_fn`): get SIGTERM when the launcher dies, however it dies (Linux).

    The libc function is resolved in the parent, so the child makes one system call and
    touches no lock another thread of the parent might have held at fork time. Elsewhere it
    does nothing: the child outlives a killed launcher there.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


class StageProcess:
    """One worker subprocess and the thread that relays (and watches) its log lines."""

    def __init__(self, topology_path: Path, stage_id: str, log_sink: IO[str] | None,
                 threads: int | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 env: dict[str, str] | None = None, ready_file: Path | None = None,
                 render: Callable[[str, dict[str, Any] | None], str | None] | None = None,
                 check_tensors: bool = False) -> None:
        """`check_tensors` starts it with `--check-tensors`. `render` turns each line the worker
        writes (and its event, if it is one) into the line the sink gets, or None to leave it out
        (default: the line as it came)."""
        self.stage_id = stage_id
        self._render = render
        self._on_event = on_event
        self.ready_file = ready_file
        self.started_at = time.monotonic()
        command = [
            sys.executable, "-m", "skippy_zmq.cli", "worker",
            "--topology", str(topology_path), "--stage", stage_id, "--log-json",  # parsed here, rendered by `render`
        ]
        if ready_file is not None:  # the worker touches it at every heartbeat
            command += ["--ready-file", str(ready_file)]
        if threads is not None:
            command += ["--threads", str(threads)]
        if check_tensors:
            command.append("--check-tensors")
        self.process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - one prctl call, resolved before the fork
        )
        self.ready = threading.Event()
        self.ready_at: float | None = None
        self._beat_seen: tuple[int, float] | None = None  # (ready file mtime, when it was first seen)
        self.exited_at: float | None = None  # when a status first saw it exited
        self._stop_sent = False
        self.last_error: str | None = None
        self.lines: list[str] = []
        self._sink = log_sink
        self._thread = threading.Thread(target=self._relay, name=f"log-{stage_id}", daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))
            del self.lines[:-200]
            event = parse_event(line)
            # Relay first, then signal: a launcher's own "ready" line never precedes the stage's.
            shown = line if self._render is None else self._render(line, event)
            if self._sink is not None and shown is not None:
                try:
                    self._sink.write(shown if shown.endswith("\n") else shown + "\n")
                    self._sink.flush()
                except (OSError, ValueError):
                    self._sink = None  # keep draining: a full pipe would block the worker
            if event is None:
                continue
            if event.get("event") == "fatal":
                self.last_error = str(event.get("error"))
            if self._on_event is not None:
                with contextlib.suppress(Exception):  # a progress printer must not stop the relay
                    self._on_event(event)
            if event.get("event") == "ready":
                self.ready_at = time.monotonic()
                self.ready.set()

    @property
    def pid(self) -> int:
        """Process id."""
        return self.process.pid

    def exit_code(self) -> int | None:
        """Exit status, or None while running."""
        return self.process.poll()

    def describe_exit(self) -> str:
        """`stage-1 (pid 123) exited with status -9 (SIGKILL)` plus its last error, if known."""
        code = self.process.poll()
        text = f"{self.stage_id} (pid {self.pid}) exited with status {code}"
        if code is not None and code < 0:
            text += f" ({signal.Signals(-code).name})"
        if self.last_error:
            text += f": {self.last_error}"
        elif self.lines:
            text += f"; last output: {self.lines[-1][:300]}"
        return text

    def beat_age_s(self) -> float | None:
        """Seconds since the worker's ready file last changed (it is touched at every heartbeat),
        on this process's monotonic clock, so a wall-clock step cannot make a stage look frozen;
        None before the first beat."""
        if self.ready_file is None:
            return None
        try:
            mtime = self.ready_file.stat().st_mtime_ns
        except OSError:
            return None if self._beat_seen is None else time.monotonic() - self._beat_seen[1]
        if self._beat_seen is None or self._beat_seen[0] != mtime:
            self._beat_seen = (mtime, time.monotonic())
        return time.monotonic() - self._beat_seen[1]

    def status(self) -> StageStatus:
        """What a `Supervisor` needs to know of this process now."""
        exited = self.process.poll() is not None
        if exited and self.exited_at is None:
            self.exited_at = time.monotonic()
        ready_for = None if self.ready_at is None else (self.exited_at or time.monotonic()) - self.ready_at
        return StageStatus(exited=exited, ready=self.ready.is_set(), started_at=self.started_at,
                           beat_age_s=self.beat_age_s(), exit_text=self.describe_exit() if exited else "",
                           ready_for_s=ready_for)

    def kill(self) -> None:
        """SIGKILL (a frozen process does not act on SIGTERM)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def request_stop(self) -> None:
        """Send SIGTERM once (a stage finishes the message in hand and exits 0)."""
        if self.process.poll() is None and not self._stop_sent:
            self._stop_sent = True
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (unless already sent), wait, then SIGKILL; returns the exit status."""
        self.request_stop()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(5)
        self._thread.join(2)
        return self.process.returncode if self.process.returncode is not None else -signal.SIGKILL


PROGRESS_EVENTS = frozenset({"loading", "load_progress", "loaded", "ready", "fatal"})
"""Worker events a launcher's progress reports in its own words (`_ProgressRelay`)."""


def render_worker_line(stage_id: str, line: str, event: dict[str, Any] | None, *, json_lines: bool,
                       progress_shown: bool) -> str | None:
    """The line a launcher relays for one line of a worker's (JSON) log: the JSON itself with
    `json_lines`, else a plain line; None for an event progress already reports (plain only), so
    nothing is said twice. Text a worker wrote outside its log (a traceback) is wrapped as an
    `output` event in JSON, and passed as it is in plain."""
    if json_lines:
        if event is not None:
            return line
        record = {"ts": round(time.time(), 6), "component": stage_id, "event": "output", "line": line.rstrip("\n")}
        return json.dumps(record, ensure_ascii=False)
    if event is None:
        return line
    if progress_shown and event.get("event") in PROGRESS_EVENTS:
        return None
    return plain_line(event)


class _ProgressRelay:
    """Turns a stage's load events into progress lines, at most one detail line a second."""

    def __init__(self, stage_id: str, say: Callable[[str], None], interval_s: float = 1.0) -> None:
        self.stage_id = stage_id
        self.say = say
        self.interval_s = interval_s
        self._last = -interval_s

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "loading":
            layers = event.get("layers") or ["?", "?"]
            self._last = time.monotonic()  # the next detail line says the same
            types = event.get("cache_types")
            cache = f", KV cache keys {types[0]} values {types[1]}" if isinstance(types, list) and len(types) == 2 \
                else ""
            self.say(f"{self.stage_id}: loading layers {layers[0]}..{layers[1]} of {event.get('model')}{cache}")
        elif kind == "load_progress":
            now = time.monotonic()
            if now - self._last >= self.interval_s:
                self._last = now
                self.say(f"{self.stage_id}: {event.get('detail')}")
        elif kind == "loaded":
            self.say(f"{self.stage_id}: loaded in {event.get('seconds')} s")
        elif kind == "fatal":
            self.say(f"{self.stage_id}: failed: {event.get('error')}")


class LocalPipeline:
    """All stages of a topology as local processes; a context manager that always cleans up."""

    def __init__(
        self,
        topology_path: str | os.PathLike[str],
        *,
        log_sink: IO[str] | None = None,
        progress: Callable[[str], None] | None = None,
        threads: int | None = None,
        log_json: bool = False,
        check_tensors: bool = False,
        host: str | None = None,
    ) -> None:
        """Stages of the topology at `topology_path` (with `host`, only those that run on that host:
        ConfigError naming the file's hosts when none does); `threads` BLAS threads each (default: as
        write_local_topology recorded, else blas_threads_per_stage for stages taking turns);
        `check_tensors` makes every stage (and every restart) scan its tensors at load.
        The workers' lines reach `log_sink` as JSON with `log_json`, else as plain lines, leaving
        out the load events `progress` reports in its own words."""
        self.topology_path = Path(topology_path)
        self.topology = TopologyConfig.from_toml(self.topology_path)
        self.stages = self.topology.stages if host is None else self.topology.stages_on(host)
        if threads is None:
            threads = launch_threads(self.topology_path)
        if threads is None:
            threads = blas_threads_per_stage(len(self.stages))  # the stages this host runs share its cores
        self.threads = threads
        self.log_sink = log_sink
        self.progress = progress
        self.log_json = log_json
        self.check_tensors = check_tensors
        self.processes: list[StageProcess] = []
        self._say_lock = threading.Lock()
        self._env: dict[str, str] = {}
        self._beats: Path | None = None  # one ready file per stage, made by spawn()
        self._spawned_at = 0.0

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start every stage at once and wait, within one deadline, until all are ready.

        Order does not matter: a stage connects its PUSH socket to the next one lazily
        (ZeroMQ queues until the peer binds), so loading overlaps across stages.
        """
        self.spawn()
        self.wait_ready(ready_timeout_s)

    def spawn(self) -> None:
        """Start every stage's process without waiting for them (`wait_ready` waits); first check that
        every stage's memory estimate fits its limit (ConfigError naming the stage, nothing started)."""
        estimates = check_topology_memory(self.topology, self.stages)
        for stage, estimate in zip(self.stages, estimates, strict=True):
            self._say(f"{stage.label}: memory estimate {estimate.describe()}")
        self._spawned_at = time.monotonic()
        self._beats = Path(tempfile.mkdtemp(prefix="skippy-zmq-beats-"))
        self._env = dict(os.environ)
        self._env.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)
        self._env.update(openmp_wait_environment(self._env, experts=has_experts(self.topology)))
        # The stage with the most weights to bind starts first (a final stage's head: the longest
        # load), so the others' loading overlaps it; `processes` stays in topology order.
        order = sorted(range(len(estimates)), key=lambda i: -estimates[i].weights)
        started: dict[int, StageProcess] = {}
        try:
            for index in order:
                stage = self.stages[index]
                self._say(f"starting {stage.label}")
                started[index] = self._spawn(stage.stage_id)
                self.processes[:] = [started[i] for i in sorted(started)]
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until every spawned stage is ready, within `ready_timeout_s` of `spawn`; stops them
        all on a failure (StageError when one exits, StageTimeout naming those still loading)."""
        try:
            self._wait_all_ready(self._spawned_at, ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, stage_id: str) -> StageProcess:
        assert self._beats is not None, "start() makes the heartbeat files' directory"
        return StageProcess(self.topology_path, stage_id, self.log_sink, self.threads,
                            # JSON lines relayed carry the load events themselves: no progress for them.
                            on_event=None if self.log_json and self.log_sink is not None
                            else _ProgressRelay(stage_id, self._say), env=self._env,
                            ready_file=self._beats / f"{stage_id}.ready",
                            render=functools.partial(render_worker_line, stage_id, json_lines=self.log_json,
                                                     progress_shown=self.progress is not None),
                            check_tensors=self.check_tensors)

    def _say(self, text: str) -> None:
        if self.progress is not None:
            with self._say_lock:  # relay threads of several stages report at once
                self.progress(text)

    def _wait_all_ready(self, started: float, timeout_s: float) -> None:
        """Block until every stage is ready; StageError when one exits, StageTimeout naming the
        stages still loading when `timeout_s` has passed."""
        deadline = started + timeout_s
        waiting = list(self.processes)
        while waiting:
            for process in list(waiting):
                if process.ready.is_set():
                    waiting.remove(process)
                    self._say(f"{process.stage_id} ready (pid {process.pid}, "
                              f"{time.monotonic() - started:.1f} s)")
                elif process.exit_code() is not None:
                    process._thread.join(2)
                    raise StageError(f"stage failed to start: {process.describe_exit()}")
            if not waiting:
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"{p.stage_id} (pid {p.pid})" for p in waiting)
                raise StageTimeout(f"not ready after {timeout_s:.0f} s: {names}")
            waiting[0].ready.wait(0.1)

    def dead(self) -> list[StageProcess]:
        """Stages whose process has exited."""
        return [p for p in self.processes if p.exit_code() is not None]

    def stop(self) -> dict[str, int]:
        """Stop every stage (SIGTERM to all, then wait, then SIGKILL); exit status per stage id.

        Signals that would interrupt the teardown are held until it is done, so no stage is
        left running behind an impatient second Ctrl-C.
        """
        held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            for process in self.processes:
                process.request_stop()  # all at once, then wait: one signal per stage
            return {p.stage_id: p.terminate() for p in self.processes}
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            if self._beats is not None:
                shutil.rmtree(self._beats, ignore_errors=True)

    def supervise(
        self, should_stop: Callable[[], bool], policy: RestartPolicy | None = None, poll_s: float = 0.25
    ) -> str | None:
        """Block until `should_stop()` or supervision gives up; returns why it gave up, if it did.

        Without `policy`, the first stage that dies ends it. With one, a stage that dies or
        stops heartbeating is killed and restarted with backoff while the others keep
        running (docs/ARCHITECTURE.md, Supervision)."""
        supervisor = Supervisor([p.stage_id for p in self.processes], policy or RestartPolicy(max_restarts=0))
        restarted: set[StageProcess] = set()  # not yet announced ready
        while not should_stop():
            for process in [p for p in restarted if p.ready.is_set()]:
                restarted.discard(process)
                self._say(f"{process.stage_id} ready (pid {process.pid}, "
                          f"{time.monotonic() - process.started_at:.1f} s after its restart)")
            status: dict[str, StageStatus] = {p.stage_id: p.status() for p in self.processes}
            for command in supervisor.step(time.monotonic(), status):
                if isinstance(command, GiveUp):
                    return f"{command.stage_id}: {command.reason}"
                index = next(i for i, p in enumerate(self.processes) if p.stage_id == command.stage_id)
                if isinstance(command, Kill):
                    self._say(f"{command.stage_id}: killing pid {self.processes[index].pid}: {command.reason}")
                    self.processes[index].kill()
                elif isinstance(command, Start):
                    self.processes[index].terminate(0.0)  # reaped; its relay thread drained
                    self._say(f"{command.stage_id}: restarting (restart {command.attempt} within "
                              f"{supervisor.policy.window_s:g} s) after: {command.reason}")
                    self.processes[index] = self._spawn(command.stage_id)
                    restarted.add(self.processes[index])
            time.sleep(poll_s)
        return None

    def __enter__(self) -> LocalPipeline:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


