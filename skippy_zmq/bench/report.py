"""What every benchmark reports: the machine, the UTC date, percentiles, markdown tables and JSON lines."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import attrs

ISA_FLAGS: tuple[tuple[str, str], ...] = (
    ("avx2", "avx2"),
    ("avx512", "avx512f"),
    ("avx512_vnni", "avx512_vnni"),
    ("amx", "amx_tile"),
)
"""The instruction sets a row names (name, the /proc/cpuinfo flag that shows it): the ones ggml's and the
package's products choose their kernels by."""


@attrs.frozen
class Machine:
    """The host a figure was measured on: CPU model, cores this process may use, instruction sets."""

    cpu: str
    nproc: int
    isa: tuple[str, ...]

    @classmethod
    def from_cpuinfo(cls, text: str, nproc: int) -> Machine:
        """The machine /proc/cpuinfo's `text` describes (its first processor), with `nproc` cores."""
        cpu, flags = "unknown", set[str]()
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu == "unknown":
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
        return cls(cpu=cpu, nproc=nproc, isa=tuple(name for name, flag in ISA_FLAGS if flag in flags))

    @classmethod
    def of_host(cls) -> Machine:
        """This host (outside Linux: the platform's processor name and no instruction sets)."""
        try:
            nproc = len(os.sched_getaffinity(0))  # what `nproc` prints: the cores this process may use
        except AttributeError:  # not Linux
            nproc = os.cpu_count() or 1
        try:
            text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return cls(cpu=platform.processor() or "unknown", nproc=nproc, isa=())
        return cls.from_cpuinfo(text, nproc)

    def describe(self) -> str:
        """One line: `AMD EPYC, nproc 2, avx2`."""
        return f"{self.cpu}, nproc {self.nproc}, {' '.join(self.isa) or 'no avx2'}"

    def as_json(self) -> dict[str, Any]:
        """The machine as a row carries it."""
        return {"cpu": self.cpu, "nproc": self.nproc, "isa": list(self.isa)}


def utc_now() -> str:
    """The UTC date and time to the second, ISO 8601: `2026-12-03T14:05:09Z`."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0..1) of `values` by nearest rank: the smallest value with at least a fraction q of
    the values at or below it (the median of two is the lower); NaN when there are none."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside [0, 1]")
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def cell(value: object, digits: int = 1) -> str:
    """A table cell: floats with `digits` decimals, NaN and None as `-`, anything else as text."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> str:
    """A markdown table; `align` holds one letter per column, `l` or `r`."""
    assert len(align) == len(header) and not set(align) - {"l", "r"}, (align, header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    for row in rows:
        assert len(row) == len(header), (row, header)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def json_line(row: Mapping[str, Any]) -> str:
    """One JSON object on one line; NaN and infinities become null, which JSON can hold."""
    return json.dumps(_finite(dict(row)), ensure_ascii=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


class Report:
    """The rows of one benchmark, each stamped with the benchmark, the machine and the UTC date, and written
    to the JSON-lines file as soon as it is measured (so a run cut short keeps what it measured)."""

    def __init__(self, bench: str, json_out: IO[str] | None, *, machine: Machine | None = None,
                 clock: Callable[[], str] = utc_now) -> None:
        self.bench = bench
        self.json_out = json_out
        self.machine = machine if machine is not None else Machine.of_host()
        self.clock = clock
        self.rows: list[dict[str, Any]] = []

    def add(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """Stamp `row`, keep it and write it; returns the stamped row."""
        stamped = {"bench": self.bench, **row, "machine": self.machine.as_json(), "date": self.clock()}
        self.rows.append(stamped)
        if self.json_out is not None:
            self.json_out.write(json_line(stamped) + "\n")
            self.json_out.flush()
        return stamped

    def heading(self) -> str:
        """The line above a table: the machine and the date of the first row."""
        date = self.rows[0]["date"] if self.rows else self.clock()
        return f"{self.bench}: {self.machine.describe()}, {date}"
