"""serve --sleep-idle-seconds: when the local stages stop, what wakes them, and a real serve doing both."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from skippy_zmq.errors import ConfigError, StageTimeout
from skippy_zmq.gateway.openai_api import ApiError
from skippy_zmq.gateway.options import ServeOptions
from skippy_zmq.gateway.sleep import PipelineSleep, SleepSchedule, SleepState

WAIT_S = 5.0


def test_the_schedule_falls_asleep_only_idle_long_enough_with_nothing_in_flight() -> None:
    schedule = SleepSchedule(idle_s=2.0, last_use=0.0)
    assert not schedule.due(1.9, engine_busy=False) and schedule.due(2.0, engine_busy=False)
    assert not schedule.due(3.0, engine_busy=True)  # a request of another front end runs: the idle time restarts
    assert not schedule.due(4.9, engine_busy=False) and schedule.due(5.0, engine_busy=False)
    assert schedule.begin() is False  # awake: nothing to wake
    assert not schedule.due(100.0, engine_busy=False)  # never while a request of its own is in flight
    schedule.end(100.0)
    assert not schedule.due(101.0, engine_busy=False) and schedule.due(102.0, engine_busy=False)
    schedule.state = SleepState.ASLEEP
    assert schedule.sleeping and not schedule.due(200.0, engine_busy=False)
    assert schedule.begin() is True  # asleep: this request wakes it
    with pytest.raises(ValueError):
        SleepSchedule(idle_s=0.0, last_use=0.0)


class FakeSleeper:
    """Records the stops and starts; `fail` makes a wake fail; `gate` holds a wake until it is set."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()

    def sleep(self) -> None:
        self.calls.append("sleep")

    def wake(self) -> None:
        self.calls.append("wake")
        assert self.gate.wait(WAIT_S), "the test never let the wake finish"
        if self.fail:
            raise StageTimeout("stage-1 (pid 7) not ready after 5 s")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sleep(sleeper: FakeSleeper, clock: Clock, busy: list[bool] | None = None) -> tuple[PipelineSleep, list[str]]:
    said: list[str] = []
    engine = busy if busy is not None else [False]
    sleep = PipelineSleep(SleepSchedule(idle_s=10.0, last_use=0.0), sleeper, lambda: engine[0],
                          lambda kind, _text: said.append(kind), clock)
    return sleep, said


async def _until(predicate: Any) -> None:
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.01)


def test_the_watch_stops_the_idle_stages_and_a_request_starts_them_once_for_all_waiting() -> None:
    sleeper, clock = FakeSleeper(), Clock()
    sleep, said = _sleep(sleeper, clock)

    async def scenario() -> None:
        watch = asyncio.ensure_future(sleep.watch())
        try:
            clock.now = 9.0
            await asyncio.sleep(0.5)
            assert sleeper.calls == [] and not sleep.sleeping
            clock.now = 10.0
            await _until(lambda: sleep.schedule.state is SleepState.ASLEEP)
            assert sleeper.calls == ["sleep"] and sleep.sleeping and said == ["sleeping"]
            sleeper.gate.clear()  # two requests wait for one wake

            async def request() -> str:
                async with sleep.use():
                    assert not sleep.sleeping  # the handler runs with the stages up
                    return "answered"

            both = asyncio.gather(request(), request())
            await _until(lambda: sleeper.calls == ["sleep", "wake"])
            assert sleep.schedule.state is SleepState.WAKING and sleep.sleeping
            sleeper.gate.set()
            assert await both == ["answered", "answered"]
            assert sleeper.calls == ["sleep", "wake"] and said == ["sleeping", "waking", "awake"]
            clock.now = 15.0
            async with sleep.use():  # in flight across the idle time: no sleep under it
                clock.now = 40.0
                await asyncio.sleep(0.5)
                assert sleeper.calls == ["sleep", "wake"]
            await asyncio.sleep(0.5)
            assert sleeper.calls == ["sleep", "wake"]  # the idle time counts from its end (40)
            clock.now = 50.0
            await _until(lambda: sleeper.calls == ["sleep", "wake", "sleep"])
        finally:
            watch.cancel()

    asyncio.run(scenario())


def test_a_wake_that_fails_is_a_503_naming_why_and_the_next_request_tries_again() -> None:
    sleeper, clock = FakeSleeper(), Clock()
    sleep, _ = _sleep(sleeper, clock)
    sleep.schedule.state = SleepState.ASLEEP
    sleeper.fail = True

    async def scenario() -> None:
        with pytest.raises(ApiError) as refused:
            async with sleep.use():
                raise AssertionError("the handler must not run")
        assert refused.value.status == 503 and "could not wake" in refused.value.message
        assert "stage-1 (pid 7) not ready" in refused.value.message
        assert sleep.schedule.state is SleepState.ASLEEP and sleep.schedule.in_use == 0
        sleeper.fail = False
        async with sleep.use():
            assert sleep.schedule.state is SleepState.AWAKE
        assert sleeper.calls == ["wake", "wake"]

    asyncio.run(scenario())


def test_sleeping_needs_stages_serve_starts_itself_and_a_positive_time() -> None:
    with pytest.raises(ConfigError, match="with --topology the stages are started elsewhere"):
        ServeOptions(topology_path="t.toml", sleep_idle_s=5.0)
    with pytest.raises(ConfigError, match="--sleep-idle-seconds -1 must be a positive number"):
        ServeOptions(sleep_idle_s=-1.0)
    assert ServeOptions(sleep_idle_s=0.5).sleep_idle_s == 0.5


# --- a real serve --------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """The live child processes of `pid` (from /proc: the fourth field of each process's stat is its parent)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                children.append(int(entry.name))
    return children


@pytest.mark.slow
def test_a_real_serve_stops_its_stages_when_idle_and_a_request_starts_them(tiny_gemma3_path: Path) -> None:
    import requests

    from tests.gateway.test_command import serving, wait_for

    with serving("--model", str(tiny_gemma3_path), "--stages", "2", "--ctx-size", "256",
                 "--sleep-idle-seconds", "1") as gateway:
        gateway.wait_healthy()
        assert len(_children(gateway.process.pid)) == 2  # the stage processes
        wait_for(lambda: gateway.get("/props")[1]["is_sleeping"], 30, "/props says is_sleeping")
        gateway.wait_event("stages_stopped", 10)
        status, health, _ = gateway.get("/health")
        assert (status, health["status"], health["sleeping"]) == (200, "ok", True)  # it serves: a request wakes it
        assert gateway.get("/v1/models")[0] == 200 and gateway.get("/props")[1]["is_sleeping"]  # these do not wake
        assert _children(gateway.process.pid) == []  # stopped: their memory is the system's again
        answer = requests.post(f"{gateway.url}/completion", json={"prompt": "Hello", "n_predict": 2}, timeout=120)
        assert answer.status_code == 200 and answer.json()["tokens_predicted"] == 2
        assert not gateway.get("/props")[1]["is_sleeping"] and len(_children(gateway.process.pid)) == 2
        assert [event["event"] for event in gateway.events if event["event"] in ("sleeping", "waking", "awake")][
            :3] == ["sleeping", "waking", "awake"]
        assert not any(event["event"] == "fatal" for event in gateway.events)
        gateway.process.send_signal(signal.SIGTERM)
        assert gateway.stop() == 0
