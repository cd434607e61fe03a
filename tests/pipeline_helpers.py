"""Helpers for end-to-end tests: real worker processes on 127.0.0.1, every wait bounded."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.launch.planner import balanced_ranges
from skippy_zmq.launch.processes import LocalPipeline
from skippy_zmq.launch.topology import free_tcp_ports, topology_toml
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.testing.random_model import TokenizerKeys
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer
from skippy_zmq.wire.replies import Reply, decode_reply

PROMPTS = ["hello world", "the quick brown fox", "once upon a time", "a b c d e f g"]


def write_topology(
    directory: Path,
    model: Path,
    n_layer: int,
    n_stages: int,
    *,
    codec: str = "raw-f32-v1",
    policy: str = "fixed",
    lane_count: int = 8,
    ctx_size: int = 256,
    extra: str = "",
    curve: bool = False,
    cache_type: str = "f16",
) -> Path:
    """A loopback topology for `model` on free ports, keys and values kept in `cache_type`; with
    `curve`, CURVE on and keys made."""
    text = topology_toml(
        model=str(model),
        ranges=balanced_ranges(n_layer, n_stages),
        topology_id=f"test-{n_stages}",
        ports=free_tcp_ports(n_stages + 1),
        codec=codec,
        policy=policy,
        lane_count=lane_count,
        ctx_size=ctx_size,
        n_layer=n_layer,
        cache_type_k=cache_type,
        cache_type_v=cache_type,
    )
    path = directory / f"topology-{n_stages}-{codec}-{policy}-{lane_count}.toml"
    if curve:
        extra += '\n[security]\ncurve = true\nkeys_dir = "keys"\nclients_dir = "clients"\n'
    path.write_text(text + extra)
    if curve:
        from skippy_zmq.config import TopologyConfig
        from skippy_zmq.security.keys import keygen

        keygen(TopologyConfig.from_toml(path))
    return path


@contextlib.contextmanager
def running(topology_path: Path, threads: int | None = 1) -> Iterator[LocalPipeline]:
    """Start every stage (downstream first, `threads` kernel threads each, LocalPipeline's default
    when None) and always stop them all. One thread by default: a stage's two ggml threads wait for
    each other at every graph step, so on a busy test host they ran up to 100x slower (docs/BENCHMARKS.md,
    "A restart of `serve`")."""
    pipeline = LocalPipeline(topology_path, threads=threads)
    try:
        pipeline.start(ready_timeout_s=60)
        yield pipeline
    finally:
        pipeline.stop()


def generate(
    pipeline: LocalPipeline,
    model: Path,
    prompts: Sequence[str],
    *,
    max_tokens: int = 16,
    sampling: SamplingParams | None = None,
    timeout_s: float = 30.0,
    prefill_chunk: int = 4,
) -> list[GenerationResult]:
    """Run prompts as concurrent sessions through a running pipeline."""
    tokenizer = Tokenizer.from_gguf(model)
    requests = [
        GenerationRequest(prompt=p, max_tokens=max_tokens, sampling=sampling or SamplingParams())
        for p in prompts
    ]
    with PipelineTransport(pipeline.topology, tokenizer, SchedulerSettings(
            reply_timeout_s=timeout_s, silence_s=5.0, prefill_chunk=prefill_chunk)) as client:
        client.wait_ready(30)
        return client.generate(requests)


def reference_greedy(model: Path, prompt_ids: Sequence[int], max_tokens: int, eog: set[int],
                     cache_type: str = "f16") -> list[int]:
    """Greedy tokens from one in-process runtime running every layer (the oracle), keys and values
    kept in `cache_type`."""
    from skippy_zmq.model.gguf_model import ModelHParams

    n_layer = ModelHParams.from_gguf(model).n_layer
    runtime = StageRuntime.load(model, 0, n_layer, ctx_size=256, cache_type_k=cache_type, cache_type_v=cache_type)
    runtime.open_session(1)
    hidden = runtime.forward(1, 0, np.asarray(prompt_ids, np.int32))
    tokens: list[int] = []
    position = len(prompt_ids)
    while True:
        token = int(np.argmax(runtime.logits(hidden[-1:])[0]))
        tokens.append(token)
        if token in eog or len(tokens) >= max_tokens:
            return tokens
        hidden = runtime.forward(1, position, np.asarray([token], np.int32))
        position += 1


class RawPeer:
    """A hand-driven driver: PUSH into any stage's PULL, PULL on the driver return endpoint."""

    def __init__(self, pipeline: LocalPipeline) -> None:
        self.topology = pipeline.topology
        self.context = zmq.Context()
        self.returns = self.context.socket(zmq.PULL)
        self.returns.setsockopt(zmq.LINGER, 0)
        self.returns.bind(self.topology.driver.return_bind)
        self.pushes: dict[int, zmq.Socket[Any]] = {}

    def send(self, stage_index: int, frames: Sequence[Any]) -> None:
        """Send raw frames to a stage's PULL socket."""
        if stage_index not in self.pushes:
            push = self.context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDTIMEO, 5000)
            push.connect(self.topology.stages[stage_index].pull_connect)
            self.pushes[stage_index] = push
        self.pushes[stage_index].send_multipart(list(frames), copy=False)

    def reply(self, timeout_s: float = 10.0) -> Reply:
        """The next reply that is not a heartbeat; AssertionError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.returns.poll(100):
                reply = decode_reply(self.returns.recv_multipart())
                if not reply.is_heartbeat:
                    return reply
        raise AssertionError(f"no reply within {timeout_s} s")

    def close(self) -> None:
        """Close every socket with linger 0."""
        for push in self.pushes.values():
            push.close(linger=0)
        self.returns.close(linger=0)
        self.context.term()


class ThreadedPipeline:
    """Every stage of a tiny model as a `StageWorker` thread of this process, on loopback TCP:
    a real pipeline for in-process tests (no subprocess, no signals)."""

    def __init__(self, directory: Path, model: Path, n_layer: int, n_stages: int, *, lane_count: int = 8,
                 ctx_size: int = 128, curve: bool = False) -> None:
        from skippy_zmq.config import TopologyConfig

        self.path = write_topology(directory, model, n_layer, n_stages, lane_count=lane_count, ctx_size=ctx_size,
                                   curve=curve)
        self.topology = TopologyConfig.from_toml(self.path)
        self.tokenizer = Tokenizer.from_gguf(model)
        self._model = model
        self._workers: list[Any] = []
        self._threads: list[Any] = []

    def __enter__(self) -> ThreadedPipeline:
        import io
        import threading

        from skippy_zmq.stage.worker import StageWorker
        from skippy_zmq.telemetry import EventLog

        for stage in self.topology.stages:
            runtime = StageRuntime.load(self._model, stage.layer_start, stage.layer_end, ctx_size=stage.ctx_size)
            eog = sorted(self.tokenizer.eog_ids) if self.topology.is_final(stage) else ()
            worker = StageWorker(self.topology, stage, runtime, log=EventLog(stage.stage_id, io.StringIO()),
                                 eog_ids=eog, heartbeat_s=0.2)
            worker.bind()
            thread = threading.Thread(target=worker.serve, kwargs={"max_seconds": 300}, daemon=True)
            thread.start()
            self._workers.append(worker)
            self._threads.append(thread)
        return self

    @property
    def workers(self) -> list[Any]:
        """The running `StageWorker`s, by stage index."""
        return self._workers

    def sessions(self) -> list[int]:
        """Live sessions per stage."""
        return [len(worker.core.sessions) for worker in self._workers]

    def __exit__(self, *_exc: object) -> None:
        for worker in self._workers:
            worker.stop()
        for thread in self._threads:
            thread.join(10)


def family_tokenizer(vocab: str, template: str) -> TokenizerKeys:
    """The tokenizer keys a random-weights file gets from one of llama.cpp's vocabularies (`vocab`, e.g.
    "qwen2" for ggml-vocab-qwen2.gguf) with one of its chat templates (`template`, a file stem of its
    models/templates), for `write_random_model`."""
    from skippy_zmq.model.gguf_file import GGUFValueType
    from skippy_zmq.testing.llama_sources import template_files, vocab_cases
    from skippy_zmq.testing.random_model import CopiedKey

    keys = TokenizerKeys.copied_from(next(case.path for case in vocab_cases() if case.name == vocab))
    text = next(path for path in template_files() if path.stem == template).read_text()
    chat = CopiedKey("tokenizer.chat_template", text, GGUFValueType.STRING, None)
    return TokenizerKeys(keys.label, keys.n_vocab, (*keys.keys, chat))


def plain_llama(model: Path, *, n_ctx: int, n_threads: int, type_k: int = 0, type_v: int = 0, **options: Any) -> Any:
    """llama.cpp (llama-cpp-python) on `model` with CPU weight buffers only and an F32 KV cache
    unless `type_k`/`type_v` name another ggml type (1: F16): its AMX buffers die with an illegal
    instruction on some Intel machines, and the CPU kernels are the ones the ggml kernel shares
    (docs/ARCHITECTURE.md, "Kernels"). Skips without it."""
    import pytest

    low = pytest.importorskip("llama_cpp.llama_cpp")
    from llama_cpp import Llama

    defaults = low.llama_model_default_params

    def plain_buffers() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = plain_buffers  # Llama() takes no such argument: set the default
    try:
        return Llama(model_path=str(model), n_ctx=n_ctx, n_threads=n_threads, type_k=type_k, type_v=type_v,
                     verbose=False, **options)
    finally:
        low.llama_model_default_params = defaults
