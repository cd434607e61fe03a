"""Socket-free and clock-free: what a driver tells its operator about each stage (docs/ARCHITECTURE.md,
"Observability"; docs/PROTOCOL.md §6, Recovery).

`StageWatch` follows every stage through up, down and back, and the driver's link to stage 0.
The scheduler and the recovery tell it what they decide (a stage restarted, found down, sessions
replayed or given up), the transport what libzmq says of the link (`LinkTrouble`), and each look
(`observe`) brings silence, the first heartbeat and the periodic reminders. It answers with
`StageEvent`s, one log line each (the shell writes them, plain or JSON), and `StageStatus`es:
what /health says of each stage and what /metrics counts.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from skippy_zmq.driver.lanes import Liveness

if TYPE_CHECKING:
    from skippy_zmq.config import TopologyConfig

SILENT_AFTER_S = 3.0
"""A stage with no heartbeat for this long is down for /health and the log (stages beat every second)."""
SAY_EVERY_S = 10.0
"""While a stage stays down or unheard, one `still_waiting` line this often."""
FIRST_SAY_S = 5.0
"""A stage not heard this long after the driver's first look is named (`stage_never_heard`)."""
MAX_EVENTS = 256
"""Events kept until taken (a driver that never takes them, `generate`, keeps the latest)."""


def _sessions(count: int, kind: str = "") -> str:
    """`1 session`, `2 running sessions`."""
    kind = f"{kind} " if kind else ""
    return f"{count} {kind}session" if count == 1 else f"{count} {kind}sessions"


def endpoint_host(endpoint: str) -> str:
    """The host of a ZeroMQ endpoint: `tcp://10.0.0.2:5711` -> `10.0.0.2`, `tcp://[::1]:5711` -> `::1`,
    anything but TCP -> `local`."""
    if not endpoint.startswith("tcp://"):
        return "local"
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].rpartition(";")[2]  # tcp://SOURCE;HOST:PORT
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@attrs.frozen
class StagePlace:
    """Where a stage is, as the operator finds it: index, id, endpoint and host, the public key file
    the driver trusts for it (CURVE on), and where its replies go."""

    index: int
    stage_id: str
    endpoint: str = ""  # its pull_connect
    key_file: str = ""  # keys_dir/public/<id>.key; "" without CURVE
    returns_to: str = ""  # the driver's return_connect

    @property
    def host(self) -> str:
        """The host of its endpoint ("" when unknown)."""
        return endpoint_host(self.endpoint) if self.endpoint else ""

    @property
    def name(self) -> str:
        """`stage 1 "stage-1"`."""
        return f'stage {self.index} "{self.stage_id}"'

    @property
    def where(self) -> str:
        """`stage 1 "stage-1" at 10.0.0.2`."""
        return f"{self.name} at {self.host}" if self.host else self.name

    @classmethod
    def of_topology(cls, topology: TopologyConfig) -> tuple[StagePlace, ...]:
        """Every stage of `topology`, in order."""
        from skippy_zmq.security.keys import KeyStore

        store = KeyStore.of(topology.security, topology.source) if topology.security.curve else None
        return tuple(cls(stage.index, stage.stage_id, stage.pull_connect,
                         "" if store is None else str(store.public_path(stage.stage_id)),
                         topology.driver.return_connect) for stage in topology.stages)


