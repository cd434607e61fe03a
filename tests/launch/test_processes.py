"""Local pipelines: the BLAS thread rule, local topology files, parallel start and its failures."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from skippy_zmq.config import TopologyConfig
from skippy_zmq.errors import ConfigError, ModelLoadError, StageError, StageTimeout
from skippy_zmq.launch import topology
from skippy_zmq.launch.planner import plan_model
from skippy_zmq.launch.processes import OPENMP_VARIABLES, LocalPipeline, _ProgressRelay, openmp_wait_environment
from skippy_zmq.launch.topology import blas_threads_per_stage, free_tcp_ports, topology_toml, write_local_topology
from skippy_zmq.link import LinkShape
from skippy_zmq.model.gguf_file import read_header
from skippy_zmq.model.gguf_model import read_hparams
from skippy_zmq.testing.tiny import write_tiny_model
from tests.conftest import TINY_GEMMA3_LAYERS, TINY_LLAMA_LAYERS


def test_blas_threads_split_the_cores_among_the_stages_busy_at_once() -> None:
    assert blas_threads_per_stage(3, cores=2) == 2  # stages take turns: each may use every core
    assert blas_threads_per_stage(2, busy_stages=2, cores=2) == 1
    assert blas_threads_per_stage(2, busy_stages=8, cores=8) == 4  # at most n_stages are busy
    assert blas_threads_per_stage(4, busy_stages=4, cores=2) == 1  # never fewer than one
    assert blas_threads_per_stage(3, busy_stages=2, cores=5) == 2
    with pytest.raises(ConfigError, match="must be >= 1"):
        blas_threads_per_stage(0, cores=2)


def test_free_ports_are_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    low = topology._ephemeral_low()
    first = free_tcp_ports(40)
    second = free_tcp_ports(40)
    assert len(set(first + second)) == 80
    assert all(topology._LOWEST_PORT <= port < low for port in first + second)


def test_a_port_someone_holds_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", 0))
        held = holder.getsockname()[1]
        # The range below the ephemeral one squeezed to the held port alone: the picker must
        # refuse it and fall back to a port the OS picks.
        monkeypatch.setattr(topology, "_LOWEST_PORT", held)
        monkeypatch.setattr(topology, "_ephemeral_low", lambda: held + 1)
        (port,) = free_tcp_ports(1)
        assert port != held
    finally:
        holder.close()


def test_local_topology_uses_the_planner_lanes_context_and_threads(tmp_path: Path,
                                                                   tiny_gemma3_path: Path) -> None:
    path = write_local_topology(str(tiny_gemma3_path), TINY_GEMMA3_LAYERS, 3, codec="raw-f32-v1",
                                policy="fixed", directory=tmp_path, lane_count=16, ctx_size=512,
                                threads=3, cache_type_k="f32")
    topology = TopologyConfig.from_toml(path)
    plan = plan_model(read_hparams(tiny_gemma3_path), 3, batch=16)
    assert [(s.layer_start, s.layer_end) for s in topology.stages] == list(plan.ranges)
    assert {(s.lane_count, s.ctx_size, s.cache_type_k, s.cache_type_v) for s in topology.stages} == {
        (16, 512, "f32", "f16")}
    assert json.loads((tmp_path / "topology.launch.json").read_text()) == {"threads": 3}
    assert LocalPipeline(path).threads == 3
    assert LocalPipeline(path, threads=1).threads == 1
    with pytest.raises(ConfigError, match="has 7 layers, not 6"):
        write_local_topology(str(tiny_gemma3_path), 6, 2, codec="raw-f32-v1", policy="fixed",
                             directory=tmp_path)


def test_local_topology_keeps_equal_layers_when_asked(tmp_path: Path) -> None:
    # An explicit head weight needs no model file (callers that plan themselves).
    path = write_local_topology("absent.gguf", 18, 3, codec="raw-f32-v1", policy="fixed",
                                head_layers=0.0, directory=tmp_path)
    topology = TopologyConfig.from_toml(path)
    assert [(s.layer_start, s.layer_end) for s in topology.stages] == [(0, 6), (6, 12), (12, 18)]
    assert not (tmp_path / "topology.launch.json").exists()
    assert LocalPipeline(path).threads == blas_threads_per_stage(3)


def test_local_topology_emulates_every_link_when_asked_and_none_otherwise(tmp_path: Path) -> None:
    shape = LinkShape(delay_ms=25, jitter_ms=5, stall_ms=10, stall_every_ms=1000)
    for emulate_link, expected in ((None, LinkShape.off()), (shape, shape)):
        path = write_local_topology("absent.gguf", 18, 3, codec="raw-f32-v1", policy="fixed", head_layers=0.0,
                                    directory=tmp_path, emulate_link=emulate_link)
        assert [s.link for s in TopologyConfig.from_toml(path).stages] == [expected] * 3
    assert 'emulate_link = "delay=25ms,jitter=5ms,stall=10ms@1s"' in path.read_text()


def test_progress_relay_names_the_stage_and_throttles_details() -> None:
    lines: list[str] = []
    relay = _ProgressRelay("stage-1", lines.append, interval_s=3600)
    relay({"event": "loading", "layers": [2, 4], "model": "m.gguf", "cache_types": ["f16", "f32"]})
    relay({"event": "load_progress", "detail": "loaded layer 2"})  # within the interval: dropped
    relay({"event": "loaded", "seconds": 0.5})
    relay({"event": "fatal", "error": "boom"})
    relay({"event": "heartbeat"})
    relay({"event": "loading", "layers": [2, 4], "model": "m.gguf"})  # an older worker's event
    assert lines == ["stage-1: loading layers 2..4 of m.gguf, KV cache keys f16 values f32", "stage-1: loaded in 0.5 s",
                     "stage-1: failed: boom", "stage-1: loading layers 2..4 of m.gguf"]


def _three_stage_topology(directory: Path, model: Path, **extra: Any) -> Path:
    from skippy_zmq.launch.topology import free_tcp_ports

    text = topology_toml(model=str(model), ranges=[(0, 1), (1, 2), (2, TINY_LLAMA_LAYERS)],
                         topology_id="launch", ports=free_tcp_ports(4), n_layer=TINY_LLAMA_LAYERS,
                         ctx_size=64, **extra)
    path = directory / "topology.toml"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_stages_start_in_parallel_and_report_progress(tmp_path: Path, tiny_llama_path: Path) -> None:
    lines: list[str] = []
    pipeline = LocalPipeline(_three_stage_topology(tmp_path, tiny_llama_path), progress=lines.append,
                             threads=1)
    try:
        pipeline.start(ready_timeout_s=60)
        assert len(pipeline.processes) == 3 and not pipeline.dead()
    finally:
        exits = pipeline.stop()
    assert exits == {"stage-0": 0, "stage-1": 0, "stage-2": 0}
    assert [p.stage_id for p in pipeline.processes] == ["stage-0", "stage-1", "stage-2"]  # topology order
    first_ready = next(i for i, line in enumerate(lines) if re.fullmatch(r"stage-\d ready .*", line))
    starts = [line for line in lines[:first_ready] if line.startswith("starting stage")]
    assert len(starts) == 3 and starts[0].startswith("starting stage 2")  # the head's stage, the most weights, first
    for index in range(3):
        assert any(line.startswith(f"stage-{index}: loading layers") for line in lines)
        assert any(line.startswith(f"stage-{index} ready (pid ") for line in lines)


@pytest.mark.slow
def test_readiness_is_bounded_and_names_the_stages_still_loading(tmp_path: Path,
                                                                 tiny_llama_path: Path) -> None:
    pipeline = LocalPipeline(_three_stage_topology(tmp_path, tiny_llama_path), threads=1)
    with pytest.raises(StageTimeout, match=r"not ready after 0 s: stage-0 \(pid \d+\), stage-1 \(pid \d+\), "
                                           r"stage-2 \(pid \d+\)"):
        pipeline.start(ready_timeout_s=0.0)
    assert pipeline.processes and all(p.exit_code() is not None for p in pipeline.processes)


@pytest.mark.parametrize(("environ", "added"), [
    ({}, {"GOMP_SPINCOUNT": "20000"}),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {}),
    ({"OMP_WAIT_POLICY": ""}, {}),
    ({"GOMP_SPINCOUNT": "0"}, {}),
    ({"PATH": "/bin"}, {"GOMP_SPINCOUNT": "20000"}),
])
def test_openmp_threads_spin_briefly_unless_the_environment_says_how_they_wait(
        environ: dict[str, str], added: dict[str, str]) -> None:
    assert openmp_wait_environment(environ) == added
    # a file with expert layers: a tenth of the spin, the environment still winning
    assert openmp_wait_environment(environ, experts=True) == ({"GOMP_SPINCOUNT": "2000"} if added else {})


def test_a_topology_has_experts_when_its_file_does(tmp_path: Path, tiny_llama_path: Path,
                                                   expert_mini_path: Path) -> None:
    def topology_of(model: Path) -> TopologyConfig:
        n_layer = read_hparams(model).n_layer
        text = topology_toml(model=str(model), ranges=[(0, n_layer)], topology_id="experts", ports=[5710, 5711],
                             n_layer=n_layer)
        path = tmp_path / f"{model.stem}.toml"
        path.write_text(text)
        return TopologyConfig.from_toml(path)

    assert topology.has_experts(topology_of(expert_mini_path))
    assert not topology.has_experts(topology_of(tiny_llama_path))


@pytest.mark.slow
def test_stages_start_with_the_bounded_openmp_spin_unless_told_otherwise(tmp_path: Path, tiny_llama_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OPENMP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for wanted, env in ((b"GOMP_SPINCOUNT=20000", None), (b"OMP_WAIT_POLICY=PASSIVE", "PASSIVE")):
        if env is not None:
            monkeypatch.setenv("OMP_WAIT_POLICY", env)
        pipeline = LocalPipeline(_three_stage_topology(tmp_path, tiny_llama_path), threads=1)
        try:
            pipeline.start(ready_timeout_s=60)
            for process in pipeline.processes:
                environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
                assert wanted in environ
                assert (b"GOMP_SPINCOUNT=20000" in environ) is (env is None)
        finally:
            pipeline.stop()


def test_a_missing_model_is_refused_before_any_stage_starts(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    pipeline = LocalPipeline(_three_stage_topology(tmp_path, missing), threads=1)
    with pytest.raises(ModelLoadError, match=r"model file .*missing\.gguf' does not exist"):
        pipeline.start(ready_timeout_s=60)
    assert pipeline.processes == []


@pytest.mark.slow
def test_a_stage_that_cannot_load_fails_the_start_by_name(tmp_path: Path) -> None:
    # The header is sound (the memory check passes) but a norm of layer 2 holds NaN, which a stage
    # checking its tensors refuses at load.
    path = write_tiny_model(tmp_path / "nan.gguf", arch="llama", n_layer=TINY_LLAMA_LAYERS, seed=1)
    info = read_header(path).tensors["blk.2.attn_norm.weight"]
    with open(path, "r+b") as handle:
        handle.seek(info.data_offset)
        handle.write(np.full(4, np.nan, dtype=np.float32).tobytes())
    pipeline = LocalPipeline(_three_stage_topology(tmp_path, path), threads=1, check_tensors=True)
    with pytest.raises(StageError, match=r"stage failed to start: stage-2 \(pid \d+\) exited with status 1: "
                                         r".*blk\.2\.attn_norm\.weight"):
        pipeline.start(ready_timeout_s=60)
    assert all(p.exit_code() is not None for p in pipeline.processes)


def test_a_launcher_relays_worker_lines_in_one_format_and_says_nothing_twice() -> None:
    from skippy_zmq.launch.processes import PROGRESS_EVENTS, render_worker_line
    from skippy_zmq.telemetry import parse_event

    ready = json.dumps({"ts": 1.0, "component": "stage-0", "event": "ready", "pull": "tcp://127.0.0.1:1"})
    failed = json.dumps({"ts": 1.0, "component": "stage-0", "event": "message_failed", "error": "bad", "cause": "X"})
    traceback_line = "Traceback (most recent call last):\n"
    # JSON: the worker's lines as they are; its stray text wrapped as an `output` event.
    as_json = [render_worker_line("stage-0", line, parse_event(line), json_lines=True, progress_shown=True)
               for line in (ready, failed, traceback_line)]
    assert as_json[:2] == [ready, failed]
    assert as_json[2] is not None
    wrapped = parse_event(as_json[2])
    assert wrapped is not None
    assert (wrapped["event"], wrapped["component"], wrapped["line"]) == ("output", "stage-0", traceback_line.rstrip())
    # Plain: no JSON at all, and nothing the progress lines already say.
    plain = [render_worker_line("stage-0", line, parse_event(line), json_lines=False, progress_shown=True)
             for line in (ready, failed, traceback_line)]
    assert plain == [None, "[skippy-zmq] stage-0: message failed: bad (cause=X)", traceback_line]
    assert "ready" in PROGRESS_EVENTS and "loading" in PROGRESS_EVENTS
    # Without progress lines (serve --verbose with no progress callback) a plain ready is shown.
    assert render_worker_line("stage-0", ready, parse_event(ready), json_lines=False, progress_shown=False) == (
        "[skippy-zmq] stage-0: ready (pull=tcp://127.0.0.1:1)")


def test_a_pipeline_for_one_host_runs_only_that_hosts_stages(tmp_path: Path, tiny_llama_path: Path) -> None:
    from skippy_zmq.launch.hosts import HostEntry, hosts_topology

    path = tmp_path / "cluster.toml"
    path.write_text(hosts_topology(str(tiny_llama_path), [HostEntry("a.lan", 1 << 30), HostEntry("b.lan", 1 << 30),
                                                          HostEntry("a.lan", 1 << 30)], lane_count=1, ctx_size=64))
    first, second = LocalPipeline(path, host="a.lan"), LocalPipeline(path, host="b.lan")
    assert [s.stage_id for s in first.stages] == ["stage-0", "stage-2"]
    assert [s.stage_id for s in second.stages] == ["stage-1"]
    assert first.threads == blas_threads_per_stage(2) and second.threads == blas_threads_per_stage(1)
    assert len(LocalPipeline(path).stages) == 3
    with pytest.raises(ConfigError, match=r"no stage runs on host 'c\.lan'; the hosts of its stages are a\.lan "
                                          r"\(stage-0, stage-2\); b\.lan \(stage-1\)"):
        LocalPipeline(path, host="c.lan")
