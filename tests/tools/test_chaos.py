"""tools/chaos.py: the fault schedule, the summary and up's log in-process; a CI-sized run under `up`."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from skippy_zmq.errors import ConfigError
from tests.tools import run_tool
from tools import chaos

SETTINGS = {"model": "m.gguf", "stages": 3, "fault": "kill", "seed": 0, "sampling": "greedy", "max_tokens": 48}


# --- the fault schedule -------------------------------------------------------------------------


def test_a_schedule_is_a_function_of_its_seed() -> None:
    pieces = [48] * 20
    first = chaos.fault_schedule(7, pieces, 3, "mixed")
    assert first == chaos.fault_schedule(7, pieces, 3, "mixed")
    assert first != chaos.fault_schedule(8, pieces, 3, "mixed")
    assert [f.generation for f in first] == list(range(20))


@pytest.mark.parametrize("seed", range(5))
def test_every_fault_hits_a_real_stage_strictly_inside_its_generation(seed: int) -> None:
    pieces = [2, 3, 10, 48, 47, 5] * 10
    for fault, count in zip(chaos.fault_schedule(seed, pieces, 3, "kill"), pieces, strict=True):
        assert 0 <= fault.stage_index < 3
        assert 1 <= fault.after_pieces <= count - 1  # a piece always follows the signal


def test_a_generation_of_one_piece_is_hit_after_it() -> None:
    [fault] = chaos.fault_schedule(0, [1], 2, "kill")
    assert fault.after_pieces == 1


def test_the_stages_and_points_are_spread_by_the_seed() -> None:
    schedule = chaos.fault_schedule(0, [48] * 60, 3, "kill")
    assert {f.stage_index for f in schedule} == {0, 1, 2}
    assert len({f.after_pieces for f in schedule}) > 10


@pytest.mark.parametrize(("fault", "signals"), [
    ("kill", {signal.SIGKILL}), ("stop", {signal.SIGSTOP}), ("mixed", {signal.SIGKILL, signal.SIGSTOP}),
])
def test_the_fault_choice_picks_the_signals(fault: str, signals: set[signal.Signals]) -> None:
    assert {f.signum for f in chaos.fault_schedule(1, [48] * 40, 3, fault)} == signals


def test_an_unknown_fault_or_no_stage_is_refused() -> None:
    with pytest.raises(ConfigError, match="'term' must be one of kill, stop, mixed"):
        chaos.fault_schedule(0, [10], 3, "term")
    with pytest.raises(ConfigError, match="n_stages 0"):
        chaos.fault_schedule(0, [10], 0, "kill")


def test_the_same_generation_gets_the_same_request_and_seeded_ones_their_own_seed() -> None:
    greedy = chaos.RunOptions(max_tokens=16)
    assert greedy.request(3) == greedy.request(3)
    assert greedy.request(3).sampling.is_greedy and greedy.request(3).sampling.ignore_eos
    assert greedy.request(3).max_tokens == 16
    assert greedy.request(len(chaos.PROMPTS) + 3).prompt == greedy.request(3).prompt
    seeded = chaos.RunOptions(seeded=True, seed=2)
    seeds = {seeded.request(g).sampling.seed for g in range(20)}
    assert len(seeds) == 20 and not seeded.request(0).sampling.is_greedy


# --- the summary --------------------------------------------------------------------------------


def _trial(generation: int, *, identical: bool = True, k2n: float | None = 1.0, error: str | None = None,
           hit: bool = True, to_restart: float | None = None) -> Any:
    fault = chaos.Fault(generation, generation % 3, 5, "SIGKILL")
    return chaos.Trial(fault=fault, identical=identical, replays=1 if hit else 0, error=error, hit=hit,
                       pid=100 + generation, kill_to_next_s=k2n, to_restart_s=to_restart, restarts=1, tokens=48)


def test_a_summary_counts_identical_and_lists_each_failure_with_its_error() -> None:
    trials = [_trial(0, k2n=2.0), _trial(1, identical=False, k2n=4.0),
              _trial(2, identical=False, k2n=None, error="stage-1 failed and did not come back"),
              _trial(3, identical=False, k2n=None, hit=False), _trial(4, k2n=1.0)]
    summary = chaos.summarize(trials, restarts_seen=4, up_exit=0, settings=SETTINGS)
    assert summary["generations"] == 5 and summary["identical"] == 2
    assert [f["error"] for f in summary["failures"]] == [
        "text differs from the uninterrupted run", "stage-1 failed and did not come back",
        "the stage was never hit",
    ]
    assert summary["kill_to_next_token_s"] == {"p50": 2.0, "p90": 4.0, "max": 4.0, "count": 3}
    assert summary["replays"] == 4 and summary["restarts_seen"] == 4
    assert summary["ok"] is False
    assert json.loads(json.dumps(summary))["trials"][1]["fault"]["generation"] == 1
    text = chaos.render(summary)
    assert "identical       2/5" in text and "FAILED generation 2 (SIGKILL to stage 2" in text
    assert text.endswith("result          FAILED")


def test_kill_to_next_token_is_split_at_ups_restart_line() -> None:
    trials = [_trial(0, k2n=2.0, to_restart=0.5), _trial(1, k2n=31.0, to_restart=30.0),
              _trial(2, k2n=3.0, to_restart=None)]
    summary = chaos.summarize(trials, restarts_seen=3, up_exit=0, settings=SETTINGS,
                              restarts_by_stage={"stage-0": 1, "stage-1": 2})
    assert summary["kill_to_restart_line_s"] == {"p50": 0.5, "p90": 30.0, "max": 30.0, "count": 2}
    assert summary["restart_line_to_next_token_s"] == {"p50": 1.0, "p90": 1.5, "max": 1.5, "count": 2}
    assert summary["restarts_by_stage"] == {"stage-0": 1, "stage-1": 2}
    text = chaos.render(summary)
    assert "signal -> up's restart line p50 0.50 s, p90 30.00 s" in text
    assert "restarts seen   3, stage-0 1, stage-1 2" in text


@pytest.mark.parametrize(("up_exit", "interrupted", "ok"), [(0, False, True), (1, False, False),
                                                            (None, False, False), (0, True, False)])
def test_all_identical_is_ok_only_when_up_exited_0_and_nothing_was_interrupted(
    up_exit: int | None, interrupted: bool, ok: bool
) -> None:
    summary = chaos.summarize([_trial(0), _trial(1)], restarts_seen=2, up_exit=up_exit, settings=SETTINGS,
                              interrupted=interrupted)
    assert summary["ok"] is ok
    assert summary["model"] == "m.gguf" and summary["failures"] == []


def test_no_trial_is_not_ok() -> None:
    summary = chaos.summarize([], restarts_seen=0, up_exit=0, settings=SETTINGS)
    assert summary["ok"] is False and summary["kill_to_next_token_s"]["p50"] is None
    assert "p50 -" in chaos.render(summary)


# --- what up says -------------------------------------------------------------------------------


def test_up_log_follows_ready_processes_restarts_kills_and_the_end() -> None:
    log = chaos.UpLog(["stage-0", "stage-1"])
    lines = [
        "starting stage 0 \"stage-0\"",
        '{"ts": 1.0, "component": "stage-1", "event": "ready", "pid": 9}',
        "stage-0 ready (pid 101, 1.2 s)",
        "stage-1 ready (pid 102, 1.4 s)",
        "stage-12 ready (pid 999, 1.0 s)",  # not a stage of this topology
        "2 stages ready; Ctrl-C stops them",
        "stage-1: killing pid 102: no heartbeat for 5.3 s (frozen or stuck)",
        "stage-1: restarting (restart 1 within 600 s) after: stage-1 (pid 102) exited with status -9 (SIGKILL)",
        "stage-1 ready (pid 203, 1.5 s after its restart)",
        "error: stage failed: stage-0: exited; 5 restarts within 600 s already",
    ]
    for at, line in enumerate(lines):
        log.feed(line + "\n", float(at))
    assert log.all_ready
    assert {sid: s.pid for sid, s in log.ready.items()} == {"stage-0": 101, "stage-1": 203}
    assert log.ready["stage-1"].at == 8.0
    assert log.kills == [("stage-1", 6.0)] and log.restarts == [("stage-1", 7.0)]
    assert log.restart_after("stage-1", 6.5) == 7.0 and log.restart_after("stage-1", 7.5) is None
    assert log.error == "stage failed: stage-0: exited; 5 restarts within 600 s already"


def test_up_log_waits_are_bounded_and_end_when_up_exits() -> None:
    log = chaos.UpLog(["stage-0"])
    started = time.monotonic()
    assert log.wait(lambda: log.all_ready, 0.2) is False
    assert time.monotonic() - started < 2.0

    def later() -> None:
        time.sleep(0.1)
        log.feed("stage-0 ready (pid 5, 0.1 s)", time.monotonic())

    threading.Thread(target=later, daemon=True).start()
    assert log.wait(lambda: "stage-0" in log.ready, 5.0) is True
    log.close()
    started = time.monotonic()
    assert log.wait(lambda: log.all_ready, 30.0) is False
    assert time.monotonic() - started < 2.0


# --- a CI-sized run -----------------------------------------------------------------------------


@pytest.mark.slow
def test_three_kill_9_generations_under_up_complete_identical(tiny_gemma3_path: Path, tmp_path: Path) -> None:
    done = run_tool("chaos", "--model", str(tiny_gemma3_path), "--stages", "2", "-n", "3", "--max-tokens", "24",
                    "--seed", "5", "--json", "--quiet", "--log-dir", str(tmp_path), timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:] + (tmp_path / "up.log").read_text()[-3000:]
    summary = json.loads(done.stdout)
    assert summary["generations"] == 3 and summary["identical"] == 3 and summary["failures"] == []
    assert summary["up_exit"] == 0 and summary["restarts_seen"] >= 3
    assert all(t["hit"] and t["replays"] >= 1 and t["tokens"] == 24 for t in summary["trials"])
    assert summary["kill_to_next_token_s"]["count"] == 3
    assert sum(summary["restarts_by_stage"].values()) == summary["restarts_seen"]
