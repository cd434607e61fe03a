"""A restart of the driver side, measured (docs/PROTOCOL.md §6, Driver restarts).

`skippy-zmq up` runs a loopback topology (the planner's cut, free ports) and `skippy-zmq serve
--topology` goes in front. Once a greedy reference completion is in, `--lanes` streams take every
lane, `serve` gets SIGKILL while they stream, and the same `serve` command starts again against
the surviving stages. Printed: the time from that restart to /health 200 and to the first
completed request (and, for scale, how long the same completion took before the kill), its HTTP
status, and whether its text equals the reference.

    python3 -m tools.measure_restart                       # Gemma 3 270M, 2 stages, 4 lanes
    python3 -m tools.measure_restart --model tiny-gemma3.gguf --stages 2 --json
    python3 -m tools.measure_restart --threads 1           # one kernel thread per stage

`--threads` is kept beside the topology (`topology.launch.json`, as `write_local_topology`
does) for `up`; without it `up` gives every stage the host's cores, whose threads wait for each
other at every graph node when another process holds a core, so a busy host slows both
completions, before the kill and after it.

Exit status: 0 when the completion after the restart came back 200 with the reference text, 1
otherwise, 2 when the pipeline could not start.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from skippy_zmq.launch.planner import balanced_ranges
from skippy_zmq.launch.topology import free_tcp_ports, launch_file, topology_toml
from skippy_zmq.model.catalog import resolve_model
from skippy_zmq.model.gguf_model import ModelHParams
from tools._common import EXIT_NOT_STARTED, ToolError, post_json, running, skippy_command, wait_healthy

PROMPT = "The capital of France is"
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0


def _complete(url: str, max_tokens: int) -> tuple[int, str]:
    status, body = post_json(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0},
                             REQUEST_TIMEOUT_S)
    return status, body["choices"][0]["text"] if status == 200 else str(body)


def _open_stream(url: str) -> Any:
    """A long greedy stream, read up to its first chunk: its session holds a lane on every stage."""
    body = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S)
    while not response.readline().startswith(b"data: {"):
        pass
    return response


def measure(model: str, stages: int, lanes: int, max_tokens: int, directory: Path,
            threads: int | None = None) -> dict[str, Any]:
    """Run the scenario once (`threads` kernel threads per stage; None: `up`'s default); the figures."""
    path = resolve_model(model)
    n_layer = ModelHParams.from_gguf(path).n_layer
    topology = directory / "topology.toml"
    topology.write_text(topology_toml(model=str(path), ranges=balanced_ranges(n_layer, stages), topology_id="restart",
                                      ports=free_tcp_ports(stages + 1), lane_count=lanes, n_layer=n_layer))
    if threads is not None:
        launch_file(topology).write_text(json.dumps({"threads": threads}) + "\n")
    (port,) = free_tcp_ports(1)
    url = f"http://127.0.0.1:{port}"
    serve = skippy_command("serve", "--topology", str(topology), "--host", "127.0.0.1", "--port", str(port))
    with running(skippy_command("up", "--topology", str(topology)), log=directory / "up.log"):
        with running(serve, log=directory / "serve-1.log") as first:
            wait_healthy(url, first, START_TIMEOUT_S, name="serve", log=directory / "serve-1.log")
            _complete(url, max_tokens)  # warms the stages, as the restarted serve finds them
            started = time.monotonic()
            status, reference = _complete(url, max_tokens)
            reference_s = time.monotonic() - started
            if status != 200:
                raise ToolError(f"the reference completion failed ({status}): {reference}")
            streams = [_open_stream(url) for _ in range(lanes)]
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            for stream in streams:
                stream.close()
        restarted = time.monotonic()
        with running(serve, log=directory / "serve-2.log") as second:
            wait_healthy(url, second, START_TIMEOUT_S, name="the restarted serve", log=directory / "serve-2.log")
            healthy_s = time.monotonic() - restarted
            status, text = _complete(url, max_tokens)
            completed_s = time.monotonic() - restarted
    return {"model": str(path), "stages": stages, "lanes": lanes, "max_tokens": max_tokens,
            "reference_completion_s": round(reference_s, 2), "restart_to_health_200_s": round(healthy_s, 2),
            "restart_to_first_completion_s": round(completed_s, 2),
            "status": status, "identical": status == 200 and text == reference, "text": text,
            "reference": reference}


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run once, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="gemma3-270m-q4_k_m", help="GGUF path or alias")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--lanes", type=int, default=4, help="lane_count of every stage (all held at the kill)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None,
                        help="kernel threads per stage (default: up's, the host's cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads} must be at least 1")
    with tempfile.TemporaryDirectory(prefix="measure-restart-") as tmp:
        try:
            result = measure(args.model, args.stages, args.lanes, args.max_tokens, Path(tmp), args.threads)
        except ToolError as exc:
            print(f"measure_restart: {exc.message}", file=sys.stderr)
            return EXIT_NOT_STARTED
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['stages']} stages, {result['lanes']} lanes held by streams at the kill ({result['model']})")
        print(f"the same completion before the kill: {result['reference_completion_s']:.2f} s")
        print(f"restart -> /health 200: {result['restart_to_health_200_s']:.2f} s")
        print(f"restart -> first completion: {result['restart_to_first_completion_s']:.2f} s "
              f"(HTTP {result['status']}, text {'identical' if result['identical'] else 'DIFFERENT'})")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
