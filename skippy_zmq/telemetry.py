"""Structured log lines, per-stage counters and timings, the metrics endpoint, trace summaries."""

from __future__ import annotations

import json
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, Any, TextIO

import attrs

from skippy_zmq.errors import ConfigError
from skippy_zmq.wire.trace import TraceRecord

LOG_INTERVAL_S = 5.0
"""The shortest gap between two lines of one rate-limited event kind and cause."""
MAX_RATE_KEYS = 1024
"""Rate-limit keys tracked at once; beyond them, new causes share one key per event kind."""
_OTHER_KEY = "<other>"


@attrs.define
class _Window:
    """When a rate key last wrote a line, and how many of its events were dropped since."""

    started: float
    suppressed: int = 0


class EventLog:
    """Writes one line per event: a JSON object (`{"ts": ..., "component": ..., "event": ...}`)
    or, with `json_lines=False`, the same event as a human line (`plain_line`).

    `emit` writes every event; `emit_limited` writes one line per event kind and cause per
    `interval_s` and puts the count of the ones it dropped (`suppressed`) on the next line, so
    a flood of refused messages costs a line per cause every few seconds, not one per message.
    """

    def __init__(self, component: str, stream: IO[str] | None = None, *, json_lines: bool = True,
                 clock: Callable[[], float] = time.monotonic, interval_s: float = LOG_INTERVAL_S) -> None:
        self.component = component
        self.json_lines = json_lines
        self._stream = stream
        self._lock = threading.Lock()
        self._clock = clock
        self.interval_s = interval_s
        self._windows: dict[tuple[str, str], _Window] = {}

    def emit(self, event: str, **fields: Any) -> None:
        """Write one event line and flush it (launchers read readiness from it)."""
        record = {"ts": round(time.time(), 6), "component": self.component, "event": event, **fields}
        line = json.dumps(record, default=str, ensure_ascii=False) if self.json_lines else plain_line(record)
        stream = self._stream or sys.stderr
        with self._lock:
            stream.write(line + "\n")
            stream.flush()

    def emit_limited(self, event: str, key: str | None = None, **fields: Any) -> bool:
        """Write the event unless one of the same kind and key (default: its `cause` field) was
        written less than `interval_s` ago; a written line carries `suppressed: N` when N were
        dropped since the last. True when the line was written."""
        now = self._clock()
        with self._lock:
            rate_key = self._rate_key(event, str(fields.get("cause", "")) if key is None else key, now)
            window = self._windows.get(rate_key)
            if window is not None and now - window.started < self.interval_s:
                window.suppressed += 1
                return False
            suppressed = window.suppressed if window is not None else 0
            self._windows[rate_key] = _Window(now)
        if suppressed:
            fields["suppressed"] = suppressed
        self.emit(event, **fields)
        return True

    def flush_suppressed(self, *, force: bool = False) -> None:
        """Write an `events_suppressed` line for each key whose interval has passed with events
        dropped and none written since (all of them with `force`, e.g. at shutdown)."""
        now = self._clock()
        with self._lock:
            due = [(rate_key, window.suppressed) for rate_key, window in self._windows.items()
                   if window.suppressed and (force or now - window.started >= self.interval_s)]
            for rate_key, _ in due:
                self._windows[rate_key] = _Window(now)
        for (event, key), suppressed in due:
            self.emit("events_suppressed", of=event, key=key, suppressed=suppressed)

    def capture_warnings(self) -> None:
        """Send Python warnings (numpy's RuntimeWarning, ...) to this log as rate-limited
        `warning` events instead of raw text lines (call once per process, at start)."""
        warnings.showwarning = self._show_warning

    def _show_warning(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      file: TextIO | None = None, line: str | None = None) -> None:
        where = f"{filename}:{lineno}"
        self.emit_limited("warning", key=f"{category.__name__} {where}", category=category.__name__,
                          message=str(message), where=where)

    def _rate_key(self, event: str, key: str, now: float) -> tuple[str, str]:
        """The key to count under; old quiet keys make room, and past MAX_RATE_KEYS new keys
        share one per event kind, so a peer inventing causes cannot grow the table."""
        rate_key = (event, key)
        if rate_key in self._windows or len(self._windows) < MAX_RATE_KEYS:
            return rate_key
        for stale in [k for k, w in self._windows.items() if not w.suppressed and now - w.started >= self.interval_s]:
            del self._windows[stale]
        return rate_key if len(self._windows) < MAX_RATE_KEYS else (event, _OTHER_KEY)


