"""Link emulation's core, socket-free and clock-free: the shape of an emulated link (`LinkShape`, from
a spec such as `delay=10ms,jitter=2ms,rate=100mbit,stall=5ms@2s`) and when each message sent on it
arrives at its far end (`LinkClock`) (docs/ARCHITECTURE.md, "Link emulation").

The model is a TCP link's, one way: a message is serialized at the link's rate behind the messages
before it, then propagates for the delay plus a jitter drawn per message, and never overtakes an
earlier one; during a stall the link transmits nothing. Loss, reordering and TCP's congestion
control are not modelled.
"""

from __future__ import annotations

import math
import random
import re

import attrs

from skippy_zmq.errors import ConfigError

MAX_DURATION_MS = 10_000.0
"""Longest delay, jitter or stall a shape may name: past that a link is down, not slow."""
MAX_STALL_EVERY_MS = 86_400_000.0
"""Longest period between stalls (a day)."""
FORMS = ("off, or any of delay=DURATION, jitter=DURATION, rate=RATE, stall=DURATION@DURATION joined by commas "
         "(e.g. delay=10ms,jitter=2ms,rate=100mbit,stall=5ms@2s)")
"""What a link spec may be, quoted by every parse error."""
_DURATION_UNITS = {"s": 1000.0, "ms": 1.0, "us": 1e-3}  # in milliseconds
_RATE_UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}  # tc's names: decimal bits per second
_NUMBER = re.compile(r"(?P<number>[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)(?P<unit>[a-z]+)")
_KEYS = ("delay", "jitter", "rate", "stall")


