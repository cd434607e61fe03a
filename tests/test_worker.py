"""The stage transport with real worker processes: signals, shutdown and the stop flag."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from skippy_zmq.launch.processes import StageProcess
from skippy_zmq.launch.topology import free_tcp_ports, topology_toml
from skippy_zmq.stage.worker import StopRequest
from tests.conftest import TINY_LLAMA_LAYERS

ROUNDS = 10
WORKERS_PER_ROUND = 4
SIGNAL_PAIRS = [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT),
                (signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGTERM)]


def test_stop_request_is_a_plain_flag_safe_to_set_twice() -> None:
    stop = StopRequest()
    assert not stop.requested
    stop.set()
    stop.set()
    assert stop.requested


def test_signal_handlers_only_set_the_flag() -> None:
    stop = StopRequest()
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop.install()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs in the main thread between bytecodes
        assert stop.requested
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _one_stage_topology(directory: Path, model: Path, index: int) -> Path:
    text = topology_toml(model=str(model), ranges=[(0, TINY_LLAMA_LAYERS)], topology_id=f"signals-{index}",
                         ports=free_tcp_ports(2), n_layer=TINY_LLAMA_LAYERS, ctx_size=64)
    path = directory / f"topology-{index}.toml"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_two_quick_signals_always_end_in_a_clean_exit(tmp_path: Path, tiny_llama_path: Path) -> None:
    # A handler that takes a lock (threading.Event.set) deadlocks when a second signal lands
    # while the first handler holds it; this sends pairs of signals back to back, many times.
    paths = [_one_stage_topology(tmp_path, tiny_llama_path, i) for i in range(WORKERS_PER_ROUND)]
    exits: list[int] = []
    for round_index in range(ROUNDS):
        processes = [StageProcess(path, "stage-0", None) for path in paths]
        try:
            for process in processes:
                assert process.ready.wait(60), process.describe_exit()
            for offset, process in enumerate(processes):
                first, second = SIGNAL_PAIRS[(round_index + offset) % len(SIGNAL_PAIRS)]
                process.process.send_signal(first)
                process.process.send_signal(second)
            for process in processes:
                try:
                    exits.append(process.process.wait(20))
                except subprocess.TimeoutExpired:
                    exits.append(-999)  # hung: reported below, killed in `finally`
        finally:
            for process in processes:
                if process.exit_code() is None:
                    process.process.kill()
                    process.process.wait(10)
    assert exits == [0] * (ROUNDS * WORKERS_PER_ROUND)
