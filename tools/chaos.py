"""Chaos under `skippy-zmq up`: kill -9 (or SIGSTOP) a random stage once in each of N generations.

The tool writes its own loopback topology (the planner's cut of the model, free ports), starts
`skippy-zmq up` on it as a subprocess and drives the pipeline itself. First N generations run
uninterrupted (fixed prompts, greedy or seeded sampling, `ignore_eos` so every one runs
`--max-tokens` tokens): their texts are the references. Then the same N generations run again,
each hit once: after a random number of streamed text pieces (at least one, fewer than the
reference streamed), a random stage gets SIGKILL (`--fault kill`), SIGSTOP (`--fault stop`:
`up` sees its heartbeats stop, kills and restarts it) or either (`--fault mixed`), all drawn
from `--seed`. `up` restarts the stage; the driver notices (a new incarnation in the stage's
heartbeat, or silence), waits for it and replays the session (docs/PROTOCOL.md §6).

    python3 -m tools.chaos                                   # Gemma 3 270M, 3 stages, 20 x kill -9
    python3 -m tools.chaos --fault stop -n 10
    python3 -m tools.chaos --model tiny --stages 2 -n 3 --json
    python3 -m tools.chaos --seeded --seed 7 --fault mixed

For each generation: whether the completed text (and tokens) equal the reference, the replays
the driver made, and kill-to-next-token: from the signal to the next text piece streamed, with
its parts as `up` reported them (the signal to `up`'s "restarting" line, to the new process's
"ready" line). The summary adds the restarts `up` reported and `up`'s exit status after SIGTERM
(0 expected).

Exit status: 0 when every generation was identical and `up` exited 0, 1 otherwise, 2 when the
run could not start, 130 when interrupted (the summary of what ran is printed either way).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import click

from skippy_zmq.bench.clients import PROMPTS as BENCH_PROMPTS
from skippy_zmq.bench.report import percentile
from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.driver.lanes import Finished, Text
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.errors import ConfigError, SkippyError, StageError, StageTimeout
from skippy_zmq.tokens.sampling import SamplingParams
from tools._common import (
    EXIT_INTERRUPTED,
    EXIT_NOT_STARTED,
    finish,
    interrupt_on_sigterm,
    progress,
    run_directory,
    skippy_command,
    start,
    stop,
    tiny_gemma3,
)

PROMPTS = (
    *BENCH_PROMPTS,  # the serving benchmark's eight, then more: one generation each
    "The three primary colors are",
    "Water boils at a temperature of",
    "The capital of France is",
    "def fibonacci(n):",
    "The planets of the solar system, in order, are",
    "A good teacher is someone who",
    "The old lighthouse keeper opened the door and",
    "To make a paper airplane, you",
    "The first rule of the mountain is",
    "Dear diary, today I learned that",
    "The difference between weather and climate is",
    "In the year 2050, cities will",
)
FAULT_SIGNALS: dict[str, tuple[str, ...]] = {
    "kill": ("SIGKILL",),
    "stop": ("SIGSTOP",),
    "mixed": ("SIGKILL", "SIGSTOP"),
}
"""The signals each `--fault` choice draws from."""
SEEDED_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, ignore_eos=True)
UP_STOP_TIMEOUT_S = 60.0
REPLACED_TIMEOUT_S = 120.0
"""How long a hit stage may take to be running again before the next generation (then it fails)."""


# --- the fault schedule (pure) ------------------------------------------------------------------


@attrs.frozen
class Fault:
    """One generation's fault: which stage gets which signal after how many streamed pieces."""

    generation: int
    stage_index: int
    after_pieces: int
    signal_name: str

    @property
    def signum(self) -> signal.Signals:
        """The signal to send."""
        return signal.Signals[self.signal_name]