class LinkTrouble(enum.Enum):
    """What libzmq reported of the driver's connection to stage 0 (its socket monitor)."""

    LOST = "lost"  # the connection dropped
    REFUSED = "refused"  # nothing accepts connections at the endpoint
    KEY = "key"  # the stage hung up on the CURVE handshake: most likely its key is not the one used
    AUTH = "auth"  # the stage's ZAP handler refused the driver's key
    MECHANISM = "mechanism"  # CURVE on one end of the link only
    PROTOCOL = "protocol"  # another handshake protocol error (another kind of peer)

    @property
    def handshake(self) -> bool:
        """True for a failed handshake (counted, logged as `handshake_failed`), not a missing connection."""
        return self in (LinkTrouble.KEY, LinkTrouble.AUTH, LinkTrouble.MECHANISM, LinkTrouble.PROTOCOL)

    def reason(self, place: StagePlace, value: int = 0) -> str:
        """What is wrong with the link to the stage at `place`, and what to check (`value`: libzmq's code)."""
        if self is LinkTrouble.KEY:
            return (f"the stage hung up on the CURVE handshake: most likely its public key is not "
                    f"{place.key_file or 'the one the driver holds'} (the stage runs another key pair, or the file "
                    "is stale)")
        if self is LinkTrouble.AUTH:
            status = f" (ZAP status {value})" if value else ""
            return (f"the stage refused the driver's key{status}: the public/driver.key in the stage's keys_dir must "
                    "be this driver's")
        if self is LinkTrouble.MECHANISM:
            on = "the driver's topology" if place.key_file else "the stage's topology"
            return f"CURVE is on at one end only ([security] curve = true in {on}): both topologies must agree"
        if self is LinkTrouble.PROTOCOL:
            status = f" {value:#x}" if value else ""
            return f"handshake protocol error{status}: is it a stage of this pipeline that listens at {place.endpoint}?"
        if self is LinkTrouble.REFUSED:
            return (f"nothing accepts connections at {place.endpoint}: check the stage is running (it listens once "
                    "its layers are loaded)")
        return "the connection dropped"


@attrs.frozen
class StageEvent:
    """One thing the operator is told about a stage: one log line (`event`, `message`, `fields()`)."""

    event: str
    place: StagePlace
    message: str
    details: Mapping[str, Any] = attrs.field(factory=dict)

    def fields(self) -> dict[str, Any]:
        """The JSON fields of its line: the stage's index, id, host and endpoint, then the details."""
        return {"stage": self.place.index, "stage_id": self.place.stage_id, "host": self.place.host,
                "endpoint": self.place.endpoint, **self.details}


@attrs.frozen
class StageStatus:
    """One stage as /health reports it (`state`, `detail`) and /metrics counts it."""

    place: StagePlace
    state: str  # "up", "down" or "never_heard"
    detail: str = ""  # why it is not up, and what to check
    down_since: float | None = None
    downs: int = 0
    down_seconds: float = 0.0  # of the episodes that ended (`down_seconds_at` adds the one under way)
    restarts: int = 0
    sessions_replayed: int = 0
    sessions_given_up: int = 0
    link_downs: int = 0
    handshakes_failed: tuple[tuple[str, int], ...] = ()  # by LinkTrouble value

    @property
    def up(self) -> bool:
        """True while it heartbeats."""
        return self.state == "up"

    def down_seconds_at(self, now: float) -> float:
        """Seconds down in all, the episode under way included."""
        return self.down_seconds + (0.0 if self.down_since is None else max(now - self.down_since, 0.0))

    def as_json(self) -> dict[str, Any]:
        """Its entry in /health's `stages`."""
        place = self.place
        return {"index": place.index, "id": place.stage_id, "host": place.host, "endpoint": place.endpoint,
                "state": self.state, "detail": self.detail}


@attrs.define
class _Track:
    """What the watch remembers of one stage."""

    place: StagePlace
    seen: float | None = None  # its last heartbeat as of the latest look
    down_since: float | None = None  # when it was found down (None: up, or never heard)
    cause: str = ""  # why it was found down
    silent: bool = False  # found down for want of a heartbeat (the cause's figure grows)
    said_at: float = -math.inf  # its latest line (paces `still_waiting`)
    unheard_said: bool = False  # a `stage_never_heard` line was written
    link: LinkTrouble | None = None  # stage 0: what is wrong with the driver's link to it
    link_since: float = 0.0
    link_was_up: bool = False
    refused: bool = False  # a CURVE key from its host was refused on the return socket since it was heard
    downs: int = 0
    down_seconds: float = 0.0
    restarts: int = 0
    replayed: int = 0
    given_up: int = 0
    link_downs: int = 0
    handshakes_failed: dict[str, int] = attrs.Factory(dict)


