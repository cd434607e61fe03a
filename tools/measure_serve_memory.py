"""Start time and memory of a serving process tree: skippy-zmq serve or llama-server (docs/BENCHMARKS.md).

    python3 tools/measure_serve_memory.py --port 8099 -- skippy-zmq serve --stages 1 --lanes 16 --port 8099
    python3 tools/measure_serve_memory.py --port 8099 -- build/bin/llama-server -m MODEL -t 2 -np 16 -c 8192 --port 8099

Starts the command, times it to the first `/health` 200, sends 4 completions of 16 tokens one
after another, then sums the resident memory (VmRSS) of the command and every process below it,
and stops the tree with SIGTERM. Prints one JSON line.

A warm start, as a user's second start: `--warmup` starts (default 1) run first, unmeasured, and
the command runs without PYTHONDONTWRITEBYTECODE, so Python's bytecode caches of an editable
install are written and read as a normal install's are (with the variable set, every process
compiled the package's sources again: 0.1-0.2 s of CPU each, BENCHMARKS.md "Warm slots and an earlier start").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def _children() -> dict[int, list[int]]:
    """Each process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def tree_rss_mib(root: int) -> float:
    """VmRSS of `root` and all its descendants, in MiB."""
    tree, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        todo += tree.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def _get(url: str, timeout_s: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _complete(base: str, prompt: str) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurement; the server command follows `--`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="the port the command serves on")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured starts first (to /health 200)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    base = f"http://127.0.0.1:{args.port}"
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    for _ in range(args.warmup):
        _run(command, base, env, args.ready_timeout, measure=False)
    ready_s, rss = _run(command, base, env, args.ready_timeout, measure=True)
    print(json.dumps({"command": " ".join(command), "ready_s": round(ready_s, 2), "tree_rss_mib": round(rss)}))
    return 0


def _run(command: list[str], base: str, env: dict[str, str], ready_timeout: float, *,
         measure: bool) -> tuple[float, float]:
    """Start the command, wait for /health 200; with `measure`, the 4 completions and the tree's RSS."""
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                               env=env)
    rss = 0.0
    try:
        while _get(f"{base}/health", 2.0) != 200:
            if process.poll() is not None:
                raise SystemExit(f"{command[0]} exited with status {process.returncode} before /health was 200")
            if time.monotonic() - started > ready_timeout:
                raise SystemExit(f"/health was not 200 within {ready_timeout:g} s")
            time.sleep(0.05)
        ready_s = time.monotonic() - started
        if measure:
            for prompt in ("The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"):
                _complete(base, prompt)
            rss = tree_rss_mib(process.pid)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    return ready_s, rss


if __name__ == "__main__":
    raise SystemExit(main())
