"""`bench pipeline`: one process holding every layer against 1-, 2- and 3-stage pipelines on tcp loopback.

Per setup: decode tok/s of 1 session and of 4 concurrent sessions; per hop of the pipelines: the
transfer time of decode messages (p50/p99 µs, from the trace records) and the activation bytes per
token; and bare pyzmq PUSH/PULL between two processes with the same payload, at a decode step's
cadence and back to back. Every round measures everything once, so each ratio compares figures
taken minutes apart at most, and the spread over rounds shows the host's noise.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import zmq

from skippy_zmq.bench.report import Report, cell, markdown_table, percentile

if TYPE_CHECKING:
    from skippy_zmq.driver.transport import PipelineTransport
    from skippy_zmq.runtime.stage import StageRuntime
    from skippy_zmq.telemetry import HopTiming

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
)
"""One prompt per session; 4 sessions at most."""
SESSION_COUNTS = (1, 4)
"""Concurrent sessions measured on every setup."""
ECHO_TIMEOUT_S = 10
"""How long the bare pyzmq sender waits for each echo, and for the echo process to end."""


@attrs.frozen
class PipelineBench:
    """What `bench pipeline` was asked for."""

    model: Path
    stage_counts: tuple[int, ...]
    tokens: int = 32
    rounds: int = 3
    ready_timeout_s: float = 300.0
    bare_messages: tuple[int, int] = (200, 2000)  # bare pyzmq: at a decode step's cadence, back to back


@attrs.frozen
class PipelineResults:
    """Decode tok/s per setup and session count over the rounds; hop and bare pyzmq rows."""

    speeds: dict[tuple[int, int], list[float]]  # (stages, sessions) -> tok/s per round; 0 stages: one process
    hops: tuple[dict[str, Any], ...]
    bare: tuple[dict[str, Any], ...]

    def table(self) -> str:
        """The speeds against the single process, then the hops and bare pyzmq."""
        rows = []
        for (stages, sessions), values in self.speeds.items():
            setup = "single process" if stages == 0 else f"{stages}-stage pipeline"
            ratio = statistics.median(values) / statistics.median(self.speeds[(0, sessions)])
            rows.append((setup, str(sessions), _spread(values), f"{ratio:.2f}"))
        text = markdown_table(("setup", "sessions", "decode tok/s, median (min-max)", "vs single process"),
                              rows, "lrrr")
        hop_rows = [(f"{h['stages']}-stage", f"{h['from_stage']} → {h['to']}", cell(h["transfer_p50_us"], 0),
                     cell(h["transfer_p99_us"], 0), cell(h["bytes_per_token"], 0)) for h in self.hops]
        hop_rows += [(f"bare pyzmq, {b['gap_ms']:.0f} ms between messages", "one way", cell(b["one_way_p50_us"], 0),
                      cell(b["one_way_p99_us"], 0), str(b["payload_bytes"])) for b in self.bare]
        return text + "\n\n" + markdown_table(
            ("setup", "hop", "transfer p50 µs", "transfer p99 µs", "activation bytes per token"), hop_rows, "lrrrr")


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def single_decode(runtime: StageRuntime, prompt_ids: Sequence[Sequence[int]], tokens: int, batch: int) -> float:
    """Decode tok/s of one runtime holding every layer, `batch` sessions at once, greedy."""
    sessions = list(range(batch))
    last = []
    for sid in sessions:
        runtime.open_session(sid)
        hidden = runtime.forward(sid, 0, np.asarray(prompt_ids[sid], np.int32))
        last.append(int(np.argmax(runtime.logits(hidden[-1:])[0])))
    positions = [len(prompt_ids[sid]) for sid in sessions]

    def step() -> None:
        nonlocal last, positions
        hidden = runtime.forward_batch(sessions, positions, np.asarray(last, np.int32))
        last = [int(i) for i in np.argmax(runtime.logits(hidden), axis=1)]
        positions = [p + 1 for p in positions]

    try:
        for _ in range(2):  # warm up, as the pipelines are warmed up
            step()
        started = time.perf_counter()
        for _ in range(tokens):
            step()
        elapsed = time.perf_counter() - started
    finally:
        for sid in sessions:
            runtime.close_session(sid)
    return batch * tokens / elapsed


def start_pipeline(stack: contextlib.ExitStack, model: Path, n_layer: int, n_stages: int, workdir: Path,
                   ready_timeout_s: float) -> PipelineTransport:
    """An n-stage local pipeline and a driver for it, warmed up; both end with `stack`."""
    from skippy_zmq.driver.generation import GenerationRequest
    from skippy_zmq.driver.transport import PipelineTransport
    from skippy_zmq.launch.planner import balanced_ranges
    from skippy_zmq.launch.processes import LocalPipeline
    from skippy_zmq.launch.topology import free_tcp_ports, topology_toml
    from skippy_zmq.tokens.sampling import SamplingParams
    from skippy_zmq.tokens.tokenizer import Tokenizer

    path = workdir / f"bench-{n_stages}.toml"
    path.write_text(topology_toml(model=str(model), ranges=balanced_ranges(n_layer, n_stages),
                                  topology_id=f"bench-{n_stages}", ports=free_tcp_ports(n_stages + 1),
                                  lane_count=8, ctx_size=512, n_layer=n_layer))
    pipeline = LocalPipeline(path)
    pipeline.start(ready_timeout_s)
    stack.callback(pipeline.stop)
    client = stack.enter_context(PipelineTransport(pipeline.topology, Tokenizer.from_gguf(model)))
    client.wait_ready(ready_timeout_s)
    client.generate([GenerationRequest(prompt=PROMPTS[0], max_tokens=4, sampling=SamplingParams(ignore_eos=True))])
    return client


def pipeline_decode(client: PipelineTransport, tokens: int, sessions: int) -> tuple[float, list[HopTiming]]:
    """Decode tok/s of `sessions` concurrent greedy sessions, and their decode messages' hop timings."""
    from skippy_zmq.driver.generation import GenerationRequest
    from skippy_zmq.errors import BenchError
    from skippy_zmq.tokens.sampling import SamplingParams

    greedy = SamplingParams(ignore_eos=True)
    results = client.generate([GenerationRequest(prompt=p, max_tokens=tokens + 1, sampling=greedy)
                               for p in PROMPTS[:sessions]])
    errors = [r.error for r in results if r.error]
    if errors:
        raise BenchError(f"a {client.topology.n_stages}-stage pipeline failed a generation: {errors[0]}")
    # Decode steps only: from the last session's first token (the prefill's) to the end.
    first_token_done = max(r.first_token_s for r in results)
    finished = max(r.finished_s for r in results)
    decode_tokens = sum(len(r.tokens) - 1 for r in results)
    n_stages = client.topology.n_stages
    hops = [h for r in results for h in r.hops[n_stages:]]  # the first reply's trace is the prefill's
    return decode_tokens / (finished - first_token_done), hops


