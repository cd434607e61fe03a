"""One ZeroMQ client that never reads against `skippy-zmq serve --zmq-bind`: the gateway's memory and
another client's latency meanwhile (docs/PROTOCOL.md §8.1, "Bounded per client").

    python3 tools/hog_request_api.py --port 8111 --zmq tcp://127.0.0.1:5611 -- \\
        skippy-zmq serve --stages 1 --port 8111 --zmq-bind tcp://127.0.0.1:5611

Starts the command and waits for its `/health` 200. Then a `Client` times 2-token completions
before, during and after the flood: `--pings` pings (10,000) from one DEALER that never reads,
each naming 256 unknown request ids, so each is answered with a pong and 256 error frames. Reports
the serve process's resident memory (VmRSS) before, after the flood and after the hog leaves, and
`skippy_gateway_zmq_clients_cut_off_total` from /metrics; stops the command with SIGTERM. Prints
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import zmq

from skippy_zmq import Client

CUT_OFF_METRIC = "skippy_gateway_zmq_clients_cut_off_total"


def rss_mib(pid: int) -> float:
    """VmRSS of one process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _get(url: str, timeout_s: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), ""
    except OSError:
        return 0, ""


def _cut_offs(base: str) -> float:
    _, text = _get(f"{base}/metrics", 10.0)
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
    base = f"http://127.0.0.1:{args.port}"
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while _get(f"{base}/health", 2.0)[0] != 200:
            if process.poll() is not None:
                raise SystemExit(f"{command[0]} exited with status {process.returncode} before /health was 200")
            if time.monotonic() - started > args.ready_timeout:
                raise SystemExit(f"/health was not 200 within {args.ready_timeout:g} s")
            time.sleep(0.1)
        figures = measure(base, args.zmq, process.pid, args.pings)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    print(json.dumps({"command": " ".join(command), **figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
