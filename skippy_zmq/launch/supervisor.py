"""Socket-free, clock-free supervision of local stage processes: when to kill, restart or give up.

`skippy-zmq up` reports each stage's state (exited, ready, age of its last heartbeat) and carries
out the commands this returns. A stage that dies is restarted after a backoff; one whose
heartbeats stop for longer than the silence threshold (frozen, or stuck) is killed first; one
that does not get ready in time is killed too. More than `max_restarts` restarts of one stage
within `window_s` (or any death with `max_restarts` 0) ends supervision (docs/ARCHITECTURE.md,
Supervision).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import TypeAlias

import attrs

from skippy_zmq import defaults
from skippy_zmq.errors import ConfigError

DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_WINDOW_S = 600.0
DEFAULT_STAGE_SILENCE_S = 10.0
"""A ready stage whose heartbeats stop for this long is killed and restarted."""
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
"""Wait before the n-th restart in a row of a crash-looping stage (the last value repeats)."""
STABLE_S = 2.0
"""A stage that served this long after it got ready was not crash-looping (a crash loop dies
while loading or on its first messages): its next restart waits the first backoff again.
Restarts still count against --max-restarts."""


@attrs.frozen
class RestartPolicy:
    """How `up` treats a failed stage."""

    max_restarts: int = attrs.field(default=DEFAULT_MAX_RESTARTS)
    window_s: float = DEFAULT_RESTART_WINDOW_S
    silence_s: float = DEFAULT_STAGE_SILENCE_S
    ready_timeout_s: float = defaults.READY_TIMEOUT_S
    backoff_s: tuple[float, ...] = BACKOFF_S
    stable_s: float = STABLE_S

    @max_restarts.validator
    def _check(self, _attribute: attrs.Attribute[int], value: int) -> None:
        if value < 0:
            raise ConfigError(f"max_restarts {value} must be 0 (no restarts) or more")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before restart number `attempt` (0-based) of a crash loop."""
        return self.backoff_s[min(attempt, len(self.backoff_s) - 1)]


@attrs.frozen
class StageStatus:
    """What the launcher sees of one stage process at one moment."""

    exited: bool
    ready: bool
    started_at: float
    beat_age_s: float | None = None  # seconds since its last heartbeat; None before the first
    exit_text: str = ""
    ready_for_s: float | None = None  # how long it had been ready (until now, or until it exited)


@attrs.frozen
class Kill:
    """Kill the stage's process (SIGKILL): it is frozen or never got ready."""

    stage_id: str
    reason: str


@attrs.frozen
class Start:
    """Start the stage again (its old process has exited)."""

    stage_id: str
    reason: str
    attempt: int  # 1 for the first restart within the window


@attrs.frozen
class GiveUp:
    """Too many restarts (or restarts are off): stop every stage and fail."""

    stage_id: str
    reason: str


Command: TypeAlias = Kill | Start | GiveUp


@attrs.define
class _Watch:
    restarts: deque[float] = attrs.Factory(deque)  # when each restart within the window began
    loop: int = 0  # restarts in a row that died before they were stable
    restart_at: float | None = None
    cause: str = ""
    killed: bool = False


class Supervisor:
    """Decides, from each stage's status, which stages to kill, restart or give up on."""

    def __init__(self, stage_ids: Iterable[str], policy: RestartPolicy) -> None:
        self.policy = policy
        self._watch = {stage_id: _Watch() for stage_id in stage_ids}

    def restarts(self, stage_id: str) -> int:
        """Restarts of `stage_id` within the current window."""
        return len(self._watch[stage_id].restarts)

    def step(self, now: float, status: Mapping[str, StageStatus]) -> list[Command]:
        """The commands due at `now`; Start and Kill are carried out before the next step."""
        commands: list[Command] = []
        for stage_id, seen in status.items():
            watch = self._watch[stage_id]
            while watch.restarts and now - watch.restarts[0] > self.policy.window_s:
                watch.restarts.popleft()
            if seen.exited:
                commands += self._exited(stage_id, watch, seen, now)
            elif seen.ready and seen.beat_age_s is not None and seen.beat_age_s > self.policy.silence_s:
                if not watch.killed:
                    watch.killed = True
                    watch.cause = f"no heartbeat for {seen.beat_age_s:.1f} s (frozen or stuck)"
                    commands.append(Kill(stage_id, watch.cause))
            elif not seen.ready and now - seen.started_at > self.policy.ready_timeout_s and not watch.killed:
                watch.killed = True
                watch.cause = f"not ready {self.policy.ready_timeout_s:g} s after it started"
                commands.append(Kill(stage_id, watch.cause))
        return commands

    def _exited(self, stage_id: str, watch: _Watch, seen: StageStatus, now: float) -> list[Command]:
        if watch.restart_at is None:
            cause = watch.cause or seen.exit_text or "exited"
            attempt = len(watch.restarts)
            if attempt >= self.policy.max_restarts:
                limit = (
                    "restarts are off (--max-restarts 0)" if self.policy.max_restarts == 0
                    else f"{attempt} restarts within {self.policy.window_s:g} s already"
                )
                return [GiveUp(stage_id, f"{cause}; {limit}")]
            stable = seen.ready_for_s is not None and seen.ready_for_s >= self.policy.stable_s
            watch.loop = 0 if stable else watch.loop
            watch.restart_at = now + self.policy.backoff(watch.loop)
            watch.loop += 1
            watch.cause = cause
        if now < watch.restart_at:
            return []
        watch.restarts.append(now)
        reason, watch.cause, watch.restart_at, watch.killed = watch.cause, "", None, False
        return [Start(stage_id, reason, len(watch.restarts))]
