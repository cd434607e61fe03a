"""A link between hosts goes down mid-completion (docs/PROTOCOL.md §1, socket settings): stage 1
runs in a network namespace of its own, behind a bridge, and its link is taken down for 5 s while a greedy
completion streams. TCP holds the connections; the gateway names the stage down, then back; the
completion ends with the text the same request gave before, and nothing hangs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skippy_zmq.bench.links import Network
from skippy_zmq.launch.topology import topology_toml
from tests.bench.test_links import _namespaces_unavailable
from tests.conftest import TINY_LLAMA_LAYERS

pytestmark = pytest.mark.slow  # real processes in network namespaces

PORT = 8190
BODY = {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
OUTAGE_S = 5.0


class Hosts:
    """Stage 0 and the gateway in host 0's namespace, stage 1 in host 1's; the client in the root one."""

    def __init__(self, network: Network, topology: Path, logs: Path) -> None:
        self.network = network
        self.layout = network.layout
        self.topology = topology
        self.logs = logs
        self.processes: list[subprocess.Popen[bytes]] = []
        self.url = f"http://{self.layout.gateway_address}:{PORT}"

    def start(self, name: str, host: int, *args: str) -> None:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 (closed when the process is reaped)
        self.processes.append(subprocess.Popen(
            ["ip", "netns", "exec", self.layout.host(host), sys.executable, "-m", "skippy_zmq.cli", *args],
            stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONPATH": str(Path.cwd())}))

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


@pytest.fixture
def hosts(tmp_path: Path, tiny_llama_path: Path) -> Iterator[Hosts]:
    reason = _namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)
    network = Network.plan(2, lambda _text: None)
    layout = network.layout
    addresses = [layout.host_address(0), layout.host_address(1)]
    topology = tmp_path / "topology.toml"
    topology.write_text(topology_toml(
        model=str(tiny_llama_path), ranges=[(0, 2), (2, TINY_LLAMA_LAYERS)], topology_id="link-fault",
        ports=[5730, 5731, 5732], stage_hosts=addresses, driver_host=addresses[0], lane_count=2, ctx_size=256))
    running = Hosts(network, topology, tmp_path)
    try:
        network.create()
        running.start("stage-1", 1, "worker", "--topology", str(topology), "--stage", "stage-1")
        running.start("stage-0", 0, "worker", "--topology", str(topology), "--stage", "stage-0")
        running.start("gateway", 0, "serve", "--topology", str(topology), "--host", layout.gateway_address,
                      "--port", str(PORT))
        deadline = time.monotonic() + 120
        while not _healthy(running.url):
            assert time.monotonic() < deadline, f"the pipeline was not healthy within 120 s\n{running.log('gateway')}"
            time.sleep(0.5)
        yield running
    finally:
        running.stop()
        network.delete()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _complete(url: str) -> str:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(BODY).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return str(json.load(answer)["choices"][0]["text"])


def _stream(url: str, on_chunk: Any) -> str:
    """The streamed completion's text; `on_chunk(n)` after the n-th chunk."""
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(BODY | {"stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    pieces: list[str] = []
    with urllib.request.urlopen(request, timeout=120) as answer:
        for raw in answer:
            line = raw.strip()
            if line == b"data: [DONE]":
                return "".join(pieces)
            if line.startswith(b"data: "):
                chunk = json.loads(line.removeprefix(b"data: "))
                assert chunk.get("choices"), chunk
                pieces.append(chunk["choices"][0]["text"])
                on_chunk(len(pieces))
    raise AssertionError("the stream ended without [DONE]")


def test_a_link_down_for_5_s_mid_completion_ends_in_the_same_text(hosts: Hosts) -> None:
    before = _complete(hosts.url)
    layout = hosts.layout
    link = ["ip", "-n", layout.host(1), "link", "set", layout.host_veth(1)]
    restored = threading.Event()

    def cut(count: int) -> None:
        if count != 6:
            return
        subprocess.run([*link, "down"], check=True, timeout=30)

        def restore() -> None:
            subprocess.run([*link, "up"], check=True, timeout=30)
            restored.set()

        threading.Timer(OUTAGE_S, restore).start()

    started = time.monotonic()
    streamed = _stream(hosts.url, cut)
    took = time.monotonic() - started
    assert restored.wait(30)
    assert streamed == before
    assert took >= OUTAGE_S  # the stream really waited for the link
    log = hosts.log("gateway")
    # Each event once, naming the stage and its host (docs/ARCHITECTURE.md, "Observability").
    down = [line for line in log.splitlines() if "stage 1 \"stage-1\" at " + layout.host_address(1) in line
            and "is down" in line]
    assert len(down) == 1, log[-3000:]
    assert "is back after" in log, log[-3000:]
    assert _healthy(hosts.url)
