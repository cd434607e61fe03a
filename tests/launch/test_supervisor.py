"""Supervision decisions for `skippy-zmq up`, driven with a scripted clock (no processes)."""

from __future__ import annotations

import pytest

from skippy_zmq.errors import ConfigError
from skippy_zmq.launch.supervisor import GiveUp, Kill, RestartPolicy, StageStatus, Start, Supervisor

POLICY = RestartPolicy(max_restarts=2, window_s=600.0, silence_s=10.0, ready_timeout_s=60.0, backoff_s=(0.5, 2.0),
                       stable_s=10.0)
RUNNING = StageStatus(exited=False, ready=True, started_at=0.0, beat_age_s=1.0)
DEAD = StageStatus(exited=True, ready=True, started_at=0.0, exit_text="stage-1 (pid 9) exited with status -9 (SIGKILL)")


def test_a_dead_stage_is_restarted_after_its_backoff_and_the_others_keep_running() -> None:
    supervisor = Supervisor(["stage-0", "stage-1"], POLICY)
    assert supervisor.step(0.0, {"stage-0": RUNNING, "stage-1": RUNNING}) == []
    assert supervisor.step(1.0, {"stage-0": RUNNING, "stage-1": DEAD}) == []  # backoff 0.5 s
    assert supervisor.step(1.4, {"stage-0": RUNNING, "stage-1": DEAD}) == []
    commands = supervisor.step(1.5, {"stage-0": RUNNING, "stage-1": DEAD})
    assert commands == [Start("stage-1", DEAD.exit_text, attempt=1)]
    assert supervisor.restarts("stage-1") == 1 and supervisor.restarts("stage-0") == 0


def test_the_second_restart_waits_longer_and_one_more_gives_up() -> None:
    supervisor = Supervisor(["s"], POLICY)
    supervisor.step(0.0, {"s": DEAD})
    assert isinstance(supervisor.step(0.5, {"s": DEAD})[0], Start)
    supervisor.step(10.0, {"s": DEAD})
    assert supervisor.step(11.9, {"s": DEAD}) == []
    assert supervisor.step(12.0, {"s": DEAD}) == [Start("s", DEAD.exit_text, attempt=2)]
    [give_up] = supervisor.step(20.0, {"s": DEAD})
    assert isinstance(give_up, GiveUp) and "2 restarts within 600 s already" in give_up.reason


def test_restarts_older_than_the_window_no_longer_count() -> None:
    supervisor = Supervisor(["s"], POLICY)
    for start in (0.0, 100.0):
        supervisor.step(start, {"s": DEAD})
        supervisor.step(start + 5.0, {"s": DEAD})
    assert supervisor.restarts("s") == 2
    supervisor.step(700.0, {"s": DEAD})  # the restart at 5 s left the window
    assert supervisor.restarts("s") == 1
    assert supervisor.step(700.5, {"s": DEAD}) == []  # second within the window: backoff 2 s
    assert supervisor.step(702.0, {"s": DEAD}) == [Start("s", DEAD.exit_text, attempt=2)]


def test_a_frozen_stage_is_killed_once_then_restarted_with_the_reason() -> None:
    supervisor = Supervisor(["s"], POLICY)
    frozen = StageStatus(exited=False, ready=True, started_at=0.0, beat_age_s=10.5)
    [kill] = supervisor.step(20.0, {"s": frozen})
    assert kill == Kill("s", "no heartbeat for 10.5 s (frozen or stuck)")
    assert supervisor.step(20.2, {"s": frozen}) == []  # SIGKILL is on its way: not twice
    killed = StageStatus(exited=True, ready=True, started_at=0.0, exit_text="exited with status -9")
    supervisor.step(20.5, {"s": killed})
    [start] = supervisor.step(21.0, {"s": killed})
    assert isinstance(start, Start) and start.reason == kill.reason


def test_a_stage_that_never_gets_ready_is_killed() -> None:
    supervisor = Supervisor(["s"], POLICY)
    loading = StageStatus(exited=False, ready=False, started_at=0.0)
    assert supervisor.step(59.0, {"s": loading}) == []
    assert supervisor.step(61.0, {"s": loading}) == [Kill("s", "not ready 60 s after it started")]


def test_with_restarts_off_the_first_death_gives_up() -> None:
    supervisor = Supervisor(["s"], RestartPolicy(max_restarts=0))
    [give_up] = supervisor.step(0.0, {"s": DEAD})
    assert give_up == GiveUp("s", f"{DEAD.exit_text}; restarts are off (--max-restarts 0)")
    with pytest.raises(ConfigError, match="max_restarts -1"):
        RestartPolicy(max_restarts=-1)


def test_a_stage_that_was_stable_before_it_died_restarts_after_the_first_backoff_again() -> None:
    supervisor = Supervisor(["s"], POLICY)  # backoff 0.5 then 2.0; stable after 10 s ready
    quick = StageStatus(exited=True, ready=True, started_at=0.0, ready_for_s=1.0, exit_text="died")
    stable = StageStatus(exited=True, ready=True, started_at=0.0, ready_for_s=10.0, exit_text="died")
    supervisor.step(0.0, {"s": quick})
    assert supervisor.step(0.5, {"s": quick}) == [Start("s", "died", attempt=1)]
    supervisor.step(5.0, {"s": quick})  # died again before it was stable: a crash loop
    assert supervisor.step(6.9, {"s": quick}) == []
    assert supervisor.step(7.0, {"s": quick}) == [Start("s", "died", attempt=2)]
    big = RestartPolicy(max_restarts=9, backoff_s=(0.5, 2.0), stable_s=10.0)
    supervisor = Supervisor(["s"], big)
    for start in (0.0, 30.0, 60.0):  # each time it had run stably: never past the first backoff
        supervisor.step(start, {"s": stable})
        assert supervisor.step(start + 0.5, {"s": stable}) == [Start("s", "died", attempt=supervisor.restarts("s"))]
    assert supervisor.restarts("s") == 3  # still counted against --max-restarts
