"""Link emulation's core: shapes parsed and described, and when each message arrives."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippy_zmq.errors import ConfigError, SkippyError
from skippy_zmq.link import MAX_DURATION_MS, LinkClock, LinkShape

EPS = 1e-9  # seconds: float rounding of sums over a few thousand seconds


def test_a_spec_names_every_field_in_any_order_and_case() -> None:
    shape = LinkShape.parse(" Stall=5ms@2s, rate=100Mbit ,jitter=2ms,delay=10ms")
    assert shape == LinkShape(delay_ms=10, jitter_ms=2, rate_bit_s=100e6, stall_ms=5, stall_every_ms=2000)
    assert shape.describe() == "delay=10ms,jitter=2ms,rate=100mbit,stall=5ms@2s"
    assert not shape.is_off


@pytest.mark.parametrize(("spec", "expected"), [
    ("delay=10us", LinkShape(delay_ms=0.01)),
    ("delay=1.5s", LinkShape(delay_ms=1500)),
    ("rate=1.5kbit", LinkShape(rate_bit_s=1500)),
    ("rate=1gbit", LinkShape(rate_bit_s=1e9)),
    ("rate=800bit", LinkShape(rate_bit_s=800)),
    ("jitter=3ms", LinkShape(jitter_ms=3)),
])
def test_units_scale_to_milliseconds_and_bits_per_second(spec: str, expected: LinkShape) -> None:
    assert LinkShape.parse(spec) == expected
    assert LinkShape.parse(expected.describe()) == expected


@pytest.mark.parametrize("spec", ["off", " OFF ", "delay=0ms", "delay=0s,jitter=0us"])
def test_off_and_a_shape_that_changes_nothing_are_off(spec: str) -> None:
    shape = LinkShape.parse(spec)
    assert shape.is_off and shape == LinkShape.off()
    assert shape.describe() == "off"


@pytest.mark.parametrize(("spec", "expected"), [
    ("delay=10", "--emulate-link 'delay=10': delay '10' is not a duration; expected a non-negative number and one of "
                 "the units s, ms, us (e.g. 1s, 2.5ms)"),
    ("delay=-1ms", "delay '-1ms' is not a duration"),
    ("delay=nanms", "delay 'nanms' is not a duration"),
    ("delay=20s", "--emulate-link 'delay=20s': delay '20s' is longer than 10s, the most it may be"),
    ("jitter=1min", "jitter '1min' is not a duration"),
    ("rate=10mbps", "rate '10mbps' is not a rate; expected a non-negative number and one of the units gbit, mbit, "
                    "kbit, bit (e.g. 1gbit, 2.5mbit)"),
    ("rate=0mbit", "rate '0mbit' must be positive; leave rate out for an unlimited rate"),
    ("loss=1%", "unknown field 'loss'; expected one of delay, jitter, rate, stall"),
    ("delay=1ms,delay=2ms", "delay is given twice"),
    ("delay=1ms,", "'' is not KEY=VALUE; expected off, or any of delay=DURATION, jitter=DURATION, rate=RATE, "
                   "stall=DURATION@DURATION joined by commas (e.g. delay=10ms,jitter=2ms,rate=100mbit,stall=5ms@2s)"),
    ("", "'' is not KEY=VALUE"),
    ("delay 10ms", "'delay 10ms' is not KEY=VALUE"),
    ("stall=5ms", "stall '5ms' must be DURATION@DURATION: how long the link stalls, then how often (e.g. stall=5ms@2s)"),
    ("stall=5ms@5ms", "stall '5ms@5ms' must last more than 0 and less than its period"),
    ("stall=0ms@1s", "stall '0ms@1s' must last more than 0"),
    ("stall=5ms@2days", "stall period '2days' is not a duration"),
])
def test_a_bad_spec_names_the_field_the_value_and_the_forms(spec: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        LinkShape.parse(spec, where="--emulate-link")
    assert str(info.value).startswith(f"--emulate-link {spec!r}: ")
    assert expected in str(info.value)
    assert isinstance(info.value, SkippyError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(("fields", "expected"), [
    ({"delay_ms": -1}, "LinkShape.delay_ms -1.0 must be from 0 to 10000 ms"),
    ({"jitter_ms": float("nan")}, "LinkShape.jitter_ms nan must be from 0 to 10000 ms"),
    ({"rate_bit_s": 0}, "LinkShape.rate_bit_s 0.0 must be a positive number of bits per second"),
    ({"stall_ms": 5}, "LinkShape: a stall of 5.0 ms every 0.0 ms must be positive and shorter than its period"),
])
def test_a_shape_built_in_code_is_checked_too(fields: dict[str, float], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        LinkShape(**fields)


durations = st.floats(0, MAX_DURATION_MS, allow_nan=False)
@st.composite
def link_shapes(draw: st.DrawFn) -> LinkShape:
    """Any valid shape: each field present or not; a stall shorter than its period."""
    every = draw(st.just(0.0) | st.floats(1, 5000))
    stall = draw(st.floats(0.01, 0.99)) * every
    return LinkShape(delay_ms=draw(st.just(0.0) | durations), jitter_ms=draw(st.just(0.0) | durations),
                     rate_bit_s=draw(st.none() | st.floats(1, 1e12)), stall_ms=stall, stall_every_ms=every)


@given(link_shapes())
def test_describe_reads_back_to_the_same_shape(shape: LinkShape) -> None:
    assert LinkShape.parse(shape.describe()) == shape


def test_an_unlimited_link_delivers_after_exactly_the_delay() -> None:
    clock = LinkClock(LinkShape(delay_ms=50), epoch=0.0)
    assert [clock.arrival(size, now) for size, now in ((10, 0.0), (10**9, 0.0), (1, 1.0))] == [0.05, 0.05, 1.05]


def test_messages_serialize_one_behind_the_other_at_the_rate() -> None:
    clock = LinkClock(LinkShape(delay_ms=10, rate_bit_s=8000), epoch=0.0)  # 1,000 bytes a second
    arrivals = [clock.arrival(500, 0.0), clock.arrival(1000, 0.0), clock.arrival(500, 5.0)]
    assert arrivals == pytest.approx([0.51, 1.51, 5.51])
    assert clock.link_free_at == pytest.approx(5.5)


def test_a_message_handed_over_during_a_stall_leaves_when_it_ends() -> None:
    clock = LinkClock(LinkShape(delay_ms=1, stall_ms=5, stall_every_ms=1000), epoch=100.0)  # down [100.995, 101)
    assert clock.arrival(10, 100.5) == pytest.approx(100.501)
    assert clock.arrival(10, 100.996) == pytest.approx(101.001)
    assert clock.arrival(10, 101.0) == pytest.approx(101.001)
    assert clock.arrival(10, 101.5) == pytest.approx(101.501)
    assert clock.arrival(10, 102.997) == pytest.approx(103.001)  # every period


def test_a_transmission_that_meets_a_stall_resumes_after_it() -> None:
    clock = LinkClock(LinkShape(rate_bit_s=8000, stall_ms=100, stall_every_ms=1000), epoch=0.0)
    # 100 bytes take 0.1 s: from 0.85 to the stall at 0.9, then from 1.0 to 1.05
    assert clock.arrival(100, 0.85) == pytest.approx(1.05)
    # 2,000 bytes take 2 s of up time: 0.9 s of each period
    assert clock.arrival(2000, 1.05) == pytest.approx(3.25)


def test_jitter_adds_up_to_its_bound_and_repeats_with_the_seed() -> None:
    shape = LinkShape(delay_ms=10, jitter_ms=4)
    runs = []
    for _ in range(2):
        clock = LinkClock(shape, epoch=0.0, seed=7)
        runs.append([clock.arrival(10, float(i)) for i in range(200)])
    assert runs[0] == runs[1]
    extra = [arrival - i - 0.010 for i, arrival in enumerate(runs[0])]
    assert min(extra) >= 0 and max(extra) <= 0.004
    assert max(extra) - min(extra) > 0.003  # spread over the bound, not a constant


def test_jitter_never_reorders_a_later_message_waits_for_the_earlier_one() -> None:
    class Draws(random.Random):
        def __init__(self, values: list[float]) -> None:
            super().__init__(0)
            self.values = values

        def random(self) -> float:
            return self.values.pop(0)

    clock = LinkClock(LinkShape(delay_ms=10, jitter_ms=100), epoch=0.0, rng=Draws([1.0, 0.0, 0.0]))
    assert [clock.arrival(10, t) for t in (0.0, 0.001, 0.5)] == pytest.approx([0.11, 0.11, 0.51])


sends = st.lists(st.tuples(st.integers(0, 10**7), st.floats(0, 0.5)), min_size=1, max_size=40)


@given(link_shapes(), sends, st.integers(0, 2**32))
def test_arrivals_never_decrease_never_beat_the_delay_and_never_exceed_the_rate(
        shape: LinkShape, gaps: list[tuple[int, float]], seed: int) -> None:
    clock = LinkClock(shape, epoch=3.0, seed=seed)
    now, nows, sizes, arrivals = 3.0, [], [], []
    for size, gap in gaps:
        now += gap
        nows.append(now)
        sizes.append(size)
        arrivals.append(clock.arrival(size, now))
    assert arrivals == sorted(arrivals)
    bits_s = shape.rate_bit_s
    for first in range(len(arrivals)):
        for last in range(first, len(arrivals)):
            # messages first..last cannot all have arrived before they were handed over, sent at the rate and
            # propagated: the link never carries more than its rate
            sent_s = sum(sizes[first:last + 1]) * 8 / bits_s if bits_s is not None else 0.0
            floor = nows[first] + sent_s + shape.delay_ms / 1000
            assert arrivals[last] >= floor - EPS * max(1.0, floor)


@given(sends, st.floats(0, 100), st.floats(0, 100), st.integers(0, 2**32))
def test_without_rate_or_stalls_a_message_arrives_within_delay_plus_jitter(
        gaps: list[tuple[int, float]], delay_ms: float, jitter_ms: float, seed: int) -> None:
    clock = LinkClock(LinkShape(delay_ms=delay_ms, jitter_ms=jitter_ms), epoch=0.0, seed=seed)
    now = 0.0
    for size, gap in gaps:
        now += gap
        arrival = clock.arrival(size, now)
        assert now + delay_ms / 1000 <= arrival <= now + (delay_ms + jitter_ms) / 1000 + EPS
