"""What the driver tells its operator about each stage (skippy_zmq.driver.watch), with a scripted
clock: every event once, reminders paced, counters; then through a scheduler's recovery."""

from __future__ import annotations

from typing import Any

import pytest

from skippy_zmq.driver.lanes import Liveness
from skippy_zmq.driver.watch import (
    MAX_EVENTS,
    LinkTrouble,
    RecoveryView,
    StageEvent,
    StagePlace,
    StageWatch,
    endpoint_host,
)
from skippy_zmq.wire.replies import Reply
from tests.driver.test_scheduler import LABELS, beat, decoding, request, scheduler

RETURNS = "tcp://10.0.0.9:5700"
PLACES = (StagePlace(0, "stage-0", "tcp://10.0.0.1:5710", returns_to=RETURNS),
          StagePlace(1, "stage-1", "tcp://10.0.0.2:5711", "keys/public/stage-1.key", RETURNS))
IDLE = RecoveryView()


def watched(recovery_timeout_s: float = 60.0, silence_s: float = 15.0) -> tuple[StageWatch, Liveness]:
    liveness = Liveness(LABELS, silence_s)
    return StageWatch(PLACES, liveness, recovery_timeout_s=recovery_timeout_s, recovery_silence_s=silence_s,
                      send_timeout_s=15.0), liveness


def look(watch: StageWatch, liveness: Liveness, times: list[float], *, beats: tuple[int, ...] = (0,),
         recovery: RecoveryView = IDLE) -> list[StageEvent]:
    """At each time, a heartbeat from each of `beats`, then a look; the events of them all."""
    for now in times:
        for stage in beats:
            liveness.heard(stage, now, 10 + stage)
        watch.observe(now, recovery)
    return watch.take_events()


def seconds(start: float, end: float, step: float = 1.0) -> list[float]:
    return [start + step * i for i in range(round((end - start) / step) + 1)]


@pytest.mark.parametrize(("endpoint", "host"), [
    ("tcp://10.0.0.2:5711", "10.0.0.2"), ("tcp://[::1]:5711", "::1"), ("tcp://stage-1:5711", "stage-1"),
    ("tcp://10.0.0.5;10.0.0.2:5711", "10.0.0.2"), ("ipc:///tmp/stage-1", "local"),
])
def test_the_host_of_an_endpoint(endpoint: str, host: str) -> None:
    assert endpoint_host(endpoint) == host


def test_a_silent_stage_is_down_once_reminded_every_10_s_and_back_once_with_its_time_down() -> None:
    watch, liveness = watched()
    assert look(watch, liveness, seconds(0.0, 3.0, 0.5), beats=(0, 1)) == []
    assert look(watch, liveness, seconds(3.5, 6.0, 0.5)) == []  # silent for 3.0 s: not yet
    [down] = look(watch, liveness, [6.1])
    assert (down.event, down.place.index) == ("stage_down", 1)
    assert down.message == ('stage 1 "stage-1" at 10.0.0.2 is down: no heartbeat for 3.1 s; no session waits for '
                            'it; new requests get 503 until it is back')
    assert down.fields() == {"stage": 1, "stage_id": "stage-1", "host": "10.0.0.2", "endpoint": "tcp://10.0.0.2:5711",
                             "cause": "no heartbeat for 3.1 s", "sessions": 0}
    assert look(watch, liveness, seconds(6.2, 16.0, 0.2)) == []  # one line, not one per look
    [again] = look(watch, liveness, [16.1])
    assert again.event == "still_waiting" and again.fields()["down_s"] == 10.0
    assert "is still down after 10 s (no heartbeat for 13 s)" in again.message
    assert look(watch, liveness, seconds(17.0, 26.0)) == []
    assert [e.event for e in look(watch, liveness, [26.1])] == ["still_waiting"]
    status = watch.statuses()[1]
    assert (status.state, status.up, status.downs) == ("down", False, 1)
    assert status.detail.startswith("down (no heartbeat for 3.1 s): check the stage is running at tcp://10.0.0.2:5711")
    assert status.down_seconds_at(30.1) == pytest.approx(24.0)
    [back] = look(watch, liveness, [31.1], beats=(0, 1))
    assert (back.event, back.fields()["restarted"], back.fields()["down_s"]) == ("stage_back", False, 25.0)
    assert back.message.startswith('stage 1 "stage-1" at 10.0.0.2 is back after 25.0 s down: the same process')
    status = watch.statuses()[1]
    assert (status.state, status.detail, status.downs) == ("up", "", 1)
    assert status.down_seconds == pytest.approx(25.0)
    assert look(watch, liveness, seconds(32.0, 60.0), beats=(0, 1)) == []


