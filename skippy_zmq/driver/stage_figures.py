"""Socket-free and clock-free: each stage's figures as its driver last saw them, what `GET /stages` shows
(docs/PROTOCOL.md §9.1): its load from its heartbeats (resident memory and lanes in use, §2.4), and where a
generated token's time went on it over the last `WINDOW_S` seconds, from the traces the decode steps' replies
carry (§2.2: queue, decode, compute, encode, and the link to the next stage or, from the last, to the driver).

The engine thread feeds the book (`beat`, `token`) and takes `snapshot`s, frozen values that other threads
read without a lock; a snapshot is made at most every `SNAPSHOT_EVERY_S`, so a busy engine pays for one
per half second, not one per token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from skippy_zmq.telemetry import HopTiming
from skippy_zmq.wire.replies import StageLoad

WINDOW_S = 10
"""The seconds a token split averages over (whole seconds of the driver's clock, the current one included)."""
SNAPSHOT_EVERY_S = 0.5
"""The shortest time between two snapshots."""
_PARTS = 5  # queue, decode, compute, encode, link


@attrs.frozen
class TokenSplit:
    """Where a token's time went on one stage, mean µs per decode-step token over the window."""

    tokens: int  # decode-step tokens the means are over
    queue_us: float  # from receipt to the start of work (the stage's batching)
    decode_us: float  # decoding the input activation
    compute_us: float  # the layers (on the last stage, the head and sampling too)
    encode_us: float  # encoding the output activation
    link_us: float  # from the stage's send to the next one's receipt (the driver's, from the last stage)

    @property
    def total_us(self) -> float:
        """The token's time on this stage and its outgoing link."""
        return self.queue_us + self.decode_us + self.compute_us + self.encode_us + self.link_us


@attrs.frozen
class StageFigures:
    """One stage as the driver last saw it: its latest heartbeat (when, on the driver's clock, and the load it
    carried) and its token split over the window (None: no decode-step token in it)."""

    index: int
    beat_at: float | None = None  # None: no heartbeat yet
    load: StageLoad | None = None  # None: no heartbeat yet, or a stage that sends no load
    split: TokenSplit | None = None


class _Window:
    """One stage's per-second sums: [second, tokens, queue, decode, compute, encode, link]."""

    def __init__(self) -> None:
        self.buckets: deque[list[int]] = deque()

    def add(self, second: int, hop: HopTiming, window_s: int) -> None:
        if not self.buckets or self.buckets[-1][0] != second:
            self.buckets.append([second, 0] + [0] * _PARTS)
            while self.buckets[0][0] <= second - window_s:
                self.buckets.popleft()
        bucket = self.buckets[-1]
        bucket[1] += 1
        for place, value in enumerate((hop.queue_us, hop.decode_us, hop.compute_us, hop.encode_us,
                                       hop.transfer_us), start=2):
            bucket[place] += value

    def split(self, second: int, window_s: int) -> TokenSplit | None:
        recent = [bucket for bucket in self.buckets if bucket[0] > second - window_s]
        tokens = sum(bucket[1] for bucket in recent)
        if not tokens:
            return None
        means = [sum(bucket[place] for bucket in recent) / tokens for place in range(2, 2 + _PARTS)]
        return TokenSplit(tokens, *means)


class FigureBook:
    """Every stage's latest heartbeat and token window (see the module docstring); engine thread only."""

    def __init__(self, stages: int, *, window_s: int = WINDOW_S, every_s: float = SNAPSHOT_EVERY_S) -> None:
        self.window_s = window_s
        self.every_s = every_s
        self._beats: list[tuple[float, StageLoad | None] | None] = [None] * stages
        self._windows = [_Window() for _ in range(stages)]
        self._snapshot: tuple[StageFigures, ...] = tuple(StageFigures(index) for index in range(stages))
        self._made_at: float | None = None

    def beat(self, stage: int, load: StageLoad | None, now: float) -> None:
        """A heartbeat from `stage` at `now` with its `load` (None from a stage that sends none)."""
        if 0 <= stage < len(self._beats):
            self._beats[stage] = (now, load)

    @property
    def invariant(self) -> bool:
        """True when every stage's latest heartbeat says it computes batch-invariantly (§2.4, extras tag 6)."""
        return all(beat is not None and beat[1] is not None and beat[1].invariant for beat in self._beats)

    def token(self, hops: Sequence[HopTiming], now: float) -> None:
        """The hops of one decode step's reply (its trace's timings, telemetry.hop_timings) at `now`."""
        second = int(now)
        for hop in hops:
            if 0 <= hop.stage_index < len(self._windows):
                self._windows[hop.stage_index].add(second, hop, self.window_s)

    def snapshot(self, now: float) -> tuple[StageFigures, ...]:
        """Every stage's figures as of `now` (the previous snapshot when one was made less than `every_s` ago)."""
        if self._made_at is not None and now - self._made_at < self.every_s:
            return self._snapshot
        self._made_at, second = now, int(now)
        self._snapshot = tuple(
            StageFigures(index, None if beat is None else beat[0], None if beat is None else beat[1],
                         window.split(second, self.window_s))
            for index, (beat, window) in enumerate(zip(self._beats, self._windows, strict=True)))
        return self._snapshot