def fault_schedule(seed: int, pieces: Sequence[int], n_stages: int, fault: str) -> list[Fault]:
    """One fault per generation, a pure function of `seed`: a stage, a point after 1 up to
    (pieces the reference streamed - 1) pieces, so a piece always follows, and a signal."""
    if fault not in FAULT_SIGNALS:
        raise ConfigError(f"fault {fault!r} must be one of {', '.join(FAULT_SIGNALS)}")
    if n_stages < 1:
        raise ConfigError(f"n_stages {n_stages} must be >= 1")
    rng = random.Random(seed)
    schedule = []
    for generation, count in enumerate(pieces):
        stage_index = rng.randrange(n_stages)
        after = rng.randint(1, max(1, count - 1))
        name = rng.choice(FAULT_SIGNALS[fault])
        schedule.append(Fault(generation, stage_index, after, name))
    return schedule


# --- trials and their summary (pure) ------------------------------------------------------------


@attrs.frozen
class Trial:
    """What happened to one faulted generation."""

    fault: Fault
    identical: bool
    replays: int
    error: str | None = None
    hit: bool = False  # the signal was sent
    pid: int = 0
    kill_to_next_s: float | None = None  # signal -> next text piece
    to_restart_s: float | None = None  # signal -> up's "restarting" line
    to_ready_s: float | None = None  # signal -> up's "ready" line of the new process
    restarts: int = 0  # restart lines up printed during the generation
    seconds: float = 0.0
    tokens: int = 0

    def as_json(self) -> dict[str, Any]:
        """The trial as a JSON object."""
        return attrs.asdict(self, recurse=False) | {"fault": attrs.asdict(self.fault)}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _quantile(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _spread(values: Sequence[float]) -> dict[str, float | int | None]:
    return {"p50": _rounded(_quantile(values, 0.5)), "p90": _rounded(_quantile(values, 0.9)),
            "max": _rounded(max(values, default=None)), "count": len(values)}


def summarize(trials: Sequence[Trial], *, restarts_seen: int, up_exit: int | None,
              settings: dict[str, Any], interrupted: bool = False,
              restarts_by_stage: dict[str, int] | None = None) -> dict[str, Any]:
    """The run's summary: counts, failures with their errors, kill-to-next-token percentiles and
    their two parts (signal to up's restart line: detection and backoff; restart line to the
    next token: start, load, the driver noticing, the replay)."""
    times = [t.kill_to_next_s for t in trials if t.kill_to_next_s is not None]
    to_restart = [t.to_restart_s for t in trials if t.to_restart_s is not None]
    after_restart = [t.kill_to_next_s - t.to_restart_s for t in trials
                     if t.kill_to_next_s is not None and t.to_restart_s is not None]
    failures = [
        {"generation": t.fault.generation, "stage_index": t.fault.stage_index, "signal": t.fault.signal_name,
         "after_pieces": t.fault.after_pieces, "replays": t.replays,
         "error": t.error or ("text differs from the uninterrupted run" if t.hit else "the stage was never hit")}
        for t in trials if not t.identical
    ]
    identical = sum(t.identical for t in trials)
    return {
        **settings,
        "generations": len(trials),
        "identical": identical,
        "failures": failures,
        "replays": sum(t.replays for t in trials),
        "kill_to_next_token_s": _spread(times),
        "kill_to_restart_line_s": _spread(to_restart),
        "restart_line_to_next_token_s": _spread(after_restart),
        "restarts_seen": restarts_seen,
        "restarts_by_stage": dict(restarts_by_stage or {}),
        "up_exit": up_exit,
        "interrupted": interrupted,
        "ok": not interrupted and bool(trials) and identical == len(trials) and up_exit == 0,
        "trials": [t.as_json() for t in trials],
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _spread_text(spread: dict[str, Any]) -> str:
    return f"p50 {_seconds(spread['p50'])}, p90 {_seconds(spread['p90'])}, max {_seconds(spread['max'])}"


def render(summary: dict[str, Any]) -> str:
    """The summary for a human."""
    k2n = summary["kill_to_next_token_s"]
    lines = [
        f"chaos: {summary['model']}, {summary['stages']} stages, fault {summary['fault']}, "
        f"{summary['sampling']} sampling, {summary['max_tokens']} tokens, seed {summary['seed']}",
        f"  identical       {summary['identical']}/{summary['generations']}"
        + (" (interrupted)" if summary["interrupted"] else ""),
        f"  replays         {summary['replays']}",
        f"  kill-to-next    {_spread_text(k2n)} ({k2n['count']} measured)",
        f"    of which      signal -> up's restart line {_spread_text(summary['kill_to_restart_line_s'])}; "
        f"restart line -> next token {_spread_text(summary['restart_line_to_next_token_s'])}",
        f"  restarts seen   {summary['restarts_seen']}"
        + "".join(f", {sid} {n}" for sid, n in sorted(summary["restarts_by_stage"].items())),
        f"  up exit status  {summary['up_exit']} after SIGTERM",
    ]
    for failure in summary["failures"]:
        lines.append(f"  FAILED generation {failure['generation']} ({failure['signal']} to stage "
                     f"{failure['stage_index']} after {failure['after_pieces']} pieces, "
                     f"{failure['replays']} replays): {failure['error']}")
    lines.append("  result          " + ("ok" if summary["ok"] else "FAILED"))
    return "\n".join(lines)


# --- what `up` says (pure) ----------------------------------------------------------------------


@attrs.frozen
class StageSighting:
    """A stage process `up` announced ready."""

    pid: int
    at: float


class UpLog:
    """What `skippy-zmq up`'s stderr says: each stage's ready process, restarts, kills, the end.

    Fed one line at a time (with the time it was read) by the thread that drains the pipe;
    waiters block on its condition."""

    def __init__(self, stage_ids: Sequence[str]) -> None:
        names = "|".join(re.escape(stage_id) for stage_id in stage_ids)
        lead = r"^(?:\[skippy-zmq\] )?"  # up's plain progress lines
        self._ready_re = re.compile(rf"{lead}({names}) ready \(pid (\d+)")
        self._restart_re = re.compile(rf"{lead}({names}): restarting \(restart \d+")
        self._kill_re = re.compile(rf"{lead}({names}): killing pid (\d+)")
        self.ready: dict[str, StageSighting] = {}
        self.restarts: list[tuple[str, float]] = []
        self.kills: list[tuple[str, float]] = []
        self.all_ready = False
        self.error: str | None = None
        self.closed = False  # the pipe ended: up exited
        self.changed = threading.Condition()

    def feed(self, line: str, at: float) -> None:
        """Take one line of up's stderr."""
        line = line.rstrip("\n")
        with self.changed:
            if match := self._ready_re.match(line):
                self.ready[match.group(1)] = StageSighting(int(match.group(2)), at)
            elif match := self._restart_re.match(line):
                self.restarts.append((match.group(1), at))
            elif match := self._kill_re.match(line):
                self.kills.append((match.group(1), at))
            elif re.match(r"^(?:\[skippy-zmq\] )?\d+ stages ready", line):
                self.all_ready = True
            elif line.startswith("error: "):
                self.error = line[len("error: "):]
            else:
                return
            self.changed.notify_all()

    def close(self) -> None:
        """The pipe ended."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Block until `predicate()` holds (True) or `timeout_s` passes or up exits (False)."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return predicate()
                self.changed.wait(min(left, 0.5))
            return True

    def restart_after(self, stage_id: str, since: float) -> float | None:
        """When the first restart of `stage_id` after `since` was announced."""
        with self.changed:
            return next((at for sid, at in self.restarts if sid == stage_id and at >= since), None)


# --- `skippy-zmq up` as a subprocess ------------------------------------------------------------


class UpProcess:
    """`skippy-zmq up --topology FILE` in its own session; its stderr goes to a log file and an UpLog."""

    def __init__(self, topology_path: Path, stage_ids: Sequence[str], log_path: Path, *,
                 max_restarts: int, silence_s: float, ready_timeout_s: float) -> None:
        self.stage_ids = tuple(stage_ids)
        self.log = UpLog(stage_ids)
        self.ready_timeout_s = ready_timeout_s
        self._log_file: IO[str] = log_path.open("w", encoding="utf-8")
        self.process = start(skippy_command("up", "--topology", str(topology_path), "--max-restarts", str(max_restarts),
                                            "--silence", f"{silence_s:g}", "--ready-timeout", f"{ready_timeout_s:g}"),
                             pipe_stderr=True)
        self._thread = threading.Thread(target=self._pump, name="up-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.feed(line, time.monotonic())
            with contextlib.suppress(OSError, ValueError):
                self._log_file.write(line)
                self._log_file.flush()
        self.log.close()

    def wait_all_ready(self) -> None:
        """Block until up says every stage is ready; StageError if it exits, StageTimeout if late."""
        if self.log.wait(lambda: self.log.all_ready, self.ready_timeout_s + 10.0):
            return
        if self.process.poll() is not None or self.log.closed:
            raise StageError(f"skippy-zmq up exited with status {self.process.wait(5)} before the stages "
                             f"were ready: {self.log.error or 'see its log'}")
        missing = [s for s in self.stage_ids if s not in self.log.ready]
        raise StageTimeout(f"skippy-zmq up: not ready after {self.ready_timeout_s:g} s (waiting for "
                           f"{', '.join(missing) or 'its all-ready line'})")

    def pid(self, stage_id: str) -> int:
        """The process up last announced ready for `stage_id`."""
        with self.log.changed:
            return self.log.ready[stage_id].pid

    def wait_replaced(self, stage_id: str, old_pid: int, timeout_s: float) -> StageSighting | None:
        """The ready process that replaced `old_pid`, once up announces it; None after `timeout_s`."""
        def replaced() -> bool:
            return self.log.ready[stage_id].pid != old_pid

        return self.log.ready[stage_id] if self.log.wait(replaced, timeout_s) else None

    def stop(self, timeout_s: float = UP_STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL; up's exit status after SIGTERM (None:
        it had to be killed)."""
        status = stop(self.process, timeout_s)
        self._thread.join(5)
        with contextlib.suppress(OSError):
            self._log_file.close()
        return status


# --- one generation -----------------------------------------------------------------------------


def run_generation(client: PipelineTransport, request: GenerationRequest, timeout_s: float,
                   on_piece: Callable[[str], None]) -> tuple[GenerationResult, bool]:
    """Run one session to its end (or `timeout_s`); returns its result and whether it completed.

    The loop of PipelineTransport.generate with a deadline of its own, so that a hang is a
    failure of one generation and not of the run; the session is cancelled either way."""
    scheduler = client.scheduler
    session = scheduler.submit(request, index=0)

    def on_event(action: Text | Finished) -> None:
        if isinstance(action, Text) and action.text:
            on_piece(action.text)

    deadline = time.monotonic() + timeout_s
    try:
        while (now := time.monotonic()) < deadline:
            client.perform(scheduler.tick(now), on_event)
            if session.done:
                break
            client.receive(min(scheduler.poll_timeout(now), max(deadline - now, 0.0)), on_event)
    finally:
        client.perform(scheduler.cancel(session, time.monotonic()), None)
    return session.result, session.result.finish_reason != "" or session.result.error is not None


class Injector:
    """The text-piece callback of a faulted generation: sends the signal after the chosen piece
    and times the next one."""

    def __init__(self, fault: Fault, pid_of: Callable[[], int], on_stop: Callable[[int], None]) -> None:
        self.fault = fault
        self._pid_of = pid_of
        self._on_stop = on_stop
        self.pieces = 0
        self.pid = 0
        self.hit_at: float | None = None
        self.next_at: float | None = None

    def __call__(self, _piece: str) -> None:
        self.pieces += 1
        now = time.monotonic()
        if self.hit_at is not None and self.next_at is None:
            self.next_at = now
        if self.pieces == self.fault.after_pieces and self.hit_at is None:
            self.pid = self._pid_of()
            if self.fault.signum is signal.SIGSTOP:
                self._on_stop(self.pid)
            os.kill(self.pid, self.fault.signum)
            self.hit_at = time.monotonic()


# --- the run ------------------------------------------------------------------------------------


@attrs.frozen
class RunOptions:
    """A chaos run's settings, parsed."""

    generations: int = 20
    max_tokens: int = 48
    seeded: bool = False
    seed: int = 0
    fault: str = "kill"
    generation_timeout_s: float = 300.0
    reply_timeout_s: float = 60.0
    recovery_timeout_s: float = 60.0

    def request(self, generation: int) -> GenerationRequest:
        """The request of generation `generation` (the same for its reference and its faulted run)."""
        prompt = PROMPTS[generation % len(PROMPTS)]
        sampling = (attrs.evolve(SEEDED_SAMPLING, seed=self.seed * 1000 + generation) if self.seeded
                    else SamplingParams(ignore_eos=True))
        return GenerationRequest(prompt=prompt, max_tokens=self.max_tokens, sampling=sampling)


class Run:
    """The references, then the faulted generations, against one `up`."""

    def __init__(self, up: UpProcess, client: PipelineTransport, options: RunOptions,
                 say: Callable[[str], None]) -> None:
        self.up = up
        self.client = client
        self.options = options
        self.say = say
        self.references: list[GenerationResult] = []
        self.pieces: list[int] = []
        self.trials: list[Trial] = []
        self.stopped_pids: list[int] = []  # SIGSTOPped: continued at the end if still there

    def references_run(self) -> None:
        """The uninterrupted generations."""
        for generation in range(self.options.generations):
            pieces: list[str] = []
            result, completed = run_generation(self.client, self.options.request(generation),
                                               self.options.generation_timeout_s, pieces.append)
            if not completed or result.error is not None:
                raise StageError(f"reference generation {generation} failed: "
                                 f"{result.error or 'no completion within the generation timeout'}")
            self.references.append(result)
            self.pieces.append(len(pieces))
            self.say(f"reference {generation}: {len(result.tokens)} tokens, {len(pieces)} pieces")

    def faults_run(self, schedule: Sequence[Fault]) -> None:
        """One faulted generation per entry of `schedule`."""
        for fault in schedule:
            trial = self._trial(fault)
            self.trials.append(trial)
            self.say(_describe(trial))
            if trial.hit and trial.to_ready_s is None:
                raise StageTimeout(f"{self.up.stage_ids[fault.stage_index]} (pid {trial.pid}) was not "
                                   f"running again {REPLACED_TIMEOUT_S:g} s after its fault")

    def _trial(self, fault: Fault) -> Trial:
        stage_id = self.up.stage_ids[fault.stage_index]
        injector = Injector(fault, lambda: self.up.pid(stage_id), self.stopped_pids.append)
        restarts_before = len(self.up.log.restarts)
        started = time.monotonic()
        result, completed = run_generation(self.client, self.options.request(fault.generation),
                                           self.options.generation_timeout_s, injector)
        reference = self.references[fault.generation]
        error = result.error
        if not completed:
            error = f"no completion within {self.options.generation_timeout_s:g} s (hang)"
        identical = error is None and injector.hit_at is not None and (
            result.tokens == reference.tokens and result.text == reference.text)
        hit_at = injector.hit_at
        return Trial(
            fault=fault, identical=identical, replays=result.replays, error=error,
            hit=hit_at is not None, pid=injector.pid,
            kill_to_next_s=None if hit_at is None or injector.next_at is None else injector.next_at - hit_at,
            to_restart_s=self._since(hit_at, self.up.log.restart_after(stage_id, hit_at) if hit_at else None),
            to_ready_s=self._since(hit_at, self._ready_after(stage_id, injector.pid)),
            restarts=len(self.up.log.restarts) - restarts_before,
            seconds=time.monotonic() - started, tokens=len(result.tokens),
        )

    def _ready_after(self, stage_id: str, old_pid: int) -> float | None:
        sighting = self.up.wait_replaced(stage_id, old_pid, REPLACED_TIMEOUT_S) if old_pid else None
        return None if sighting is None else sighting.at

    @staticmethod
    def _since(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else end - start

    def resume_stopped(self) -> None:
        """SIGCONT to every process this run froze that still exists (up normally killed it)."""
        for pid in self.stopped_pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)


def _describe(trial: Trial) -> str:
    fault = trial.fault
    verdict = "identical" if trial.identical else f"DIFFERENT: {trial.error or 'text differs'}"
    return (f"generation {fault.generation}: {fault.signal_name} to stage {fault.stage_index} (pid {trial.pid}) "
            f"after {fault.after_pieces} pieces: {verdict}; {trial.replays} replays, kill-to-next "
            f"{_seconds(trial.kill_to_next_s)} (restart line {_seconds(trial.to_restart_s)}, "
            f"ready {_seconds(trial.to_ready_s)})")


# --- command line -------------------------------------------------------------------------------


def _model_path(model: str, directory: Path) -> Path:
    from skippy_zmq.model.catalog import resolve_model

    return tiny_gemma3(directory) if model == "tiny" else resolve_model(model)


def _write_topology(model_path: Path, stages: int, directory: Path) -> Path:
    from skippy_zmq.launch.topology import write_local_topology
    from skippy_zmq.model.gguf_model import read_hparams

    n_layer = read_hparams(model_path).n_layer
    if not 1 <= stages <= n_layer:
        raise ConfigError(f"--stages {stages} must be in 1..{n_layer} for {model_path.name}")
    return write_local_topology(str(model_path), n_layer, stages, codec="raw-f32-v1", policy="fixed",
                                directory=directory)


@attrs.frozen
class Launch:
    """How `up` is started."""

    model: str
    stages: int
    max_restarts: int | None
    silence_s: float
    ready_timeout_s: float


class Pipeline:
    """`up` on a fresh topology and a driver for it; a context manager that stops both, whatever
    ends it, and keeps up's exit status."""

    def __init__(self, launch: Launch, options: RunOptions, directory: Path, say: Callable[[str], None]) -> None:
        self.launch = launch
        self.options = options
        self.directory = directory
        self.say = say
        self.model_path = Path(launch.model)
        self.up: UpProcess | None = None
        self.client: PipelineTransport | None = None
        self.up_exit: int | None = None

    def __enter__(self) -> Pipeline:
        from skippy_zmq.config import TopologyConfig
        from skippy_zmq.tokens.tokenizer import Tokenizer

        launch, options = self.launch, self.options
        self.model_path = _model_path(launch.model, self.directory)
        topology_path = _write_topology(self.model_path, launch.stages, self.directory)
        topology = TopologyConfig.from_toml(topology_path)
        # Every fault restarts one stage: room for all of them (and a spurious one) before up gives up.
        max_restarts = launch.max_restarts if launch.max_restarts is not None else options.generations + 5
        self.say(f"starting skippy-zmq up for {self.model_path.name} in {launch.stages} stages; "
                 f"log in {self.directory / 'up.log'}")
        try:
            self.up = UpProcess(topology_path, [stage.stage_id for stage in topology.stages],
                                self.directory / "up.log", max_restarts=max_restarts,
                                silence_s=launch.silence_s, ready_timeout_s=launch.ready_timeout_s)
            self.up.wait_all_ready()
            settings = SchedulerSettings(reply_timeout_s=options.reply_timeout_s,
                                         recovery_timeout_s=options.recovery_timeout_s)
            self.client = PipelineTransport(topology, Tokenizer.from_gguf(self.model_path), settings)
            self.client.wait_ready(60.0, self.say)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.up is None:
            return
        held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)  # a second Ctrl-C must not orphan up
        try:
            self.up_exit = self.up.stop()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--generations", "-n", type=click.IntRange(min=1), default=20, show_default=True,
              help="Generations: N references, then N faulted.")