_TEXT_FIELDS = ("message", "detail", "error", "warning", "reason")
"""Fields whose text a plain line shows after a colon rather than as key=value."""


def plain_line(record: Mapping[str, Any]) -> str:
    """An event as one human line: `[skippy-zmq] stage-1: ready: text (key=value ...)`."""
    texts = [str(record[name]) for name in _TEXT_FIELDS if record.get(name) not in (None, "")]
    rest = [f"{key}={value}" for key, value in record.items()
            if key not in ("ts", "component", "event", *_TEXT_FIELDS) and value is not None]
    line = f"[skippy-zmq] {record.get('component', '?')}: {str(record.get('event', '?')).replace('_', ' ')}"
    if texts:
        line += ": " + "; ".join(texts)
    if rest:
        line += f" ({' '.join(rest)})"
    return line


def parse_event(line: str) -> dict[str, Any] | None:
    """The event dict of a log line written by `EventLog`, or None for any other line."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and "event" in record else None


class StageMetrics:
    """Counters and timings of one stage, exported on `metrics_bind` with prometheus-client."""

    def __init__(self, stage_label: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = {"stage": stage_label}
        registry = self.registry
        self._messages = Counter(
            "skippy_stage_messages", "Messages handled, by kind", ["stage", "kind"], registry=registry
        )
        self._errors = Counter(
            "skippy_stage_errors", "Messages rejected or failed, by cause", ["stage", "cause"], registry=registry
        )
        self._tokens = Counter(
            "skippy_stage_tokens", "Tokens run through this stage's layers", ["stage"], registry=registry
        )
        self._sessions = Gauge("skippy_stage_sessions", "Live sessions (lanes in use)", ["stage"], registry=registry)
        self._lane_count = Gauge("skippy_stage_lane_count", "Lanes of this stage (lane_count)", ["stage"],
                                 registry=registry)
        self._lane_exhausted = Counter(
            "skippy_stage_lane_exhausted", "New sessions refused because every lane was held", ["stage"],
            registry=registry,
        )
        self._expired = Counter(
            "skippy_stage_sessions_expired",
            "Sessions freed after their idle TTL, by phase (prefill: never ran a decode step)",
            ["stage", "phase"], registry=registry,
        )
        self._nonfinite = Counter(
            "skippy_stage_nonfinite_logits",
            "Requests failed because the final stage computed a NaN or +Inf logit (damaged weights?)",
            ["stage"], registry=registry,
        )
        self._driver_restarts = Counter(
            "skippy_stage_driver_restarts",
            "New incarnations of a driver seen; the sessions of the one replaced were freed", ["stage"],
            registry=registry,
        )
        self._freed = Counter(
            "skippy_stage_sessions_freed_driver_restart",
            "Sessions freed because the driver that opened them restarted", ["stage"], registry=registry,
        )
        self._seconds = Histogram(
            "skippy_stage_step_seconds",
            "Time per message step (decode, compute, encode, send)",
            ["stage", "step"],
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=self.registry,
        )
        self._labels = labels
        self.counts: dict[str, int] = {}

    def message(self, kind: str) -> None:
        """Count one handled message of `kind`."""
        self._messages.labels(kind=kind, **self._labels).inc()
        self._bump(f"messages.{kind}")

    def error(self, cause: str) -> None:
        """Count one rejected or failed message."""
        self._errors.labels(cause=cause, **self._labels).inc()
        self._bump(f"errors.{cause}")
        self._bump("errors")

    def tokens(self, count: int) -> None:
        """Count tokens computed."""
        self._tokens.labels(**self._labels).inc(count)
        self._bump("tokens", count)

    def lanes(self, in_use: int, lane_count: int) -> None:
        """Set the gauges of live sessions (one lane each) and of the stage's lane count."""
        self._sessions.labels(**self._labels).set(in_use)
        self._lane_count.labels(**self._labels).set(lane_count)

    def lane_exhausted(self) -> None:
        """Count one new session refused because every lane was held."""
        self._lane_exhausted.labels(**self._labels).inc()
        self._bump("lane_exhausted")

    def expired(self, phase: str) -> None:
        """Count one session freed after its idle TTL (`phase` prefill or decode)."""
        self._expired.labels(phase=phase, **self._labels).inc()
        self._bump(f"expired.{phase}")

    def nonfinite_logits(self) -> None:
        """Count one request failed by a NaN or +Inf logit (its error is counted by cause too)."""
        self._nonfinite.labels(**self._labels).inc()
        self._bump("nonfinite_logits")

    def driver_restart(self, freed: int) -> None:
        """Count one new incarnation of a driver and the `freed` sessions of the one it replaced."""
        self._driver_restarts.labels(**self._labels).inc()
        self._freed.labels(**self._labels).inc(freed)
        self._bump("driver_restarts")
        self._bump("sessions_freed.driver_restart", freed)

    def step(self, step: str, seconds: float) -> None:
        """Observe the duration of one step of one message."""
        self._seconds.labels(step=step, **self._labels).observe(seconds)

    def serve(self, bind: str) -> None:
        """Serve `/metrics` (Prometheus text format) on `HOST:PORT` from a daemon thread (an
        empty host is 127.0.0.1, see `metrics_address`)."""
        from prometheus_client import start_http_server

        host, port = metrics_address(bind)
        start_http_server(port, addr=host, registry=self.registry)

    def _bump(self, key: str, amount: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + amount


def metrics_address(bind: str) -> tuple[str, int]:
    """The host and port a `metrics_bind` of `HOST:PORT` serves on: an empty host (":9100")
    is 127.0.0.1, never every interface; "*" is every interface; "[::1]" is an IPv6 host."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"metrics_bind {bind!r} must look like HOST:PORT (an empty host is 127.0.0.1)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "*":
        host = "0.0.0.0"
    return host or "127.0.0.1", int(port)


@attrs.frozen
class HopTiming:
    """Per-stage timing of one message, derived from its trace (µs)."""

    stage_index: int
    queue_us: int
    decode_us: int
    compute_us: int
    encode_us: int
    transfer_us: int
    bytes_out: int


def hop_timings(trace: Sequence[TraceRecord], received_at_us: int) -> list[HopTiming]:
    """Turn trace records into per-stage timings; the transfer of a hop is the next receipt
    time (or `received_at_us`, the driver's) minus the stage's send time."""
    hops = []
    for position, record in enumerate(trace):
        arrival = trace[position + 1].received_at_us if position + 1 < len(trace) else received_at_us
        hops.append(
            HopTiming(
                stage_index=record.stage_index,
                queue_us=record.queue_us,
                decode_us=record.decode_us,
                compute_us=record.compute_us,
                encode_us=record.encode_us,
                transfer_us=max(arrival - record.sent_at_us, 0),
                bytes_out=record.bytes_out,
            )
        )
    return hops


@attrs.define
class StageStats:
    """Running totals of hop timings for one stage over many tokens."""

    stage_index: int
    samples: int = 0
    queue_us: int = 0
    decode_us: int = 0
    compute_us: int = 0
    encode_us: int = 0
    transfer_us: int = 0
    bytes_out: int = 0
    transfers: list[int] = attrs.Factory(list)

    def add(self, hop: HopTiming) -> None:
        """Accumulate one hop."""
        self.samples += 1
        self.queue_us += hop.queue_us
        self.decode_us += hop.decode_us
        self.compute_us += hop.compute_us
        self.encode_us += hop.encode_us
        self.transfer_us += hop.transfer_us
        self.bytes_out += hop.bytes_out
        self.transfers.append(hop.transfer_us)

    def as_dict(self) -> dict[str, float]:
        """Mean µs per message for each step, plus transfer percentiles and bytes per message."""
        n = max(self.samples, 1)
        ordered = sorted(self.transfers) or [0]
        return {
            "stage_index": self.stage_index,
            "messages": self.samples,
            "queue_us": self.queue_us / n,
            "decode_us": self.decode_us / n,
            "compute_us": self.compute_us / n,
            "encode_us": self.encode_us / n,
            "transfer_us": self.transfer_us / n,
            "transfer_p50_us": float(ordered[len(ordered) // 2]),
            "transfer_p99_us": float(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]),
            "bytes_out_per_message": self.bytes_out / n,
        }


def summarize(hops: Iterable[HopTiming]) -> list[dict[str, float]]:
    """Per-stage mean timings over many messages, ordered by stage index."""
    stats: dict[int, StageStats] = {}
    for hop in hops:
        stats.setdefault(hop.stage_index, StageStats(hop.stage_index)).add(hop)
    return [stats[index].as_dict() for index in sorted(stats)]
