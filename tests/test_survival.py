"""Survival end to end: real stage processes under supervision are killed (-9) or frozen
(SIGSTOP) mid-generation; they are restarted, the driver replays its sessions, and the text
is identical to an uninterrupted run, greedy and seeded."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.errors import StageTimeout
from skippy_zmq.launch.processes import LocalPipeline
from skippy_zmq.launch.supervisor import RestartPolicy
from skippy_zmq.tokens.constraint import Constraint
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer
from tests.conftest import TINY_LLAMA_LAYERS
from tests.pipeline_helpers import write_topology

pytestmark = pytest.mark.slow  # real worker processes on 127.0.0.1

PROMPTS = ("The quick brown fox", "Once upon a time")
MAX_TOKENS = 24
KILL_AFTER = 6  # text pieces streamed before the stage is hit
MODES = {
    "greedy": SamplingParams(ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True),
}


class Supervised:
    """A local pipeline whose stages are restarted when they die or freeze (as `up` does)."""

    def __init__(self, topology: Path) -> None:
        self.topology_path = topology
        self.pipeline = LocalPipeline(topology)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.gave_up: str | None = None

    def __enter__(self) -> Supervised:
        self.pipeline.start(60.0)
        policy = RestartPolicy(max_restarts=50, silence_s=2.0, ready_timeout_s=60.0)

        def run() -> None:
            self.gave_up = self.pipeline.supervise(self._stop.is_set, policy, poll_s=0.1)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.pipeline.__exit__()

    def pid(self, stage_index: int) -> int:
        return self.pipeline.processes[stage_index].pid


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Iterator[Supervised]:
    topology = write_topology(tmp_path_factory.mktemp("recovery"), tiny_llama_path, TINY_LLAMA_LAYERS, 3)
    with Supervised(topology) as supervised:
        yield supervised


def run(supervised: Supervised, sampling: SamplingParams, hit: tuple[int, signal.Signals] | None = None,
        recovery_timeout_s: float = 60.0, constraint: Constraint | None = None) -> list[GenerationResult]:
    """Generate PROMPTS (under `constraint` if given); with `hit`, send that signal to that stage once
    KILL_AFTER pieces came."""
    topology = supervised.pipeline.topology
    tokenizer = Tokenizer.from_gguf(Path(topology.model))
    pieces = 0
    hit_at: list[float] = []

    def on_text(_index: int, _piece: str) -> None:
        nonlocal pieces
        pieces += 1
        if hit is not None and pieces == KILL_AFTER:
            os.kill(supervised.pid(hit[0]), hit[1])
            hit_at.append(time.monotonic())

    requests = [GenerationRequest(prompt=p, max_tokens=MAX_TOKENS, sampling=sampling, constraint=constraint)
                for p in PROMPTS]
    with PipelineTransport(topology, tokenizer, SchedulerSettings(
            silence_s=3.0, reply_timeout_s=60.0, recovery_timeout_s=recovery_timeout_s)) as client:
        client.wait_ready(60.0)
        results = client.generate(requests, on_text)
    if hit is not None:
        assert hit_at, "the stage was never hit: the generation was too short"
    return results


@pytest.fixture(scope="module")
def uninterrupted(supervised: Supervised) -> dict[str, list[GenerationResult]]:
    return {mode: run(supervised, sampling) for mode, sampling in MODES.items()}


def test_a_constrained_session_replays_after_the_final_stage_is_killed_to_the_same_text(
    supervised: Supervised
) -> None:
    pytest.importorskip("llguidance")
    # Words of letters and single spaces, longer than the budget: the constraint never completes.
    constraint = Constraint.regex("[a-z]+( [a-z]+){40,}")
    want = run(supervised, MODES["seeded"], constraint=constraint)
    got = run(supervised, MODES["seeded"], hit=(2, signal.SIGKILL), constraint=constraint)
    for result, reference in zip(got, want, strict=True):
        assert result.error is None, result.error
        assert result.tokens == reference.tokens and result.text == reference.text
        assert re.fullmatch("[a-z]+( [a-z]+)*( [a-z]*)?", result.text.lstrip()), result.text
    assert sum(r.replays for r in got) >= 1


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("stage_index", [0, 1, 2])
def test_kill_9_of_any_stage_mid_generation_replays_to_identical_text(
    supervised: Supervised, uninterrupted: dict[str, list[GenerationResult]], stage_index: int, mode: str
) -> None:
    before = supervised.pid(stage_index)
    results = run(supervised, MODES[mode], hit=(stage_index, signal.SIGKILL))
    assert supervised.pid(stage_index) != before, "the stage was not restarted"
    for got, want in zip(results, uninterrupted[mode], strict=True):
        assert got.error is None, got.error
        assert got.tokens == want.tokens and got.text == want.text
        assert len(got.tokens) == MAX_TOKENS
    assert sum(r.replays for r in results) >= 1
    assert supervised.gave_up is None


def test_a_frozen_stage_is_killed_restarted_and_its_sessions_replayed(
    supervised: Supervised, uninterrupted: dict[str, list[GenerationResult]]
) -> None:
    before = supervised.pid(1)
    results = run(supervised, MODES["greedy"], hit=(1, signal.SIGSTOP))
    assert supervised.pid(1) != before
    assert [r.tokens for r in results] == [r.tokens for r in uninterrupted["greedy"]]
    assert all(r.replays >= 1 for r in results)


def test_without_a_supervisor_the_recovery_timeout_fails_the_sessions_naming_the_stage(
    tmp_path: Path, tiny_llama_path: Path
) -> None:
    topology = write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 2)
    with LocalPipeline(topology) as pipeline:
        tokenizer = Tokenizer.from_gguf(tiny_llama_path)
        request = GenerationRequest(prompt=PROMPTS[0], max_tokens=200, sampling=MODES["greedy"])
        killed: list[float] = []

        def on_text(_index: int, _piece: str) -> None:
            if not killed:
                os.kill(pipeline.processes[1].pid, signal.SIGKILL)
                killed.append(time.monotonic())

        with PipelineTransport(pipeline.topology, tokenizer,
                               SchedulerSettings(silence_s=1.0, recovery_timeout_s=2.0)) as client:
            client.wait_ready(60.0)
            [result] = client.generate([request], on_text)
        assert isinstance(client_error := result.error, str)
        assert 'stage 1 "stage-1"' in client_error and "did not come back within 2 s" in client_error
        assert time.monotonic() - killed[0] < 20.0
        said = [(event.event, event.place.index) for event in client.scheduler.watch.take_events()]
        assert said.count(("stage_down", 1)) == 1 and said.count(("stage_gave_up", 1)) == 1


def test_up_restarts_a_killed_stage_and_keeps_the_others(tmp_path: Path, tiny_llama_path: Path) -> None:
    topology = write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 2)
    up = subprocess.Popen([sys.executable, "-m", "skippy_zmq.cli", "up", "--topology", str(topology), "--silence", "2"],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    stderr = up.stderr
    assert stderr is not None

    def pump() -> None:
        for line in stderr:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()

    def wait_for(pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            seen.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s; got: {seen[-20:]}")

    try:
        pids = {m.group(1): int(m.group(2)) for m in (wait_for(r"(stage-\d) ready \(pid (\d+)") for _ in range(2))}
        wait_for(r"2 stages ready")
        os.kill(pids["stage-1"], signal.SIGKILL)
        wait_for(r"stage-1: restarting \(restart 1 within 600 s\) after: stage-1 \(pid \d+\) exited with status -9")
        new_pid = int(wait_for(r"stage-1 ready \(pid (\d+)").group(1))
        assert new_pid != pids["stage-1"]
        os.kill(pids["stage-0"], 0)  # stage 0 kept running throughout
        tokenizer = Tokenizer.from_gguf(tiny_llama_path)
        from skippy_zmq.config import TopologyConfig

        with PipelineTransport(TopologyConfig.from_toml(topology), tokenizer) as client:
            client.wait_ready(30.0)
            [result] = client.generate([GenerationRequest(prompt="hi", max_tokens=4)])
        assert result.error is None and len(result.tokens) >= 1
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            assert up.wait(30) == 0
        finally:
            if up.poll() is None:
                up.kill()
            up.wait(10)


def test_a_stage_that_is_down_at_start_is_named_by_the_ready_wait(tmp_path: Path, tiny_llama_path: Path) -> None:
    topology = write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 2)
    from skippy_zmq.config import TopologyConfig

    said: list[str] = []
    with PipelineTransport(TopologyConfig.from_toml(topology), Tokenizer.from_gguf(tiny_llama_path)) as client:
        started = time.monotonic()
        with pytest.raises(StageTimeout, match=r'no heartbeat from stage 0 "stage-0".*stage 1 "stage-1"'):
            client.wait_ready(2.5, said.append)
        assert time.monotonic() - started < 5.0
    assert said and "waiting for heartbeats from" in said[0]
