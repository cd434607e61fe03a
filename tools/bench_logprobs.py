"""Benchmark: what logprobs cost, side by side in one run (docs/BENCHMARKS.md, "Logprobs").

One local pipeline of the real model, `--sessions` concurrent greedy sessions decoding
`--tokens` steps, in interleaved rounds: without logprobs, with the token's logprob only
(`logprobs 0`), and with `--top` alternatives. Prints decode tok/s per mode (median and
spread) and each mode's ratio to the plain run of the same round; then the final stage's CPU
time per generated token (user + system, from /proc) and each mode's ratio of it to plain (on
this project's 2-core host it proved hardly steadier than throughput; tools/bench_logprobs_pass.py
measures the cost in one process).

    python3 tools/bench_logprobs.py [--model PATH] [--stages 2] [--sessions 16] [--tokens 32] [--top 5]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import platform
import statistics
import tempfile
from pathlib import Path

import attrs

from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.launch.planner import balanced_ranges
from skippy_zmq.launch.processes import LocalPipeline
from skippy_zmq.launch.topology import free_tcp_ports, topology_toml
from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS, resolve_model
from skippy_zmq.model.gguf_model import ModelHParams
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer

GREEDY = SamplingParams(ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decode_speed(client: PipelineTransport, sessions: int, tokens: int, logprobs: int | None) -> float:
    """Decode tok/s of `sessions` concurrent sessions (from the last first token to the end)."""
    requests = [attrs.evolve(GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=tokens + 1,
                                               sampling=GREEDY), logprobs=logprobs) for i in range(sessions)]
    results = client.generate(requests)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(errors[0])
    if logprobs is not None and any(len(r.logprobs) != len(r.tokens) for r in results):
        raise RuntimeError("a session came back without a logprob per token")
    first = max(r.first_token_s for r in results)
    finished = max(r.finished_s for r in results)
    return sum(len(r.tokens) - 1 for r in results) / (finished - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=GEMMA3_270M_ALIAS)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per session")
    parser.add_argument("--top", type=int, default=5, help="alternatives of the 'top' mode")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = resolve_model(args.model)
    n_layer = ModelHParams.from_gguf(model).n_layer
    modes: dict[str, int | None] = {"plain": None, "logprob": 0, f"top {args.top}": args.top}
    speeds: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu_ms: dict[str, list[float]] = {mode: [] for mode in modes}  # the final stage's, per token
    with tempfile.TemporaryDirectory() as workdir, contextlib.ExitStack() as stack:
        path = Path(workdir) / "bench.toml"
        path.write_text(topology_toml(model=str(model), ranges=balanced_ranges(n_layer, args.stages),
                                      topology_id="bench-logprobs", ports=free_tcp_ports(args.stages + 1),
                                      lane_count=args.sessions, ctx_size=512, n_layer=n_layer))
        pipeline = stack.enter_context(LocalPipeline(path))
        client = stack.enter_context(PipelineTransport(pipeline.topology, Tokenizer.from_gguf(model)))
        client.wait_ready(300)
        decode_speed(client, args.sessions, 4, None)  # warm up: every batch shape's graphs
        for _ in range(args.rounds):
            for mode, logprobs in modes.items():
                final_pid = pipeline.processes[-1].process.pid
                before = cpu_seconds(final_pid)
                speeds[mode].append(decode_speed(client, args.sessions, args.tokens, logprobs))
                cpu_ms[mode].append((cpu_seconds(final_pid) - before) * 1e3 / (args.sessions * (args.tokens + 1)))
    print(f"model {model.name}, {args.stages} stages, {args.sessions} sessions x {args.tokens} decode steps, "
          f"{args.rounds} interleaved rounds; {multiprocessing.cpu_count()} cpus, python {platform.python_version()}, "
          f"load {os.getloadavg()[0]:.2f}")
    for mode, values in speeds.items():
        ratios = [v / p for v, p in zip(values, speeds["plain"], strict=True)]
        print(f"  {mode:>8}: {statistics.median(values):7.1f} tok/s ({min(values):.1f}-{max(values):.1f}); "
              f"vs plain {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    print("final stage CPU per token (prompt included):")
    for mode, values in cpu_ms.items():
        ratios = [v / p for v, p in zip(values, cpu_ms["plain"], strict=True)]
        print(f"  {mode:>8}: {statistics.median(values):6.2f} ms ({min(values):.2f}-{max(values):.2f}); "
              f"vs plain {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