def _echo(endpoint_in: str, endpoint_out: str, count: int) -> None:
    """Answer each message with the wall-clock time it arrived (the sender's clock: one host)."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.bind(endpoint_in)
    push = context.socket(zmq.PUSH)
    push.connect(endpoint_out)
    try:
        for _ in range(count):
            if not pull.poll(ECHO_TIMEOUT_S * 1000):  # wait as a worker does: poll, then receive
                return
            pull.recv_multipart(copy=False)
            push.send(time.time_ns().to_bytes(8, "little"))
    finally:
        pull.close(linger=0)
        push.close(linger=1000)
        context.term()


def bare_zmq(payload_bytes: int, gap_s: float, count: int) -> dict[str, Any]:
    """One-way time of a header + payload multipart message over tcp loopback to a polling receiver in
    another process, `gap_s` idle between messages (a decode step's cadence)."""
    from skippy_zmq.errors import BenchError
    from skippy_zmq.launch.topology import free_tcp_ports
    from skippy_zmq.wire.messages import HEADER_BYTES
    from skippy_zmq.wire.trace import TRACE_BYTES

    ports = free_tcp_ports(2)
    there, back = f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"
    warmup = 20
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(back)
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    process = multiprocessing.get_context("spawn").Process(target=_echo, args=(there, back, count + warmup))
    process.start()
    header, payload = bytes(HEADER_BYTES + TRACE_BYTES), np.zeros(payload_bytes // 4, np.float32)
    samples = []
    try:
        push.connect(there)
        for index in range(count + warmup):
            time.sleep(gap_s)
            sent = time.time_ns()
            push.send_multipart([header, b"", b"\0\0\0\0", b"", bytes(60), payload], copy=False)
            if not pull.poll(ECHO_TIMEOUT_S * 1000):
                raise BenchError(f"the bare pyzmq echo process did not answer within {ECHO_TIMEOUT_S:g} s")
            arrived = int.from_bytes(pull.recv(), "little")
            if index >= warmup:
                samples.append((arrived - sent) / 1000)
    finally:
        process.join(ECHO_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(ECHO_TIMEOUT_S)
        push.close()
        pull.close()
        context.term()
    return {"payload_bytes": payload_bytes, "gap_ms": gap_s * 1000, "one_way_p50_us": percentile(samples, 0.5),
            "one_way_p99_us": percentile(samples, 0.99)}


def _hop_rows(hops: dict[int, list[HopTiming]]) -> list[dict[str, Any]]:
    """Per pipeline and hop: transfer p50/p99 and the mean bytes a decode message carried."""
    rows = []
    for n, timings in hops.items():
        for index in sorted({h.stage_index for h in timings}):
            mine = [h for h in timings if h.stage_index == index]
            values = [float(h.transfer_us) for h in mine]
            rows.append({"row": "hop", "stages": n, "from_stage": index,
                         "to": "driver" if index == n - 1 else f"stage {index + 1}",
                         "transfer_p50_us": percentile(values, 0.5), "transfer_p99_us": percentile(values, 0.99),
                         "bytes_per_token": statistics.mean(h.bytes_out for h in mine)})
    return rows


def run_pipeline_bench(options: PipelineBench, report: Report, progress: Callable[[str], None]) -> PipelineResults:
    """Start every pipeline, run the rounds, then bare pyzmq; stop the pipelines; report every row."""
    from skippy_zmq.model.gguf_model import ModelHParams
    from skippy_zmq.runtime.stage import StageRuntime
    from skippy_zmq.tokens.tokenizer import Tokenizer

    hparams = ModelHParams.from_gguf(options.model)
    prompt_ids = [Tokenizer.from_gguf(options.model).encode(p) for p in PROMPTS]
    runtime = StageRuntime.load(options.model, 0, hparams.n_layer, ctx_size=512)
    speeds: dict[tuple[int, int], list[float]] = {}
    hops: dict[int, list[HopTiming]] = {n: [] for n in options.stage_counts}
    with tempfile.TemporaryDirectory(prefix="skippy-bench-") as workdir, contextlib.ExitStack() as stack:
        pipelines = {}
        for n in options.stage_counts:
            progress(f"starting a {n}-stage pipeline")
            pipelines[n] = start_pipeline(stack, options.model, hparams.n_layer, n, Path(workdir),
                                          options.ready_timeout_s)
        for round_index in range(1, options.rounds + 1):
            progress(f"round {round_index}/{options.rounds}: {options.tokens} decode steps on every setup")
            for sessions in SESSION_COUNTS:
                speeds.setdefault((0, sessions), []).append(
                    single_decode(runtime, prompt_ids, options.tokens, sessions))
            for n, client in pipelines.items():
                for sessions in SESSION_COUNTS:
                    tok_s, round_hops = pipeline_decode(client, options.tokens, sessions)
                    speeds.setdefault((n, sessions), []).append(tok_s)
                    if sessions == 1:
                        hops[n] += round_hops
    step_s = 1.0 / statistics.median(speeds[(options.stage_counts[-1], 1)])
    progress("bare pyzmq at a decode step's cadence, then back to back")
    paced, back_to_back = options.bare_messages
    bare = [bare_zmq(hparams.n_embd * 4, gap_s=step_s, count=paced),
            bare_zmq(hparams.n_embd * 4, gap_s=0.0, count=back_to_back)]
    results = PipelineResults(speeds, tuple(_hop_rows(hops)), tuple(bare))
    base = {"model": str(options.model), "tokens": options.tokens, "rounds": options.rounds}
    for (stages, sessions), values in speeds.items():
        report.add({"row": "speed", **base, "stages": stages, "sessions": sessions,
                    "tok_s": [round(v, 2) for v in values], "median_tok_s": round(statistics.median(values), 2)})
    for row in (*results.hops, *({"row": "bare_zmq", **b} for b in results.bare)):
        report.add({**base, **row})
    return results
