"""Start time and memory of a serving process tree: skippy-zmq serve or llama-server (docs/BENCHMARKS.md).

    python3 tools/measure_serve_memory.py --port 8099 -- skippy-zmq serve --stages 1 --lanes 16 --port 8099
    python3 tools/measure_serve_memory.py --port 8099 -- build/bin/llama-server -m MODEL -t 2 -np 16 -c 8192 --port 8099

Starts the command, times it to the first `/health` 200, sends 4 completions of 16 tokens one
after another, then sums the resident memory (VmRSS) of the command and every process below it,
and stops the tree with SIGTERM. Prints one JSON line.
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
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    base = f"http://127.0.0.1:{args.port}"
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while _get(f"{base}/health", 2.0) != 200:
            if process.poll() is not None:
                raise SystemExit(f"{command[0]} exited with status {process.returncode} before /health was 200")
            if time.monotonic() - started > args.ready_timeout:
                raise SystemExit(f"/health was not 200 within {args.ready_timeout:g} s")
            time.sleep(0.05)
        ready_s = time.monotonic() - started
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
    print(json.dumps({"command": " ".join(command), "ready_s": round(ready_s, 2), "tree_rss_mib": round(rss)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
