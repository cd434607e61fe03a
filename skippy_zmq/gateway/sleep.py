"""`serve --sleep-idle-seconds`: the local stages stop when nothing has used the model for a while, and the
next request that needs them starts them again (docs/PROTOCOL.md §9.6, Sleeping).

`SleepSchedule` decides, socket-free and clock-free: when the pipeline is due to fall asleep (no request
of its own in flight, the engine idle, the idle time passed) and when it must wake. `PipelineSleep` is the
shell: it owns the watch task and the wake-up (one at a time, shared by the requests that wait for it), and
calls the `Sleeper` (the pipeline starter) to stop and start the stage processes off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import attrs

from skippy_zmq.errors import SkippyError
from skippy_zmq.gateway.openai_api import ApiError

WATCH_INTERVAL_S = 0.2
"""How often the watch looks whether the pipeline is due to fall asleep."""


class SleepState(enum.Enum):
    """Where the local pipeline is between serving and sleeping."""

    AWAKE = "awake"
    FALLING = "falling asleep"  # its stages are being stopped
    ASLEEP = "asleep"
    WAKING = "waking"  # its stages are starting


@attrs.define
class SleepSchedule:
    """When the pipeline falls asleep: `idle_s` after the last request that used it ended, with none in flight
    and the engine idle; any request that needs it wakes it."""

    idle_s: float = attrs.field(validator=attrs.validators.gt(0))
    last_use: float
    in_use: int = 0  # requests of the routes that need the model, in flight
    state: SleepState = SleepState.AWAKE

    def begin(self) -> bool:
        """A request that needs the model starts; whether the pipeline must wake first."""
        self.in_use += 1
        return self.state is not SleepState.AWAKE

    def end(self, now: float) -> None:
        """That request ended at `now`."""
        self.in_use -= 1
        self.last_use = now

    def due(self, now: float, *, engine_busy: bool) -> bool:
        """Whether to fall asleep now (`engine_busy`: the engine runs or queues requests, of any front end)."""
        if engine_busy:
            self.last_use = now  # the idle time counts from when the engine last worked
        return (self.state is SleepState.AWAKE and not self.in_use and not engine_busy
                and now - self.last_use >= self.idle_s)

    @property
    def sleeping(self) -> bool:
        """True unless the stages serve (/props' `is_sleeping`): falling asleep, asleep or waking."""
        return self.state is not SleepState.AWAKE


class Sleeper(Protocol):
    """What stops and starts the local stages (the pipeline starter); both block."""

    def sleep(self) -> None:
        """Stop the stage processes."""

    def wake(self) -> None:
        """Start them again and wait until they serve; SkippyError when they do not."""


class PipelineSleep:
    """The shell around a SleepSchedule: the watch that puts the pipeline to sleep, the wake-up requests share."""

    def __init__(self, schedule: SleepSchedule, sleeper: Sleeper, engine_busy: Callable[[], bool],
                 say: Callable[[str, str], None], clock: Callable[[], float] = time.monotonic) -> None:
        """`engine_busy`: whether the engine runs or queues anything; `say(kind, text)`: serve's log."""
        self.schedule = schedule
        self.sleeper = sleeper
        self.engine_busy = engine_busy
        self.say = say
        self.clock = clock
        self._lock = asyncio.Lock()  # one fall or wake at a time

    @property
    def sleeping(self) -> bool:
        """Whether the stages are stopped, stopping or starting."""
        return self.schedule.sleeping

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[None]:
        """Around a request that needs the model: the pipeline awake first (waking it if it sleeps; ApiError
        503 naming why it could not), and no sleep while the request runs."""
        must_wake = self.schedule.begin()
        try:
            if must_wake:
                await self._wake()
            yield
        finally:
            self.schedule.end(self.clock())

    async def _wake(self) -> None:
        async with self._lock:
            if self.schedule.state is SleepState.AWAKE:
                return  # another request woke it meanwhile
            self.schedule.state = SleepState.WAKING
            self.say("waking", "waking: starting the stages for a request")
            started = self.clock()
            try:
                await asyncio.to_thread(self.sleeper.wake)
            except SkippyError as exc:
                self.schedule.state = SleepState.ASLEEP
                raise ApiError.unavailable(f"the pipeline was asleep and could not wake: {exc}") from None
            self.schedule.state = SleepState.AWAKE
            self.say("awake", f"awake: the stages serve again after {self.clock() - started:.1f} s")

    async def watch(self) -> None:
        """Put the pipeline to sleep whenever it is due, until cancelled."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.schedule.due(self.clock(), engine_busy=self.engine_busy()):
                await self._fall_asleep()

    async def _fall_asleep(self) -> None:
        async with self._lock:
            if not self.schedule.due(self.clock(), engine_busy=self.engine_busy()):
                return  # a request came meanwhile
            self.schedule.state = SleepState.FALLING
            self.say("sleeping", f"sleeping: no request for {self.schedule.idle_s:g} s; stopping the stages "
                     "(the next request starts them)")
            await asyncio.to_thread(self.sleeper.sleep)
            self.schedule.state = SleepState.ASLEEP
