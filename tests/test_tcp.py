"""TCP keepalive on the link sockets (docs/PROTOCOL.md §1): seen by the kernel on a real
connection, and set on the sockets of the stage worker and the driver."""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from skippy_zmq.config import TopologyConfig
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.stage.worker import StageWorker
from skippy_zmq.tcp import IDLE_S, INTERVAL_S, MAX_UNACKED_MS, PROBES, keep_alive
from skippy_zmq.telemetry import EventLog
from skippy_zmq.tokens.tokenizer import Tokenizer
from tests.conftest import TINY_LLAMA_LAYERS
from tests.pipeline_helpers import write_topology

KEEPALIVE_TIMER = 2  # /proc/net/tcp's `tr` field: the keepalive timer is armed


def _timers(port: int) -> list[int]:
    """The timer kind of each established 127.0.0.1 connection with `port` at either end."""
    found = []
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, remote, state, timer = fields[1], fields[2], fields[3], fields[5]
            ports = {int(local.split(":")[1], 16), int(remote.split(":")[1], 16)}
            if state == "01" and port in ports:  # 01: ESTABLISHED
                found.append(int(timer.split(":")[0], 16))
    return found


def _connected_pair(context: zmq.Context[Any], *, alive: bool) -> tuple[zmq.Socket[Any], zmq.Socket[Any], int]:
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    if alive:
        keep_alive(pull)
        keep_alive(push)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    push.send(b"x")
    assert pull.poll(5000), "no message over the test connection within 5 s"
    pull.recv()
    return pull, push, port


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")
@pytest.mark.parametrize("alive", [True, False])
def test_the_kernel_arms_keepalive_on_both_ends_of_a_link(alive: bool) -> None:
    context: zmq.Context[Any] = zmq.Context()
    pull, push, port = _connected_pair(context, alive=alive)
    try:
        deadline = time.monotonic() + 5
        while len(timers := _timers(port)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the accepting side's connection appears in the table a moment later
        assert len(timers) == 2, f"established connections on port {port}: {timers}"
        assert timers == ([KEEPALIVE_TIMER] * 2 if alive else [0, 0])
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        context.term()


def test_keepalive_probes_start_well_before_a_virtual_ip_forgets_a_flow() -> None:
    # IPVS, behind a swarm service's virtual IP, drops a TCP flow idle for 900 s.
    assert IDLE_S + INTERVAL_S * PROBES < 900
    context: zmq.Context[Any] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        keep_alive(sock)
        assert (sock.getsockopt(zmq.TCP_KEEPALIVE), sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE),
                sock.getsockopt(zmq.TCP_KEEPALIVE_INTVL), sock.getsockopt(zmq.TCP_KEEPALIVE_CNT),
                sock.getsockopt(zmq.TCP_MAXRT)) == (1, IDLE_S, INTERVAL_S, PROBES, MAX_UNACKED_MS)
    finally:
        sock.close(linger=0)
        context.term()


def _alive(sock: zmq.Socket[Any]) -> bool:
    return bool(sock.getsockopt(zmq.TCP_KEEPALIVE) == 1 and sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE) == IDLE_S)


def test_the_driver_and_a_stage_keep_every_link_alive(tmp_path: Path, tiny_llama_path: Path) -> None:
    topology = TopologyConfig.from_toml(write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 2))
    first = topology.stages[0]
    runtime = StageRuntime.load(tiny_llama_path, first.layer_start, first.layer_end, ctx_size=first.ctx_size)
    worker = StageWorker(topology, first, runtime, log=EventLog("s0", io.StringIO()))
    try:
        assert worker._downstream is not None
        assert all(_alive(s) for s in (worker._pull, worker._downstream, worker._driver))
    finally:
        worker.close()
    with PipelineTransport(topology, Tokenizer.from_gguf(tiny_llama_path)) as transport:
        assert _alive(transport._returns) and _alive(transport._stage0)