def test_every_wait_says_what_waits_and_for_how_long() -> None:
    watch, liveness = watched(recovery_timeout_s=60.0, silence_s=15.0)
    look(watch, liveness, [0.0], beats=(0, 1))
    [down] = look(watch, liveness, [4.0], recovery=RecoveryView(running=2))
    assert "2 running sessions waiting for it, up to 71 s more (held after 15 s of silence, then " \
           "--recovery-timeout 60 s)" in down.message
    assert (down.fields()["sessions"], down.fields()["gives_up_in_s"]) == (2, 71.0)
    held = RecoveryView(held={1: 12.0}, waiting=2, running=2)  # recovery held it at 12 s
    assert look(watch, liveness, [12.0, 13.9], recovery=held) == []
    [still] = look(watch, liveness, [14.0], recovery=held)
    assert "holding 2 sessions, waiting up to 58 s more for it to come back (--recovery-timeout 60 s)" in still.message
    off, liveness = watched(recovery_timeout_s=0.0)
    look(off, liveness, [0.0], beats=(0, 1))
    [down] = look(off, liveness, [4.0], recovery=RecoveryView(running=1))
    assert "recovery is off (--recovery-timeout 0): the sessions that wait on it fail" in down.message


def test_a_restart_replays_and_give_ups_are_each_one_line_and_counted() -> None:
    watch, liveness = watched()
    look(watch, liveness, [0.0, 1.0], beats=(0, 1))
    liveness.heard(1, 1.4, 99)
    watch.restarted(1, 1.4)  # quick enough never to be found down
    [back] = watch.take_events()
    assert back.event == "stage_back" and back.fields()["restarted"] is True and back.fields()["incarnation"] == 99
    assert "restarted: a new process, 0.4 s after its last heartbeat" in back.message
    watch.replayed([1], 2, 1.4)
    [replayed] = watch.take_events()
    assert replayed.event == "sessions_replayed" and replayed.fields()["sessions"] == 2
    assert replayed.message.startswith('2 sessions replayed after stage 1 "stage-1" at 10.0.0.2 failed')
    look(watch, liveness, [5.0])
    watch.gave_up([1], 1, 70.0)
    [gave_up] = watch.take_events()
    assert gave_up.event == "stage_gave_up" and gave_up.fields()["sessions"] == 1
    assert "did not come back within --recovery-timeout 60 s: 1 session failed" in gave_up.message
    status = watch.statuses()[1]
    assert (status.downs, status.restarts, status.sessions_replayed, status.sessions_given_up) == (1, 1, 2, 1)


def test_stage_0_taking_no_message_is_down_for_that_and_back_at_its_next_reply() -> None:
    watch, liveness = watched()
    look(watch, liveness, [0.0], beats=(0, 1))
    watch.found_down([0], 0.5)
    [down] = watch.take_events()
    assert "is down: it took no message from the driver within 15 s" in down.message
    watch.found_down([0], 0.6)  # already down: no second line
    assert watch.take_events() == []
    [back] = look(watch, liveness, [1.0], beats=(0, 1))
    assert (back.event, back.place.index) == ("stage_back", 0)


def test_a_stage_never_heard_is_named_after_5_s_with_what_to_check_then_every_10_s() -> None:
    watch, liveness = watched()
    assert look(watch, liveness, seconds(0.0, 4.5, 0.5)) == []
    [unheard] = look(watch, liveness, [5.0])
    assert (unheard.event, unheard.place.index) == ("stage_never_heard", 1)
    assert unheard.message == (
        'stage 1 "stage-1" at 10.0.0.2 not heard 5 s after the driver started (waiting for its first heartbeat): '
        f"check the stage is running at tcp://10.0.0.2:5711 and reaches the driver at {RETURNS}; CURVE: its public "
        "key must be keys/public/stage-1.key, and the public/driver.key of its keys_dir this driver's")
    assert watch.statuses()[1].state == "never_heard" and watch.statuses()[1].detail.startswith("never heard: check")
    assert look(watch, liveness, seconds(6.0, 14.0)) == []
    assert [e.event for e in look(watch, liveness, [15.0])] == ["still_waiting"]
    [heard] = look(watch, liveness, [16.0], beats=(0, 1))
    assert heard.event == "stage_heard" and "heard at last, 16 s after the driver started" in heard.message
    assert watch.statuses()[1].up


def test_a_key_refused_from_a_stage_s_host_explains_its_silence() -> None:
    watch, liveness = watched()
    watch.return_refused("10.0.0.7")  # nobody's host
    look(watch, liveness, [0.0])
    assert "refused" not in watch.statuses()[1].detail
    watch.return_refused("10.0.0.2")
    look(watch, liveness, [0.5])
    assert watch.statuses()[1].detail == (
        "never heard: the driver's return socket refused a CURVE key from 10.0.0.2: check the stage's public key "
        "matches keys/public/stage-1.key")
    look(watch, liveness, [1.0], beats=(0, 1))
    assert watch.statuses()[1].up


