"""Socket-free: the drivers a stage has heard from, by the `driver_incarnation` word of their
messages (docs/PROTOCOL.md §5, Driver restarts).

A driver id names a driver across its restarts (it comes from the topology's return endpoint,
where only one driver process can listen at a time); the incarnation is new for every driver
process. `DriverTable` says when a message brings a new incarnation of a driver already heard
(its previous incarnation's sessions are then freed) and refuses the late messages of an
incarnation that was replaced.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import attrs

from skippy_zmq.errors import DriverReplacedError
from skippy_zmq.wire.messages import MAX_DRIVER_INCARNATION, driver_id_of

MAX_DRIVERS = 64
"""Driver ids remembered; past that the least recently heard is forgotten (a sender that makes
up driver words must not grow a stage's memory)."""
MAX_REPLACED = 16
"""Replaced incarnations remembered per driver id: late messages of any of them are refused."""


def describe(word: int) -> str:
    """`0x002a1234 (driver 42, incarnation 4660)`, for log lines and error texts."""
    return f"{word:#010x} (driver {driver_id_of(word)}, incarnation {word & MAX_DRIVER_INCARNATION})"


@attrs.frozen
class DriverRestart:
    """A message brought a new incarnation of a driver: `replaced` is the word whose sessions go."""

    driver_id: int
    replaced: int
    current: int
    freed: tuple[int, ...] = ()  # the sessions freed, once the session table has freed them


class DriverTable:
    """The current incarnation of each driver id heard, and the incarnations it replaced."""

    def __init__(self, max_drivers: int = MAX_DRIVERS, max_replaced: int = MAX_REPLACED) -> None:
        self.max_drivers = max_drivers
        self.max_replaced = max_replaced
        self._current: OrderedDict[int, int] = OrderedDict()  # driver id -> word, least recent first
        self._replaced: dict[int, deque[int]] = {}

    def current(self, driver_id: int) -> int | None:
        """The word of the driver's newest incarnation heard, or None."""
        return self._current.get(driver_id)

    def check(self, word: int) -> None:
        """DriverReplacedError when `word` is an incarnation a newer one of its driver replaced."""
        if word and word in self._replaced.get(driver_id_of(word), ()):
            raise DriverReplacedError(
                f"driver incarnation {describe(word)} was replaced on this stage by "
                f"{describe(self._current[driver_id_of(word)])}: a message from a driver process "
                f"that has since restarted is not run"
            )

    def see(self, word: int) -> DriverRestart | None:
        """Note the word of a received message. A new incarnation of a driver heard before is a
        DriverRestart (the previous one is replaced); a replaced one is refused (`check`);
        0, the word of a sender that gives none, is neither."""
        if not word:
            return None
        self.check(word)
        driver_id = driver_id_of(word)
        previous = self._current.get(driver_id)
        self._current[driver_id] = word
        self._current.move_to_end(driver_id)
        if previous is None:
            while len(self._current) > self.max_drivers:
                forgotten, _ = self._current.popitem(last=False)
                self._replaced.pop(forgotten, None)
            return None
        if previous == word:
            return None
        self._replaced.setdefault(driver_id, deque(maxlen=self.max_replaced)).append(previous)
        return DriverRestart(driver_id, previous, word)
