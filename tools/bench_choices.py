"""Benchmark: n choices of one prompt (one prefill, the KV forked) against n separate requests of
the same prompt (n prefills), side by side in one run (docs/BENCHMARKS.md, "Choices").

    python3 tools/bench_choices.py [--model PATH] [--stages 2] [--n 4] [--prompt-tokens 400] [--tokens 16]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.launch.planner import balanced_ranges
from skippy_zmq.launch.processes import LocalPipeline
from skippy_zmq.launch.topology import free_tcp_ports, topology_toml
from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS, resolve_model
from skippy_zmq.model.gguf_model import ModelHParams
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer

TEXT = ("The history of the city begins with a small settlement on the river, where traders met to exchange "
        "grain, salt and cloth. Over the centuries the market grew into a town, the town into a city. ")


def timed(client: PipelineTransport, requests: list[GenerationRequest]) -> tuple[float, float]:
    """(seconds to the last first token, seconds to the end) of `requests` run together."""
    started = time.monotonic()
    results = client.generate(requests)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(errors[0])
    return max(r.first_token_s for r in results) - started, max(r.finished_s for r in results) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=GEMMA3_270M_ALIAS)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = resolve_model(args.model)
    tokenizer = Tokenizer.from_gguf(model)
    ids = tuple(tokenizer.encode(TEXT * (args.prompt_tokens // 30 + 1))[: args.prompt_tokens])
    sampling = SamplingParams(temperature=1.0, seed=3, ignore_eos=True)
    one = GenerationRequest(prompt="", prompt_ids=ids, max_tokens=args.tokens, sampling=sampling, n=args.n)
    apart = [GenerationRequest(prompt="", prompt_ids=ids, max_tokens=args.tokens, sampling=sampling)
             for _ in range(args.n)]
    n_layer = ModelHParams.from_gguf(model).n_layer
    rows: dict[str, list[tuple[float, float]]] = {"n choices": [], "n requests": []}
    with tempfile.TemporaryDirectory() as workdir, contextlib.ExitStack() as stack:
        path = Path(workdir) / "bench.toml"
        path.write_text(topology_toml(model=str(model), ranges=balanced_ranges(n_layer, args.stages),
                                      topology_id="bench-choices", ports=free_tcp_ports(args.stages + 1),
                                      lane_count=max(args.n, 4), ctx_size=args.prompt_tokens + args.tokens + 8,
                                      n_layer=n_layer))
        pipeline = stack.enter_context(LocalPipeline(path))
        client = stack.enter_context(PipelineTransport(pipeline.topology, tokenizer))
        client.wait_ready(300)
        timed(client, [GenerationRequest(prompt="", prompt_ids=ids[:32], max_tokens=2, sampling=sampling)])  # warm
        for _ in range(args.rounds):
            rows["n choices"].append(timed(client, [one]))
            rows["n requests"].append(timed(client, apart))
    print(f"model {model.name}, {args.stages} stages, n {args.n}, prompt {len(ids)} tokens, {args.tokens} tokens "
          f"each, {args.rounds} interleaved rounds; {multiprocessing.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}")
    for name, values in rows.items():
        first = [v[0] for v in values]
        end = [v[1] for v in values]
        print(f"  {name:>10}: last first token {statistics.median(first):.2f} s ({min(first):.2f}-{max(first):.2f}), "
              f"all done {statistics.median(end):.2f} s ({min(end):.2f}-{max(end):.2f})")


if __name__ == "__main__":
    main()
