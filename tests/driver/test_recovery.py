"""Recovery bookkeeping (skippy_zmq.recovery), with a scripted clock."""

from __future__ import annotations

from skippy_zmq.driver.recovery import LANE_RETRY_S, STARVED_S, SUSPECT_GRACE_S, Recovery
from skippy_zmq.errors import RemoteStageError


def test_a_restart_replays_at_once_and_older_replies_become_stale() -> None:
    recovery = Recovery(30.0)
    recovery.disrupted([1], 5.0, [11, 12], back=True)
    assert not recovery.holding and recovery.waiting() == {11, 12} and recovery.replaying(11)
    assert recovery.take_replays(lambda _stage, _since: False, next_request=40) == [11, 12]
    assert recovery.waiting() == set() and not recovery.replaying(11)
    assert not recovery.is_current(11, 39) and recovery.is_current(11, 40) and recovery.is_current(99, 1)


def test_a_silent_stage_holds_until_it_is_heard_after_it_went_down() -> None:
    recovery = Recovery(30.0)
    recovery.disrupted([2], 5.0, [11], back=False)
    assert recovery.holding and recovery.down() == [2]
    heard = {2: 4.0}
    assert recovery.take_replays(lambda stage, since: heard[stage] > since, 7) == []
    heard[2] = 6.0
    assert recovery.take_replays(lambda stage, since: heard[stage] > since, 7) == [11]
    assert not recovery.holding


def test_a_stage_down_past_the_timeout_gives_up_its_sessions() -> None:
    recovery = Recovery(10.0)
    recovery.disrupted([0, 1], 5.0, [11, 12], back=False)
    assert recovery.give_up(15.0) == ([], [])
    assert recovery.give_up(15.1) == ([0, 1], [11, 12])
    assert not recovery.holding and recovery.waiting() == set()


def test_held_errors_fail_after_the_grace_unless_a_disruption_turns_them_into_replays() -> None:
    recovery = Recovery(30.0)
    first, second = RemoteStageError("first"), RemoteStageError("second")
    recovery.hold(11, first, 1.0)
    recovery.hold(11, second, 1.5)  # the first error is the one reported
    recovery.hold(12, second, 1.0)
    assert recovery.waiting() == {11, 12}
    assert recovery.due_errors(1.0 + SUSPECT_GRACE_S - 0.01) == []
    recovery.disrupted([1], 2.0, [12], back=True)  # 12 replays instead
    assert recovery.due_errors(1.0 + SUSPECT_GRACE_S) == [(11, first)]
    assert recovery.waiting() == {12}


def test_timeout_zero_means_no_recovery_and_forget_clears_a_session() -> None:
    assert not Recovery(0.0).enabled
    recovery = Recovery(5.0)
    recovery.disrupted([1], 0.0, [11], back=True)
    recovery.hold(12, RemoteStageError("x"), 0.0)
    recovery.take_replays(lambda _s, _t: True, 3)
    for session_id in (11, 12):
        recovery.forget(session_id)
    assert recovery.waiting() == set() and recovery.is_current(11, 0)


def test_a_lane_refusal_waits_then_starts_over_and_gives_up_after_the_bound() -> None:
    recovery = Recovery(30.0)
    refusal = RemoteStageError("lane limit reached")
    recovery.lane_refused(11, 0, refusal, 5.0, next_request=20)
    assert recovery.waiting() == {11} and not recovery.is_current(11, 19) and recovery.is_current(11, 20)
    assert recovery.starved(5.0 + STARVED_S) == [0] and recovery.starved(5.0 + STARVED_S + 0.1) == []
    assert recovery.lane_retries(5.0 + LANE_RETRY_S - 0.1, give_up_after_s=60.0) == ([], [])
    assert recovery.lane_retries(5.0 + LANE_RETRY_S, give_up_after_s=60.0) == ([11], [])
    assert recovery.waiting() == set()
    recovery.lane_refused(11, 1, refusal, 70.0, next_request=30)  # still refused 65 s after the first time
    assert recovery.lane_retries(71.0, give_up_after_s=60.0) == ([], [(11, refusal)])


def test_a_stage_failure_turns_a_lane_wait_into_a_replay_and_holds_the_retries() -> None:
    recovery = Recovery(30.0)
    recovery.lane_refused(11, 0, RemoteStageError("lane limit reached"), 1.0, next_request=5)
    recovery.lane_refused(12, 0, RemoteStageError("lane limit reached"), 1.0, next_request=6)
    recovery.disrupted([1], 1.5, [11], back=False)
    assert recovery.replaying(11) and recovery.lane_retries(9.0, give_up_after_s=60.0) == ([], [])  # stage down
    recovery.forget(12)
    assert recovery.waiting() == {11}