def _check_ms(instance: LinkShape, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value <= MAX_DURATION_MS:  # NaN fails too
        raise ConfigError(f"LinkShape.{attribute.name} {value!r} must be from 0 to {MAX_DURATION_MS:g} ms")


def _check_rate(instance: LinkShape, attribute: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"LinkShape.rate_bit_s {value!r} must be a positive number of bits per second, "
                          "or None for an unlimited rate")


def _optional_float(value: float | None) -> float | None:
    return None if value is None else float(value)


@attrs.frozen
class LinkShape:
    """One way of an emulated link: propagation delay, jitter, serialization rate and periodic stalls."""

    delay_ms: float = attrs.field(default=0.0, converter=float, validator=_check_ms)  # one-way propagation
    # extra delay per message, uniform in [0, jitter_ms]: `delay_ms` is the floor, as on a real path
    jitter_ms: float = attrs.field(default=0.0, converter=float, validator=_check_ms)
    rate_bit_s: float | None = attrs.field(default=None, converter=_optional_float, validator=_check_rate)
    # the link is down for the last `stall_ms` of every `stall_every_ms` (0 and 0: no stalls)
    stall_ms: float = attrs.field(default=0.0, converter=float, validator=_check_ms)
    stall_every_ms: float = attrs.field(default=0.0, converter=float)

    def __attrs_post_init__(self) -> None:
        """A stall needs a period longer than itself (ConfigError otherwise)."""
        if (self.stall_ms, self.stall_every_ms) == (0, 0):
            return
        if not 0 < self.stall_ms < self.stall_every_ms <= MAX_STALL_EVERY_MS:
            raise ConfigError(f"LinkShape: a stall of {self.stall_ms!r} ms every {self.stall_every_ms!r} ms must "
                              f"be positive and shorter than its period (at most {MAX_STALL_EVERY_MS:g} ms)")

    @classmethod
    def off(cls) -> LinkShape:
        """No emulation: the stage's sockets are used as they are."""
        return cls()

    @classmethod
    def parse(cls, spec: str, *, where: str = "link spec") -> LinkShape:
        """A shape from `off` or `delay=10ms,jitter=2ms,rate=100mbit,stall=5ms@2s` (any subset, any
        order); ConfigError naming `where`, the field and the value, with the accepted forms."""
        text = spec.strip().lower()
        if text == "off":
            return cls.off()
        fields: dict[str, str] = {}
        for item in text.split(","):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep or not key or not value:
                raise ConfigError(f"{where} {spec!r}: {item.strip()!r} is not KEY=VALUE; expected {FORMS}")
            if key not in _KEYS:
                raise ConfigError(f"{where} {spec!r}: unknown field {key!r}; expected one of {', '.join(_KEYS)}")
            if key in fields:
                raise ConfigError(f"{where} {spec!r}: {key} is given twice")
            fields[key] = value
        where = f"{where} {spec!r}"
        stall_ms, every_ms = _stall(fields["stall"], where) if "stall" in fields else (0.0, 0.0)
        return cls(
            delay_ms=_duration(fields.get("delay", "0ms"), f"{where}: delay"),
            jitter_ms=_duration(fields.get("jitter", "0ms"), f"{where}: jitter"),
            rate_bit_s=_rate(fields["rate"], f"{where}: rate") if "rate" in fields else None,
            stall_ms=stall_ms, stall_every_ms=every_ms,
        )

    @property
    def is_off(self) -> bool:
        """True when the shape changes nothing: no delay, jitter, rate limit or stall."""
        return self == LinkShape.off()

    def describe(self) -> str:
        """The shape as a spec `parse` reads back to an equal shape (`off` when off), for logs and /health."""
        items = [f"{key}={_duration_text(value)}" for key, value in (("delay", self.delay_ms),
                                                                     ("jitter", self.jitter_ms)) if value]
        if self.rate_bit_s is not None:
            items.append(f"rate={_unit_text(self.rate_bit_s, _RATE_UNITS)}")
        if self.stall_ms:
            items.append(f"stall={_duration_text(self.stall_ms)}@{_duration_text(self.stall_every_ms)}")
        return ",".join(items) or "off"


def _number(text: str, units: dict[str, float], where: str, what: str) -> float:
    match = _NUMBER.fullmatch(text)
    if match is None or match["unit"] not in units:
        first, second = list(units)[:2]
        raise ConfigError(f"{where} {text!r} is not {what}; expected a non-negative number and one of the units "
                          f"{', '.join(units)} (e.g. 1{first}, 2.5{second})")
    factor = units[match["unit"]]
    # a unit below the stored one divides: 10us is 10 / 1000 ms as written, not 10 * 0.001
    return float(match["number"]) * factor if factor >= 1 else float(match["number"]) / round(1 / factor)


def _duration(text: str, where: str, *, most_ms: float = MAX_DURATION_MS) -> float:
    ms = _number(text, _DURATION_UNITS, where, "a duration")
    if ms > most_ms:
        raise ConfigError(f"{where} {text!r} is longer than {_duration_text(most_ms)}, the most it may be")
    return ms


def _rate(text: str, where: str) -> float:
    bits = _number(text, _RATE_UNITS, where, "a rate")
    if not bits > 0:
        raise ConfigError(f"{where} {text!r} must be positive; leave rate out for an unlimited rate")
    return bits


def _stall(text: str, where: str) -> tuple[float, float]:
    length, sep, every = text.partition("@")
    if not sep:
        raise ConfigError(f"{where}: stall {text!r} must be DURATION@DURATION: how long the link stalls, then how "
                          "often (e.g. stall=5ms@2s)")
    stall_ms = _duration(length.strip(), f"{where}: stall")
    every_ms = _duration(every.strip(), f"{where}: stall period", most_ms=MAX_STALL_EVERY_MS)
    if not 0 < stall_ms < every_ms:
        raise ConfigError(f"{where}: stall {text!r} must last more than 0 and less than its period")
    return stall_ms, every_ms


def _unit_text(value: float, units: dict[str, float]) -> str:
    """`value` in the largest unit that writes it as a brief number from 1 up and reads back exactly; else in
    the stored unit."""
    for unit, factor in units.items():
        scaled = value / factor if factor >= 1 else value * round(1 / factor)
        number = f"{scaled!r}".removesuffix(".0")
        text = number + unit
        if scaled >= 1 and len(number) <= 9 and _NUMBER.fullmatch(text) and _number(text, units, "", "") == value:
            return text
    stored = next(unit for unit, factor in units.items() if factor == 1)
    return f"{value!r}".removesuffix(".0") + stored  # read back exactly: no factor applies


def _duration_text(ms: float) -> str:
    return _unit_text(ms, _DURATION_UNITS)


class LinkClock:
    """When each message sent on a link of `shape` arrives at its far end; time in seconds, given by
    the caller (`now`), so the rule is tested without a clock. Not thread-safe: one sender owns it."""

    def __init__(self, shape: LinkShape, *, epoch: float, rng: random.Random | None = None, seed: int = 0) -> None:
        """`epoch`: when the link came up (stall periods count from it); `rng` draws the jitter (else
        one seeded with `seed`, so a run's jitter repeats)."""
        self.shape = shape
        self.epoch = epoch
        self._rng = rng if rng is not None else random.Random(seed)
        self.link_free_at = epoch  # when the last message's final bit left
        self.last_arrival = -math.inf
        self._period_s = shape.stall_every_ms / 1000
        self._up_s = (shape.stall_every_ms - shape.stall_ms) / 1000  # of each period, before its stall

    def arrival(self, size_bytes: int, now: float) -> float:
        """When a message of `size_bytes` handed to the link at `now` has arrived; never earlier than
        an earlier message's arrival (a TCP link does not reorder)."""
        shape = self.shape
        start = self._link_up(max(now, self.link_free_at))
        busy_s = size_bytes * 8 / shape.rate_bit_s if shape.rate_bit_s is not None else 0.0
        self.link_free_at = self._transmitted(start, busy_s)
        jitter_ms = self._rng.random() * shape.jitter_ms if shape.jitter_ms else 0.0
        arrival = max(self.link_free_at + (shape.delay_ms + jitter_ms) / 1000, self.last_arrival)
        self.last_arrival = arrival
        return arrival

    def _link_up(self, t: float) -> float:
        """`t`, or the end of the stall `t` falls in."""
        if not self._period_s:
            return t
        cycle = math.floor((t - self.epoch) / self._period_s)
        stall_ends = self.epoch + (cycle + 1) * self._period_s
        return stall_ends if t - self.epoch - cycle * self._period_s >= self._up_s else t

    def _transmitted(self, start: float, busy_s: float) -> float:
        """When `busy_s` seconds of transmission that begin at `start` (the link up) end, stalls skipped."""
        if not self._period_s or not busy_s:
            return start + busy_s
        # up time since the epoch at `start`, plus the transmission: the earliest time reaching it
        cycle = math.floor((start - self.epoch) / self._period_s)
        target = cycle * self._up_s + (start - self.epoch - cycle * self._period_s) + busy_s
        ends_in = math.ceil(target / self._up_s) - 1
        return max(start + busy_s, self.epoch + ends_in * self._period_s + target - ends_in * self._up_s)
