"""Benchmark: single-process runtime vs 1-, 2- and 3-stage pipelines on tcp loopback.

Measures, in one run: decode tok/s for 1 session and 4 concurrent sessions, per-hop transport
time of decode messages (p50/p99 µs, from the trace records), activation bytes per token per
hop, and bare pyzmq PUSH/PULL with the same payload sizes for comparison.

    python3 tools/bench_pipeline.py [--model PATH] [--tokens 32] [--stages 1 2 3]
"""

from __future__ import annotations

import os

# The same BLAS thread count in this process (the single-process baseline) as in the workers
# (one each, see skippy-zmq worker --threads); set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import contextlib
import json
import multiprocessing
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.launch.planner import balanced_ranges
from skippy_zmq.launch.processes import LocalPipeline
from skippy_zmq.launch.topology import free_tcp_ports, topology_toml
from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS, resolve_model
from skippy_zmq.model.gguf_model import ModelHParams
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer
from skippy_zmq.wire.messages import HEADER_BYTES
from skippy_zmq.wire.trace import TRACE_BYTES

GREEDY = SamplingParams(ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def single_decode(runtime: StageRuntime, prompt_ids: list[list[int]], tokens: int, batch: int) -> float:
    """Decode tok/s of one in-process runtime holding every layer, `batch` sessions at once."""
    sessions = list(range(batch))
    last = []
    for sid in sessions:
        runtime.open_session(sid)
        hidden = runtime.forward(sid, 0, np.asarray(prompt_ids[sid], np.int32))
        last.append(int(np.argmax(runtime.logits(hidden[-1:])[0])))
    positions = [len(prompt_ids[sid]) for sid in sessions]
    for _ in range(2):  # warm up, as the pipelines are warmed up
        hidden = runtime.forward_batch(sessions, positions, np.asarray(last, np.int32))
        last = [int(i) for i in np.argmax(runtime.logits(hidden), axis=1)]
        positions = [p + 1 for p in positions]
    started = time.perf_counter()
    for _ in range(tokens):
        if batch == 1:
            hidden = runtime.forward(0, positions[0], np.asarray(last, np.int32))
        else:
            hidden = runtime.forward_batch(sessions, positions, np.asarray(last, np.int32))
        last = [int(i) for i in np.argmax(runtime.logits(hidden), axis=1)]
        positions = [p + 1 for p in positions]
    elapsed = time.perf_counter() - started
    for sid in sessions:
        runtime.close_session(sid)
    return batch * tokens / elapsed


def start_pipeline(
    stack: contextlib.ExitStack, model: Path, n_layer: int, n_stages: int, workdir: Path
) -> PipelineTransport:
    """Start an n-stage local pipeline and a driver for it; both end with `stack`."""
    path = workdir / f"bench-{n_stages}.toml"
    path.write_text(
        topology_toml(
            model=str(model),
            ranges=balanced_ranges(n_layer, n_stages),
            topology_id=f"bench-{n_stages}",
            ports=free_tcp_ports(n_stages + 1),
            lane_count=8,
            ctx_size=512,
            n_layer=n_layer,
        )
    )
    pipeline = stack.enter_context(LocalPipeline(path))
    client = stack.enter_context(PipelineTransport(pipeline.topology, Tokenizer.from_gguf(model), prefill_chunk=256))
    client.wait_ready(120)
    client.generate([GenerationRequest(prompt=PROMPTS[0], max_tokens=4, sampling=GREEDY)])  # warm up
    return client


def pipeline_decode(client: PipelineTransport, tokens: int, sessions: int) -> tuple[float, list[Any]]:
    """Decode tok/s of `sessions` concurrent sessions, and the decode messages' hop timings."""
    requests = [GenerationRequest(prompt=p, max_tokens=tokens + 1, sampling=GREEDY) for p in PROMPTS[:sessions]]
    results = client.generate(requests)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(errors[0])
    # Decode steps only: from the last session's first token (the prefill's) to the end.
    first_token_done = max(r.first_token_s for r in results)
    finished = max(r.finished_s for r in results)
    decode_tokens = sum(len(r.tokens) - 1 for r in results)
    n_stages = client.topology.n_stages
    hops = [h for r in results for h in r.hops[n_stages:]]  # the first reply's trace is the prefill's
    return decode_tokens / (finished - first_token_done), hops


def _echo(endpoint_in: str, endpoint_out: str, count: int) -> None:
    # Answers each message with the wall-clock time it arrived (same clock as the sender).
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.bind(endpoint_in)
    push = context.socket(zmq.PUSH)
    push.connect(endpoint_out)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    for _ in range(count):
        poller.poll(10_000)  # wait like a worker does: poll, then receive
        pull.recv_multipart(copy=False)
        arrived = time.time_ns()
        push.send(arrived.to_bytes(8, "little"))
    pull.close(linger=0)
    push.close(linger=1000)
    context.term()


def bench_bare_zmq(payload_bytes: int, gap_s: float, count: int) -> dict[str, float]:
    """One-way time of a header + payload multipart message over tcp loopback, sender to a
    polling receiver in another process, with `gap_s` idle between messages (a decode step)."""
    ports = free_tcp_ports(2)
    there, back = f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.bind(back)
    warmup = 20
    process = multiprocessing.get_context("spawn").Process(target=_echo, args=(there, back, count + warmup))
    process.start()
    push = context.socket(zmq.PUSH)
    push.connect(there)
    header = bytes(HEADER_BYTES + TRACE_BYTES)
    payload = np.zeros(payload_bytes // 4, np.float32)
    samples = []
    try:
        for index in range(count + warmup):
            time.sleep(gap_s)
            sent = time.time_ns()
            push.send_multipart([header, b"", b"\0\0\0\0", b"", bytes(60), payload], copy=False)
            if not pull.poll(10_000):
                raise RuntimeError("bare zmq echo did not answer within 10 s")
            arrived = int.from_bytes(pull.recv(), "little")
            if index >= warmup:
                samples.append((arrived - sent) / 1000)
    finally:
        process.join(10)
        push.close(linger=0)
        pull.close(linger=0)
        context.term()
    return {
        "gap_ms": gap_s * 1000,
        "one_way_p50_us": _percentile(samples, 0.5),
        "one_way_p99_us": _percentile(samples, 0.99),
    }


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _print_speeds(speeds: dict[str, list[float]], stages: list[int]) -> None:
    """The decode tok/s table, each pipeline against the single process."""
    print()
    print(
        "| setup | decode tok/s, 1 session | vs single process | decode tok/s, 4 sessions "
        "| vs single process, batch 4 |"
    )
    print("|---|---:|---:|---:|---:|")
    single1, single4 = statistics.median(speeds["single/1"]), statistics.median(speeds["single/4"])
    print(f"| single process | {_summary(speeds['single/1'])} | 1.00 | {_summary(speeds['single/4'])} | 1.00 |")
    for n in stages:
        one, four = speeds[f"{n}/1"], speeds[f"{n}/4"]
        print(
            f"| {n}-stage pipeline | {_summary(one)} | {statistics.median(one) / single1:.2f} | "
            f"{_summary(four)} | {statistics.median(four) / single4:.2f} |"
        )


def _print_hops(
    hops: dict[int, list[Any]], stages: list[int], bare: list[dict[str, float]], *, payload_bytes: int
) -> dict[str, Any]:
    """The per-hop transfer table, bare pyzmq last; the rows by "stages/index" for --json."""
    print()
    print("| setup | hop (from stage) | transfer p50 µs | transfer p99 µs | activation bytes per token |")
    print("|---|---:|---:|---:|---:|")
    hop_rows: dict[str, Any] = {}
    for n in stages:
        for index in sorted({h.stage_index for h in hops[n]}):
            values = [h.transfer_us for h in hops[n] if h.stage_index == index]
            size = statistics.mean(h.bytes_out for h in hops[n] if h.stage_index == index)
            target = "driver" if index == n - 1 else f"stage {index + 1}"
            p50, p99 = _percentile(values, 0.5), _percentile(values, 0.99)
            hop_rows[f"{n}/{index}"] = {"p50_us": p50, "p99_us": p99, "bytes": size}
            print(f"| {n}-stage | {index} → {target} | {p50:.0f} | {p99:.0f} | {size:.0f} |")
    for row in bare:
        print(
            f"| bare pyzmq PUSH/PULL, {payload_bytes} B payload, {row['gap_ms']:.0f} ms between messages "
            f"| one way | {row['one_way_p50_us']:.0f} | {row['one_way_p99_us']:.0f} | {payload_bytes} |"
        )
    return hop_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=GEMMA3_270M_ALIAS)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per session")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every measurement")
    parser.add_argument("--json", dest="json_path", help="also write the results here")
    args = parser.parse_args()
    model = resolve_model(args.model)
    hparams = ModelHParams.from_gguf(model)
    tokenizer = Tokenizer.from_gguf(model)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    machine = {"cpus": multiprocessing.cpu_count(), "python": platform.python_version(),
               "blas_threads": os.environ["OPENBLAS_NUM_THREADS"], "numpy": np.__version__,
               "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "load_avg_start": os.getloadavg()}
    runtime = StageRuntime.load(model, 0, hparams.n_layer, ctx_size=512)
    speeds: dict[str, list[float]] = {}
    hops: dict[int, list[Any]] = {n: [] for n in args.stages}
    with tempfile.TemporaryDirectory() as workdir, contextlib.ExitStack() as stack:
        clients = {n: start_pipeline(stack, model, hparams.n_layer, n, Path(workdir)) for n in args.stages}
        # Every round measures everything once, so each ratio compares figures taken minutes
        # apart at most, and the spread over rounds shows the machine's noise.
        for _ in range(args.rounds):
            for batch in (1, 4):
                speeds.setdefault(f"single/{batch}", []).append(single_decode(runtime, prompt_ids, args.tokens, batch))
            for n, client in clients.items():
                for sessions in (1, 4):
                    tok_s, round_hops = pipeline_decode(client, args.tokens, sessions)
                    speeds.setdefault(f"{n}/{sessions}", []).append(tok_s)
                    if sessions == 1:
                        hops[n].extend(round_hops)
        step_s = 1.0 / statistics.median(speeds[f"{args.stages[-1]}/1"])
        # Bare pyzmq at the same cadence as a 1-session decode (the receiver idles between
        # messages, as a stage does) and back to back.
        bare = [
            bench_bare_zmq(hparams.n_embd * 4, gap_s=step_s, count=200),
            bench_bare_zmq(hparams.n_embd * 4, gap_s=0.0, count=2000),
        ]
    machine["load_avg_end"] = os.getloadavg()

    print(f"model {model.name}, {args.tokens} decode steps, {args.rounds} interleaved rounds; median (min-max)")
    print(f"machine {machine}")
    _print_speeds(speeds, args.stages)
    hop_rows = _print_hops(hops, args.stages, bare, payload_bytes=hparams.n_embd * 4)
    if args.json_path:
        record = {"machine": machine, "speeds": speeds, "hops": hop_rows, "bare_zmq": bare}
        Path(args.json_path).write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
