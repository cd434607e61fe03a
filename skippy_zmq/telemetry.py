"""Structured log lines, per-stage counters and timings, the metrics endpoint, trace summaries."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import IO, Any

import attrs

from skippy_zmq.wire import TraceRecord


class EventLog:
    """Writes one JSON object per line per event: `{"ts": ..., "component": ..., "event": ...}`."""

    def __init__(self, component: str, stream: IO[str] | None = None) -> None:
        self.component = component
        self._stream = stream
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        """Write one event line and flush it (launchers read readiness from it)."""
        record = {"ts": round(time.time(), 6), "component": self.component, "event": event, **fields}
        line = json.dumps(record, default=str, ensure_ascii=False)
        stream = self._stream or sys.stderr
        with self._lock:
            stream.write(line + "\n")
            stream.flush()


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
        self._sessions = Gauge("skippy_stage_sessions", "Live sessions", ["stage"], registry=registry)
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

    def sessions(self, live: int) -> None:
        """Set the live-session gauge."""
        self._sessions.labels(**self._labels).set(live)

    def step(self, step: str, seconds: float) -> None:
        """Observe the duration of one step of one message."""
        self._seconds.labels(step=step, **self._labels).observe(seconds)

    def serve(self, bind: str) -> None:
        """Serve `/metrics` (Prometheus text format) on `HOST:PORT` from a daemon thread."""
        from prometheus_client import start_http_server

        host, _, port = bind.rpartition(":")
        start_http_server(int(port), addr=host or "0.0.0.0", registry=self.registry)

    def _bump(self, key: str, amount: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + amount


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
