"""Tests of skippy_zmq.telemetry: rate-limited log events, warnings as events, metrics and their bind."""

from __future__ import annotations

import io
import json
import warnings
from typing import Any

import numpy as np
import pytest

from skippy_zmq.errors import ConfigError
from skippy_zmq.telemetry import MAX_RATE_KEYS, EventLog, StageMetrics, metrics_address, parse_event


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _log(interval_s: float = 5.0) -> tuple[EventLog, io.StringIO, FakeClock]:
    stream, clock = io.StringIO(), FakeClock()
    return EventLog("test", stream, clock=clock, interval_s=interval_s), stream, clock


def _events(stream: io.StringIO) -> list[dict[str, Any]]:
    lines = stream.getvalue().splitlines()
    events = [parse_event(line) for line in lines]
    assert None not in events, lines  # every line is one JSON event
    return [e for e in events if e is not None]


def test_a_repeated_event_is_written_once_per_interval_with_the_count_it_dropped() -> None:
    log, stream, clock = _log()
    written = [log.emit_limited("message_rejected", cause="WireError", request=i) for i in range(6)]
    assert written == [True, False, False, False, False, False]
    clock.now += 4.9
    assert not log.emit_limited("message_rejected", cause="WireError", request=6)
    clock.now += 0.1
    assert log.emit_limited("message_rejected", cause="WireError", request=7)
    assert [(e["request"], e.get("suppressed")) for e in _events(stream)] == [(0, None), (7, 6)]


def test_causes_and_event_kinds_are_limited_apart() -> None:
    log, stream, _ = _log()
    for _ in range(3):
        log.emit_limited("message_rejected", cause="WireError")
        log.emit_limited("message_rejected", cause="LimitError")
        log.emit_limited("message_failed", cause="WireError")
        log.emit_limited("handshake_refused", key="peer 10.0.0.1", peer="10.0.0.1")
    assert [(e["event"], e.get("cause", e.get("peer"))) for e in _events(stream)] == [
        ("message_rejected", "WireError"), ("message_rejected", "LimitError"),
        ("message_failed", "WireError"), ("handshake_refused", "10.0.0.1"),
    ]


def test_plain_emit_is_never_limited() -> None:
    log, stream, _ = _log()
    for _ in range(3):
        log.emit("ready", cause="x")
    assert len(_events(stream)) == 3


def test_flush_writes_the_counts_of_quiet_keys_once_their_interval_passed() -> None:
    log, stream, clock = _log()
    for _ in range(4):
        log.emit_limited("message_rejected", cause="WireError")
    log.flush_suppressed()  # the interval is not over: nothing yet
    assert len(_events(stream)) == 1
    clock.now += 5.0
    log.flush_suppressed()
    log.flush_suppressed()  # counted once
    summary = _events(stream)[1:]
    assert [(e["event"], e["of"], e["key"], e["suppressed"]) for e in summary] == [
        ("events_suppressed", "message_rejected", "WireError", 3)
    ]
    log.emit_limited("message_rejected", cause="WireError")  # a new window began at the flush
    log.flush_suppressed(force=True)
    assert _events(stream)[-1]["suppressed"] == 1


def test_inventing_causes_cannot_grow_the_key_table_past_its_bound() -> None:
    log, stream, _ = _log()
    for index in range(MAX_RATE_KEYS + 50):
        log.emit_limited("message_rejected", cause=f"cause {index}")
    # The first MAX_RATE_KEYS causes each wrote a line; the rest share one key, one line.
    assert len(_events(stream)) == MAX_RATE_KEYS + 1


def _divide_by_zero() -> None:
    np.divide(np.float32(1.0), np.float32(0.0))  # one source line: one rate key


def test_numpy_warnings_become_rate_limited_json_events() -> None:
    log, stream, clock = _log()
    with warnings.catch_warnings(), np.errstate(divide="warn"):
        warnings.simplefilter("always")
        log.capture_warnings()
        for _ in range(3):
            _divide_by_zero()
        clock.now += 5.0
        _divide_by_zero()
        warnings.warn("something odd", UserWarning, stacklevel=1)
    events = _events(stream)
    assert [(e["event"], e["category"], e.get("suppressed")) for e in events] == [
        ("warning", "RuntimeWarning", None), ("warning", "RuntimeWarning", 2), ("warning", "UserWarning", None)
    ]
    assert "divide by zero" in events[0]["message"] and events[0]["where"].startswith(f"{__file__}:")
    assert events[2]["message"] == "something odd"