@attrs.frozen
class RecoveryView:
    """What recovery holds at a look: stages it waits for and since when, sessions waiting to replay,
    sessions running."""

    held: Mapping[int, float] = attrs.field(factory=dict)
    waiting: int = 0
    running: int = 0


class StageWatch:
    """Follows every stage and says what changed (see the module docstring); engine thread only, but
    for `return_refused`."""

    def __init__(self, places: Sequence[StagePlace], liveness: Liveness, *, recovery_timeout_s: float,
                 recovery_silence_s: float, send_timeout_s: float, silent_after_s: float = SILENT_AFTER_S,
                 say_every_s: float = SAY_EVERY_S, first_say_s: float = FIRST_SAY_S) -> None:
        """`recovery_silence_s`: the silence after which recovery holds a stage's sessions;
        `send_timeout_s`: how long stage 0 may take no message before it is down."""
        self._tracks = [_Track(place) for place in places]
        self._liveness = liveness
        self.recovery_timeout_s = recovery_timeout_s
        self.recovery_silence_s = recovery_silence_s
        self.send_timeout_s = send_timeout_s
        self.silent_after_s = min(silent_after_s, recovery_silence_s)
        self.say_every_s = say_every_s
        self.first_say_s = first_say_s
        self._started: float | None = None
        self._recovery = RecoveryView()
        self._events: deque[StageEvent] = deque(maxlen=MAX_EVENTS)
        self._refusals: deque[str] = deque(maxlen=MAX_EVENTS)  # peer addresses, from the ZAP thread
        self._statuses: tuple[StageStatus, ...] | None = None  # None: changed since the last snapshot

    # --- what the driver tells it -------------------------------------------------------------

    def observe(self, now: float, recovery: RecoveryView) -> None:
        """A look at every stage: found silent, heard again or at last, still down or unheard."""
        if self._started is None:
            self._started = now
        self._recovery = recovery
        while self._refusals:
            address = self._refusals.popleft()
            for track in self._tracks:
                if track.place.host == address and not track.refused:
                    track.refused, self._statuses = True, None
        self._back(now)
        for index, track in enumerate(self._tracks):
            heard = self._liveness.last_heard(index)
            if heard is None:
                self._unheard(track, now)
            elif track.down_since is None and now - heard > self.silent_after_s:
                self._down(track, now, f"no heartbeat for {now - heard:.1f} s", silent=True)
            elif track.down_since is not None and now - track.said_at >= self.say_every_s:
                cause = f"no heartbeat for {now - heard:.0f} s" if track.silent else track.cause
                text, details = self._waits(track, now)
                self._say(track, now, "still_waiting", f"{track.place.where} is still down after "
                          f"{now - track.down_since:.0f} s ({cause}); {text}", state="down",
                          down_s=round(now - track.down_since, 1), **details)
            if track.seen is None and heard is not None:
                track.refused, self._statuses = False, None  # heard at last: up
            track.seen = heard

    def found_down(self, stages: Sequence[int], now: float) -> None:
        """Recovery found stages down (silent while requests wait, or stage 0 taking no message)."""
        for stage in stages:
            track = self._tracks[stage]
            if track.down_since is None:
                heard = self._liveness.last_heard(stage)
                if heard is not None and now - heard > self.silent_after_s:
                    self._down(track, now, f"no heartbeat for {now - heard:.1f} s", silent=True)
                else:
                    self._down(track, now, f"it took no message from the driver within {self.send_timeout_s:g} s",
                               silent=False)

    def restarted(self, stage: int, now: float) -> None:
        """The stage's heartbeat carries a new incarnation: a new process, its sessions lost."""
        track = self._tracks[stage]
        track.restarts += 1
        incarnation = self._liveness.incarnation(stage)
        if track.down_since is not None:
            down_s = self._up(track, now)
            text = f"{track.place.where} is back after {down_s:.1f} s down: a new process"
        else:
            down_s = 0.0 if track.seen is None else now - track.seen
            text = f"{track.place.where} restarted: a new process, {down_s:.1f} s after its last heartbeat"
        self._say(track, now, "stage_back", text + " (a new incarnation); the sessions it held are lost",
                  restarted=True, incarnation=incarnation, down_s=round(down_s, 1))

    def replayed(self, stages: Sequence[int], count: int, now: float) -> None:
        """`count` sessions started over because of `stages`."""
        self._back(now)  # a stage heard again is back before its sessions replay
        for stage in stages:
            track = self._tracks[stage]
            track.replayed += count
            self._say(track, now, "sessions_replayed", f"{_sessions(count)} replayed after {track.place.where} "
                      "failed: each starts over from its prompt and the tokens so far; no text is lost",
                      sessions=count)

    def gave_up(self, stages: Sequence[int], count: int, now: float) -> None:
        """Recovery stopped waiting for `stages` and failed the `count` sessions that waited."""
        for stage in stages:
            track = self._tracks[stage]
            track.given_up += count
            self._say(track, now, "stage_gave_up", f"{track.place.where} did not come back within --recovery-timeout "
                      f"{self.recovery_timeout_s:g} s: {_sessions(count)} failed; new requests get 503 until it is "
                      "back", sessions=count, waited_s=self.recovery_timeout_s)

    def link(self, stage: int, trouble: LinkTrouble | None, now: float, value: int = 0) -> None:
        """libzmq's news of the driver's link to the stage: `trouble`, or None for a handshake that
        succeeded. A handshake failure is counted every time; a line is written when the link's state
        changes (a drop that follows a failed handshake changes nothing)."""
        track = self._tracks[stage]
        if trouble is None:
            if track.link is not None and (track.link_was_up or track.link.handshake):
                self._say(track, now, "link_up", f"the driver's link to {track.place.where} ({track.place.endpoint}) "
                          f"is up again after {now - track.link_since:.1f} s", down_s=round(now - track.link_since, 1))
            self._statuses = None if track.link is not None else self._statuses
            track.link, track.link_was_up = None, True
            return
        if trouble.handshake:
            track.handshakes_failed[trouble.value] = track.handshakes_failed.get(trouble.value, 0) + 1
            self._statuses = None
        if track.link is trouble or (track.link is not None and not trouble.handshake):
            return  # no change: the same trouble, or a drop or refusal after any trouble (which says more)
        track.link, track.link_since, self._statuses = trouble, now, None
        reason = trouble.reason(track.place, value)
        if trouble.handshake:
            self._say(track, now, "handshake_failed", f"the driver's handshake with {track.place.where} "
                      f"({track.place.endpoint}) failed: {reason}", cause=trouble.value, code=value)
        elif track.link_was_up:  # at startup a stage not listening yet is the never-heard line's business
            track.link_downs += 1
            self._say(track, now, "link_down", f"the driver's link to {track.place.where} ({track.place.endpoint}) "
                      f"is down: {reason}", cause=trouble.value)

    def return_refused(self, address: str) -> None:
        """The driver's return socket refused a CURVE key from `address` (any thread: the ZAP handler's)."""
        self._refusals.append(address)

    # --- what it answers ----------------------------------------------------------------------

    def take_events(self) -> list[StageEvent]:
        """The events since the last call, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events

    def statuses(self) -> tuple[StageStatus, ...]:
        """Every stage's status (a new tuple only after something changed)."""
        if self._statuses is None:
            self._statuses = tuple(self._status(track) for track in self._tracks)
        return self._statuses

    # --- inside -------------------------------------------------------------------------------

    def _status(self, track: _Track) -> StageStatus:
        if track.down_since is not None:
            state, detail = "down", f"down ({track.cause}): {self._hint(track)}"
        elif track.seen is None:
            state, detail = "never_heard", f"never heard: {self._hint(track)}"
        else:
            state, detail = "up", ""
        return StageStatus(track.place, state, detail, track.down_since, track.downs, track.down_seconds,
                           track.restarts, track.replayed, track.given_up, track.link_downs,
                           tuple(sorted(track.handshakes_failed.items())))

    def _back(self, now: float) -> None:
        """Stages found down and heard since, and stages heard at last after being named unheard."""
        for index, track in enumerate(self._tracks):
            heard = self._liveness.last_heard(index)
            if heard is None:
                continue
            if track.down_since is not None and heard > track.down_since:
                incarnation = self._liveness.incarnation(index)
                down_s = self._up(track, now)
                self._say(track, now, "stage_back", f"{track.place.where} is back after {down_s:.1f} s down: the same "
                          "process answers again (its incarnation is unchanged)", restarted=False,
                          incarnation=incarnation, down_s=round(down_s, 1))
            elif track.unheard_said and track.seen is None:
                track.unheard_said, track.seen, track.refused = False, heard, False
                after = now - (self._started if self._started is not None else now)
                self._say(track, now, "stage_heard", f"{track.place.where} heard at last, {after:.0f} s after the "
                          "driver started", after_s=round(after, 1))

    def _down(self, track: _Track, now: float, cause: str, *, silent: bool) -> None:
        track.down_since, track.cause, track.silent = now, cause, silent
        track.downs += 1
        text, details = self._waits(track, now)
        self._say(track, now, "stage_down", f"{track.place.where} is down: {cause}; {text}", cause=cause, **details)

    def _up(self, track: _Track, now: float) -> float:
        assert track.down_since is not None, "only a stage found down comes back"
        down_s = max(now - track.down_since, 0.0)
        track.down_seconds += down_s
        track.down_since, track.cause, track.refused = None, "", False
        self._statuses = None
        return down_s

    def _unheard(self, track: _Track, now: float) -> None:
        started = self._started if self._started is not None else now
        if now - started < self.first_say_s or now - track.said_at < self.say_every_s:
            return
        event = "still_waiting" if track.unheard_said else "stage_never_heard"
        track.unheard_said = True
        self._say(track, now, event, f"{track.place.where} not heard {now - started:.0f} s after the driver "
                  f"started (waiting for its first heartbeat): {self._hint(track)}", state="never_heard",
                  after_s=round(now - started, 1))

    def _waits(self, track: _Track, now: float) -> tuple[str, dict[str, Any]]:
        """What waits for a stage that is down, and for how long at most."""
        recovery, timeout = self._recovery, self.recovery_timeout_s
        since = recovery.held.get(track.place.index)
        if timeout <= 0:
            return ("recovery is off (--recovery-timeout 0): the sessions that wait on it fail",
                    {"sessions": recovery.running})
        if since is not None:
            left = max(since + timeout - now, 0.0)
            return (f"holding {_sessions(recovery.waiting)}, waiting up to {left:.0f} s more for it to come back "
                    f"(--recovery-timeout {timeout:g} s)",
                    {"sessions": recovery.waiting, "gives_up_in_s": round(left, 1)})
        if recovery.running:
            heard = track.seen if track.seen is not None else now
            left = max(heard + self.recovery_silence_s + timeout - now, 0.0)
            return (f"{_sessions(recovery.running, 'running')} waiting for it, up to {left:.0f} s more (held after "
                    f"{self.recovery_silence_s:g} s of silence, then --recovery-timeout {timeout:g} s)",
                    {"sessions": recovery.running, "gives_up_in_s": round(left, 1)})
        return "no session waits for it; new requests get 503 until it is back", {"sessions": 0}

    def _hint(self, track: _Track) -> str:
        """What to check for a stage the driver does not hear."""
        place = track.place
        if track.link is not None:
            return track.link.reason(place)
        if place.key_file and track.refused:
            return (f"the driver's return socket refused a CURVE key from {place.host}: check the stage's public key "
                    f"matches {place.key_file}")
        key = (f"; CURVE: its public key must be {place.key_file}, and the public/driver.key of its keys_dir "
               "this driver's" if place.key_file else "")
        return (f"check the stage is running at {place.endpoint or '?'} and reaches the driver at "
                f"{place.returns_to or '?'}{key}")

    def _say(self, track: _Track, now: float, event: str, message: str, **details: Any) -> None:
        track.said_at = now
        self._statuses = None
        self._events.append(StageEvent(event, track.place, message, details))
