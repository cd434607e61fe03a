"""One ZeroMQ client that never reads against `skippy-zmq serve --zmq-bind`: the gateway's memory and
another client's latency meanwhile (docs/PROTOCOL.md §8.1, "Bounded per client").

    python3 -m tools.hog_request_api --port 8111 --zmq tcp://127.0.0.1:5611 -- \\
        skippy-zmq serve --stages 1 --port 8111 --zmq-bind tcp://127.0.0.1:5611

Starts the command and waits for its `/health` 200. Then a `Client` times 2-token completions
before, during and after the flood: `--pings` pings (10,000) from one DEALER that never reads,
each naming 256 unknown request ids, so each is answered with a pong and 256 error frames. Reports
the serve process's resident memory (VmRSS) before, after the flood and after the hog leaves, and
`skippy_gateway_zmq_clients_cut_off_total` from /metrics; stops the command with SIGTERM. Prints
one JSON line; exit status 2 when the command never answered /health with 200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence

import zmq

from skippy_zmq import Client
from tools._common import EXIT_NOT_STARTED, ToolError, http_get, proc_status_kib, running, wait_healthy

CUT_OFF_METRIC = "skippy_gateway_zmq_clients_cut_off_total"


def rss_mib(pid: int) -> float:
    """VmRSS of one process, in MiB (0 when unreadable)."""
    return (proc_status_kib(pid, "VmRSS") or 0) / 1024


def _cut_offs(base: str) -> float:
    _, text = http_get(f"{base}/metrics", 10.0)
    values = [float(line.split()[1]) for line in text.splitlines() if line.startswith(CUT_OFF_METRIC + " ")]
    return values[0] if values else float("nan")


def _latency_ms(client: Client) -> float:
    started = time.monotonic()
    client.complete("The capital of France is", max_tokens=2, temperature=0)
    return (time.monotonic() - started) * 1000


def _flood(context: zmq.Context[zmq.Socket[bytes]], endpoint: str, pings: int, seconds: list[float]) -> None:
    """Send the pings from a DEALER that reads nothing (send blocks at its high-water mark)."""
    hog = context.socket(zmq.DEALER)
    hog.setsockopt(zmq.LINGER, 0)
    hog.setsockopt(zmq.SNDTIMEO, 60_000)
    hog.connect(endpoint)
    ping = json.dumps({"v": 1, "type": "ping", "waiting": [f"lost-{i}" for i in range(256)]}).encode()
    started = time.monotonic()
    try:
        for _ in range(pings):
            hog.send(ping)
        seconds.append(time.monotonic() - started)
    finally:
        hog.close(linger=0)


def measure(base: str, endpoint: str, pid: int, pings: int) -> dict[str, object]:
    """The figures of one flood against a serving process `pid`."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with Client(endpoint, context=context, timeout_s=120.0) as client:
            before = [_latency_ms(client) for _ in range(10)]
            rss_before = rss_mib(pid)
            seconds: list[float] = []
            hog = threading.Thread(target=_flood, args=(context, endpoint, pings, seconds))
            hog.start()
            during: list[float] = []
            while hog.is_alive():
                during.append(_latency_ms(client))
            hog.join()
            rss_flooded = rss_mib(pid)
            time.sleep(2.0)  # the hog's socket is closed: what the gateway gives back
            after = [_latency_ms(client) for _ in range(10)]
            rss_after = rss_mib(pid)
    finally:
        context.term()
    return {
        "pings": pings, "flood_s": round(seconds[0], 1) if seconds else None,
        "latency_ms_p50": {"before": round(statistics.median(before)),
                           "during": round(statistics.median(during)) if during else None,
                           "after": round(statistics.median(after))},
        "latency_ms_max_during": round(max(during)) if during else None, "requests_during": len(during),
        "serve_rss_mib": {"before": round(rss_before), "flooded": round(rss_flooded), "after": round(rss_after)},
        "clients_cut_off": _cut_offs(base),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurement; the server command follows `--`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="the HTTP port the command serves on")
    parser.add_argument("--zmq", required=True, help="the endpoint of its request API (--zmq-bind)")
    parser.add_argument("--pings", type=int, default=10_000)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("the server command must follow --")
    base = f"http://127.0.0.1:{args.port}"
    try:
        with running(command, timeout_s=30) as process:
            wait_healthy(base, process, args.ready_timeout, name=command[0])
            figures = measure(base, args.zmq, process.pid, args.pings)
    except ToolError as exc:
        print(f"hog_request_api: {exc.message}", file=sys.stderr)
        return EXIT_NOT_STARTED
    print(json.dumps({"command": " ".join(command), **figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