@pytest.mark.parametrize(
    ("bind", "address"),
    [
        (":9100", ("127.0.0.1", 9100)),
        ("127.0.0.1:9100", ("127.0.0.1", 9100)),
        ("0.0.0.0:9100", ("0.0.0.0", 9100)),
        ("*:9100", ("0.0.0.0", 9100)),
        ("10.1.2.3:80", ("10.1.2.3", 80)),
        ("metrics.internal:9100", ("metrics.internal", 9100)),
        ("[::1]:9100", ("::1", 9100)),
        ("[::]:9100", ("::", 9100)),
    ],
)
def test_metrics_bind_with_an_empty_host_is_loopback_and_an_explicit_host_is_honoured(
    bind: str, address: tuple[str, int]
) -> None:
    assert metrics_address(bind) == address


@pytest.mark.parametrize("bind", ["9100", "host:", "host:port", ":70000", ""])
def test_a_malformed_metrics_bind_is_refused_by_name(bind: str) -> None:
    with pytest.raises(ConfigError, match="metrics_bind"):
        metrics_address(bind)


def test_lane_gauges_and_counters_are_exported() -> None:
    metrics = StageMetrics("stage-0")
    metrics.lanes(3, 4)
    metrics.lane_exhausted()
    metrics.lane_exhausted()
    metrics.expired("prefill")
    metrics.expired("decode")
    metrics.expired("prefill")

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"stage": "stage-0", **labels})

    assert (value("skippy_stage_sessions"), value("skippy_stage_lane_count")) == (3, 4)
    assert value("skippy_stage_lane_exhausted_total") == 2
    assert value("skippy_stage_sessions_expired_total", phase="prefill") == 2
    assert value("skippy_stage_sessions_expired_total", phase="decode") == 1
    assert metrics.counts == {"lane_exhausted": 2, "expired.prefill": 2, "expired.decode": 1}


def test_driver_restarts_and_the_sessions_they_freed_are_counted() -> None:
    metrics = StageMetrics("stage-0")
    metrics.driver_restart(3)
    metrics.driver_restart(0)
    sample = metrics.registry.get_sample_value
    assert sample("skippy_stage_driver_restarts_total", {"stage": "stage-0"}) == 2
    assert sample("skippy_stage_sessions_freed_driver_restart_total", {"stage": "stage-0"}) == 3
    assert metrics.counts == {"driver_restarts": 2, "sessions_freed.driver_restart": 3}


def test_an_event_line_is_one_json_object() -> None:
    log, stream, _ = _log()
    log.emit("ready", stage=0, text="multi\nline")
    (line,) = stream.getvalue().splitlines()
    assert json.loads(line)["text"] == "multi\nline"


def test_a_plain_log_writes_the_same_event_as_one_human_line() -> None:
    stream = io.StringIO()
    log = EventLog("stage-1", stream, json_lines=False)
    log.emit("message_failed", request=7, error="position 9 is past the context", cause="SessionError")
    log.emit("ready", pull="tcp://127.0.0.1:5555")
    assert stream.getvalue().splitlines() == [
        "[skippy-zmq] stage-1: message failed: position 9 is past the context (request=7 cause=SessionError)",
        "[skippy-zmq] stage-1: ready (pull=tcp://127.0.0.1:5555)",
    ]
    assert all(parse_event(line) is None for line in stream.getvalue().splitlines())


def test_plain_line_leaves_out_empty_fields_and_joins_several_texts() -> None:
    from skippy_zmq.telemetry import plain_line

    record = {"ts": 1.0, "component": "up", "event": "warning", "message": "slow", "reason": "busy", "extra": None}
    assert plain_line(record) == "[skippy-zmq] up: warning: slow; busy"