def test_the_link_to_stage_0_says_each_change_once_and_counts_every_failed_handshake() -> None:
    watch, _liveness = watched()
    watch.link(0, LinkTrouble.REFUSED, 0.1)  # not listening yet at startup: the never-heard line's business
    assert watch.take_events() == []
    assert watch.statuses()[0].detail == ("never heard: nothing accepts connections at tcp://10.0.0.1:5710: check the "
                                          "stage is running (it listens once its layers are loaded)")
    for now in (0.2, 0.4, 0.6):
        watch.link(0, LinkTrouble.AUTH, now, 400)
        watch.link(0, LinkTrouble.LOST, now)
        watch.link(0, LinkTrouble.REFUSED, now)
    [failed] = watch.take_events()
    assert (failed.event, failed.fields()["cause"], failed.fields()["code"]) == ("handshake_failed", "auth", 400)
    assert "failed: the stage refused the driver's key (ZAP status 400)" in failed.message
    assert watch.statuses()[0].handshakes_failed == (("auth", 3),)
    watch.link(0, None, 1.0)
    [up] = watch.take_events()
    assert up.event == "link_up" and up.fields()["down_s"] == 0.8
    watch.link(0, LinkTrouble.LOST, 2.0)
    watch.link(0, LinkTrouble.REFUSED, 2.1)  # still down: the drop said it
    [down] = watch.take_events()
    assert down.event == "link_down" and down.message.endswith("is down: the connection dropped")
    watch.link(0, None, 3.0)
    assert [e.event for e in watch.take_events()] == ["link_up"]
    assert watch.statuses()[0].link_downs == 1


def test_events_are_bounded_until_taken_and_statuses_change_only_with_news() -> None:
    watch, liveness = watched()
    look(watch, liveness, [0.0], beats=(0, 1))
    for now in range(MAX_EVENTS + 10):
        watch.replayed([1], 1, float(now))
    assert len(watch.take_events()) == MAX_EVENTS and watch.take_events() == []
    first = watch.statuses()
    look(watch, liveness, [1.0, 2.0], beats=(0, 1))
    assert watch.statuses() is first
    watch.restarted(1, 2.5)
    assert watch.statuses() is not first and watch.statuses()[1].restarts == 1


# --- through a scheduler: what its recovery tells the watch ---------------------------------------


def kinds(events: list[StageEvent]) -> list[tuple[str, int, Any]]:
    return [(e.event, e.place.index, e.details.get("sessions")) for e in events]


def test_a_scheduler_says_a_stage_down_back_and_its_sessions_replayed_once_each() -> None:
    sched, wire = scheduler(recovery_timeout_s=30.0)
    a, b = decoding(sched, wire)
    assert sched.watch.take_events() == []
    wire.reply(Reply.heartbeat(0, 0, 11), now=4.0)
    wire.tick(4.5)  # stage 1 silent 4.5 s, decode steps waiting 3.5 s: down, its sessions held
    assert sched.down == [LABELS[1]]
    assert kinds(sched.watch.take_events()) == [("stage_down", 1, 2)]
    for now in (5.0, 6.0, 7.0, 8.0):
        wire.reply(Reply.heartbeat(0, 0, 11), now)
        wire.tick(now)
    assert sched.watch.take_events() == []
    wire.reply(Reply.heartbeat(0, 0, 11), 9.0)
    wire.reply(Reply.heartbeat(1, 0, 23), 9.0)  # a new process
    assert kinds(sched.watch.take_events()) == [("stage_back", 1, None), ("sessions_replayed", 1, 2)]
    wire.tick(9.1)
    assert sched.watch.take_events() == [] and a.result.replays == b.result.replays == 1
    status = sched.watch.statuses()[1]
    assert (status.up, status.downs, status.restarts, status.sessions_replayed) == (True, 1, 1, 2)


def test_a_scheduler_says_when_it_gives_a_stage_up() -> None:
    sched, wire = scheduler(recovery_timeout_s=20.0)
    decoding(sched, wire)
    wire.reply(Reply.heartbeat(0, 0, 11), now=4.0)
    wire.tick(4.5)
    assert [e.event for e in sched.watch.take_events()] == ["stage_down"]
    for now in (14.5, 24.0):
        wire.reply(Reply.heartbeat(0, 0, 11), now)
        wire.tick(now)
    assert kinds(sched.watch.take_events()) == [("still_waiting", 1, 2)]
    wire.tick(24.6)
    assert kinds(sched.watch.take_events()) == [("stage_gave_up", 1, 2)]
    assert sched.watch.statuses()[1].sessions_given_up == 2 and sched.watch.statuses()[1].state == "down"


def test_with_recovery_off_stage_0_taking_no_message_is_said_too() -> None:
    sched, wire = scheduler()  # recovery off: the session fails, and the operator hears why
    beat(wire, 0.0)
    session = sched.submit(request())
    wire.full = True
    wire.tick(0.5)
    assert session.error is not None
    [down] = sched.watch.take_events()
    assert (down.event, down.place.index) == ("stage_down", 0)
    assert "is down: it took no message from the driver within 3 s; recovery is off" in down.message
    beat(wire, 1.0)
    wire.tick(1.0)
    assert [e.event for e in sched.watch.take_events()] == ["stage_back"]