@click.option("--fault", type=click.Choice(sorted(FAULT_SIGNALS)), default="kill", show_default=True,
              help="kill: SIGKILL; stop: SIGSTOP (up's --silence notices); mixed: either, by seed.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the fault schedule (and, with --seeded, of the sampling seeds).")
@click.option("--seeded", is_flag=True, help="Seeded sampling (temperature 0.8, top-k 40) instead of greedy.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=48, show_default=True,
              help="Tokens per generation (ignore_eos: every generation runs them all).")
@click.option("--model", default="gemma3-270m-q4_k_m", show_default=True,
              help="GGUF path or alias, or 'tiny' (a tiny random Gemma 3 written for the run).")
@click.option("--stages", type=click.IntRange(min=1), default=3, show_default=True, help="Stages of the pipeline.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None,
              help="up's --max-restarts (default: generations + 5, so every fault may restart a stage).")
@click.option("--silence", "silence_s", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="up's --silence: a stage without heartbeats this long is killed and restarted.")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=0, min_open=True), default=300.0,
              show_default=True, help="up's --ready-timeout, seconds.")
@click.option("--timeout", "reply_timeout_s", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, help="The driver's deadline of each reply, seconds.")
@click.option("--recovery-timeout", "recovery_timeout_s", type=click.FloatRange(min=0, min_open=True),
              default=60.0, show_default=True, help="How long the driver waits for a failed stage to come back.")
