"""`bench web`: what the web page's polling costs the gateway (docs/PROTOCOL.md §9.9). `--pages` pages poll
`GET /stages` once every `--interval` seconds each (staggered, as pages opened at different moments would)
for `--seconds`, against a running serve (`--url`, with `--pid`, its process) or one started here. The
gateway process's CPU time (user + system, of that process alone: not its stages, which are other
processes) is read from /proc/PID/stat before and after the window, and the same over a window of the same
length with nobody polling first (the baseline: the engine thread's own idle loop); the polling's cost is
the difference, in % of one core. Each answer's latency is kept too (p50, p99, max).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import attrs

from skippy_zmq.bench.report import Report, cell, markdown_table, percentile
from skippy_zmq.errors import BenchError


def cpu_seconds_of(stat: str, ticks_per_second: int) -> float:
    """User + system CPU seconds of a process from its /proc/PID/stat text (fields 14 and 15, counted after the
    command name's closing parenthesis: a name may hold spaces and parentheses)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_second  # fields 3.. of the rest are 14.. of the line


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used; BenchError when it cannot be read (gone, or not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError as exc:
        raise BenchError(f"cannot read the CPU time of process {pid} from /proc/{pid}/stat: {exc.strerror}; is "
                         "it the gateway's pid, on this Linux host?") from None
    return cpu_seconds_of(stat, os.sysconf("SC_CLK_TCK"))


@attrs.frozen
class WebBench:
    """What `bench web` measures and against what."""

    pages: int = 10
    interval_s: float = 1.0
    seconds: float = 60.0
    baseline: bool = True  # a window of the same length with nobody polling first
    url: str | None = None  # a running serve (then `pid` is its process); None: one is started here
    pid: int | None = None
    api_key: str | None = attrs.field(default=None, repr=False)
    serve_args: str = "--stages 2 --lanes 4"
    model: str | None = None
    ready_timeout_s: float = 600.0
    label: str = ""


@attrs.frozen
class Window:
    """One measured window: its length, the gateway's CPU seconds in it, and the polls' answers."""

    name: str  # "idle" or "polling"
    seconds: float
    cpu_s: float
    latencies_ms: tuple[float, ...] = ()
    failed: int = 0

    @property
    def core_percent(self) -> float:
        """The gateway's CPU time over the window's wall time, in % of one core."""
        return 100.0 * self.cpu_s / self.seconds if self.seconds > 0 else float("nan")

    def as_json(self) -> dict[str, Any]:
        """The window as a report row holds it."""
        lat = self.latencies_ms
        return {"window": self.name, "seconds": round(self.seconds, 2), "cpu_s": round(self.cpu_s, 3),
                "core_percent": round(self.core_percent, 3), "polls": len(lat), "failed": self.failed,
                "latency_p50_ms": round(percentile(lat, 0.5), 2) if lat else None,
                "latency_p99_ms": round(percentile(lat, 0.99), 2) if lat else None,
                "latency_max_ms": round(max(lat), 2) if lat else None}


@attrs.frozen
class WebResults:
    """The windows measured, and what polling added."""

    options: WebBench
    windows: tuple[Window, ...]

    @property
    def added_percent(self) -> float:
        """What polling cost on top of the idle baseline, % of one core (NaN without a baseline)."""
        by_name = {window.name: window for window in self.windows}
        if "idle" not in by_name or "polling" not in by_name:
            return float("nan")
        return by_name["polling"].core_percent - by_name["idle"].core_percent

    def table(self) -> str:
        """One row per window, then what polling added."""
        rows = [(w.name, cell(w.seconds), str(len(w.latencies_ms)), str(w.failed), cell(w.cpu_s, 3),
                 cell(w.core_percent, 2), cell(w.as_json()["latency_p50_ms"], 2),
                 cell(w.as_json()["latency_p99_ms"], 2), cell(w.as_json()["latency_max_ms"], 2))
                for w in self.windows]
        table = markdown_table(("window", "s", "polls", "failed", "gateway CPU s", "% of a core", "p50 ms",
                                "p99 ms", "max ms"), rows, "lrrrrrrrr")
        o = self.options
        return (f"{table}\n\n{o.pages} pages polling /stages every {o.interval_s:g} s: "
                f"{cell(self.added_percent, 2)} % of a core on top of the idle gateway")


async def _page(session: aiohttp.ClientSession, url: str, headers: dict[str, str], first: float, polls: int,
                interval_s: float, latencies: list[float], failures: list[str]) -> None:
    """One page: `polls` GETs of `url`, at `first`, first + interval, ...; each answer's latency (or its failure)."""
    for poll in range(polls):
        await asyncio.sleep(max(first + poll * interval_s - time.monotonic(), 0.0))
        sent = time.monotonic()
        try:
            async with session.get(url, headers=headers) as response:
                await response.read()
                if response.status != 200:
                    failures.append(f"HTTP {response.status}")
                else:
                    latencies.append((time.monotonic() - sent) * 1000)
        except (aiohttp.ClientError, TimeoutError) as exc:
            failures.append(f"{type(exc).__name__}: {exc}")


async def _poll(url: str, options: WebBench) -> tuple[list[float], list[str]]:
    latencies: list[float] = []
    failures: list[str] = []
    headers = {} if options.api_key is None else {"Authorization": f"Bearer {options.api_key}"}
    timeout = aiohttp.ClientTimeout(total=max(options.interval_s, 5.0))
    start = time.monotonic() + 0.05
    polls = max(1, round(options.seconds / options.interval_s))  # each page's, over the window
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(_page(session, f"{url}/stages", headers, start + page * options.interval_s
                                     / options.pages, polls, options.interval_s, latencies, failures)
                               for page in range(options.pages)))
    return latencies, failures


def measure(url: str, pid: int, options: WebBench, progress: Callable[[str], None],
            cpu: Callable[[int], float] = process_cpu_seconds) -> list[Window]:
    """The idle window (unless `options.baseline` is off), then the polling window, against `url` and `pid`."""
    windows = []
    if options.baseline:
        progress(f"idle: the gateway (pid {pid}) with nobody polling, {options.seconds:g} s")
        before, started = cpu(pid), time.monotonic()
        time.sleep(options.seconds)
        windows.append(Window("idle", time.monotonic() - started, cpu(pid) - before))
    progress(f"polling: {options.pages} pages, GET {url}/stages every {options.interval_s:g} s each, "
             f"{options.seconds:g} s")
    before, started = cpu(pid), time.monotonic()
    latencies, failures = asyncio.run(_poll(url, options))
    windows.append(Window("polling", time.monotonic() - started, cpu(pid) - before, tuple(latencies),
                          len(failures)))
    if failures:
        progress(f"{len(failures)} polls failed, e.g. {failures[0]}")
    return windows


def run_web_bench(options: WebBench, report: Report, progress: Callable[[str], None]) -> WebResults:
    """Measure against --url/--pid, or against a serve started here (stopped at the end); a row per window."""
    from skippy_zmq.bench.servers import ServerCommand, log_directory, started
    from skippy_zmq.launch.topology import free_tcp_ports

    if options.url is not None:
        if options.pid is None:
            raise BenchError("--url needs --pid, the gateway's process id (its CPU time is what is measured)")
        windows = measure(options.url.rstrip("/"), options.pid, options, progress)
    else:
        command = ServerCommand.skippy_serve(options.serve_args, port=free_tcp_ports(1)[0], model=options.model)
        with log_directory() as logs, started([command], logs, ready_timeout_s=options.ready_timeout_s,
                                              progress=progress) as servers:
            windows = measure(command.url, servers[0].process.pid, options, progress)
            servers[0].check_alive()
    for window in windows:
        report.add({"row": "window", "label": options.label, "pages": options.pages,
                    "interval_s": options.interval_s, **window.as_json()})
    return WebResults(options, tuple(windows))


def problems(results: WebResults) -> Sequence[str]:
    """What makes the figures not count: polls that failed."""
    return [f"{w.failed} of the {w.name} window's polls failed" for w in results.windows if w.failed]
