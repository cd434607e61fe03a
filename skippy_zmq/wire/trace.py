"""Trace records, where each stage spent a message's time, and the wall clock they are stamped
with (docs/PROTOCOL.md §2.2).
"""

from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING

import attrs

from skippy_zmq.errors import WireError

if TYPE_CHECKING:
    from skippy_zmq.wire.codecs import Buffer


MAX_TRACE_RECORDS = 64
_TRACE = struct.Struct("<iIQQIIIIQQ")
TRACE_BYTES = _TRACE.size


@attrs.frozen
class TraceRecord:
    """Where one stage spent a message's time; every forwarding stage appends one (docs/PROTOCOL.md §2.2)."""

    stage_index: int
    received_at_us: int
    sent_at_us: int
    queue_us: int = 0
    decode_us: int = 0
    compute_us: int = 0
    encode_us: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    flags: int = 0

    def __attrs_post_init__(self) -> None:
        if not -(2**31) <= self.stage_index < 2**31:
            raise WireError(f"trace stage_index {self.stage_index} is outside the int32 range")
        for name in ("received_at_us", "sent_at_us", "bytes_in", "bytes_out"):
            value = getattr(self, name)
            if not 0 <= value < 2**64:
                raise WireError(f"trace {name} {value} is outside 0..2**64-1")

    def to_bytes(self) -> bytes:
        """The fixed little-endian record (durations saturate at 2**32-1 µs)."""
        cap = 0xFFFFFFFF
        return _TRACE.pack(
            self.stage_index,
            self.flags & cap,
            self.received_at_us,
            self.sent_at_us,
            min(max(self.queue_us, 0), cap),
            min(max(self.decode_us, 0), cap),
            min(max(self.compute_us, 0), cap),
            min(max(self.encode_us, 0), cap),
            self.bytes_in,
            self.bytes_out,
        )

    @classmethod
    def from_bytes(cls, data: Buffer) -> TraceRecord:
        """Parse one fixed record."""
        (index, flags, received, sent, queue, dec, comp, enc, b_in, b_out) = _TRACE.unpack(data)
        return cls(index, received, sent, queue, dec, comp, enc, b_in, b_out, flags)


def now_us() -> int:
    """Wall-clock time in µs, the clock of `TraceRecord.received_at_us`/`sent_at_us`."""
    return time.time_ns() // 1000