@click.option("--generation-timeout", "generation_timeout_s", type=click.FloatRange(min=1), default=300.0,
              show_default=True, help="A generation not complete after this long is a hang (a failure).")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Keep up's log and the topology here (default: a temporary directory, kept only on failure).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
def main(generations: int, fault: str, seed: int, seeded: bool, max_tokens: int, model: str, stages: int,
         max_restarts: int | None, silence_s: float, ready_timeout_s: float, reply_timeout_s: float,
         recovery_timeout_s: float, generation_timeout_s: float, log_dir: str | None, as_json: bool,
         quiet: bool) -> None:
    """Run the references and the faulted generations; print the summary."""
    interrupt_on_sigterm()  # as Ctrl-C: up is stopped, the summary printed
    say = progress(quiet)
    directory = run_directory(log_dir, "chaos-")
    options = RunOptions(generations=generations, max_tokens=max_tokens, seeded=seeded, seed=seed, fault=fault,
                         generation_timeout_s=generation_timeout_s, reply_timeout_s=reply_timeout_s,
                         recovery_timeout_s=recovery_timeout_s)
    launch = Launch(model, stages, max_restarts, silence_s, ready_timeout_s)
    pipeline = Pipeline(launch, options, directory, say)
    run: Run | None = None
    interrupted = False
    error: str | None = None
    try:
        with pipeline:
            assert pipeline.up is not None and pipeline.client is not None
            run = Run(pipeline.up, pipeline.client, options, say)
            try:
                run.references_run()
                run.faults_run(fault_schedule(seed, run.pieces, stages, fault))
            finally:
                run.resume_stopped()
    except KeyboardInterrupt:
        interrupted = True
    except SkippyError as exc:
        error = str(exc)
    if run is None or not run.references or (error is not None and not run.trials):
        click.echo(f"chaos: {error or 'interrupted before the references were complete'}", err=True)
        click.echo(f"chaos: up's log kept in {directory}", err=True)
        sys.exit(EXIT_INTERRUPTED if interrupted else EXIT_NOT_STARTED)
    settings = {"model": str(pipeline.model_path), "stages": stages, "fault": fault, "seed": seed,
                "sampling": "seeded" if seeded else "greedy", "max_tokens": max_tokens}
    by_stage = {sid: sum(1 for s, _ in run.up.log.restarts if s == sid) for sid in run.up.stage_ids}
    summary = summarize(run.trials, restarts_seen=len(run.up.log.restarts), up_exit=pipeline.up_exit,
                        settings=settings, interrupted=interrupted, restarts_by_stage=by_stage)
    if error is not None:
        summary["ok"], summary["error"] = False, error
        click.echo(f"chaos: run stopped: {error}", err=True)
    finish(summary, render, as_json=as_json, directory=directory, keep=log_dir is not None, interrupted=interrupted,
           say=say, kept="up's log and the topology")


if __name__ == "__main__":
    main()
