"""Benchmark: what logprobs add to one decode pass, in one process (docs/BENCHMARKS.md, "Logprobs").

The whole model in one `StageRuntime` (what `serve --stages 1` runs), `--sessions` sessions after
a 10-token prompt each (stretches of tools/data/quality_text.md, so the logits are a real text's);
then greedy decode passes of every session's row (the blocks, the head, then each row's pick)
with the modes taking turns pass by pass: plain (a greedy sampler's pick), the token's logprob
(`LogSoftmax.of`, whose largest ids then decide the greedy pick, as `FinalOutput.pick` does) and
`--top` alternatives. Turn by turn the host's drift falls on every mode alike, which the
end-to-end `tools/bench_logprobs.py` cannot promise. Prints each mode's median pass time, its ratio to
plain, and the median cost of the picks alone.

    python3 tools/bench_logprobs_pass.py [--model PATH] [--sessions 16] [--passes 60] [--top 5] [--threads 2]
        [--exp-threads N] [--exp-sum onnxruntime|numpy] [--per-row]
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS, resolve_model
from skippy_zmq.model.gguf_model import ModelHParams
from skippy_zmq.runtime.kernels import Kernel
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.tokens import exp_sum
from skippy_zmq.tokens.logprobs import LogSoftmax, pass_sums
from skippy_zmq.tokens.sampling import Sampler, SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer


def main() -> None:
    """Run the passes and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=GEMMA3_270M_ALIAS)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--passes", type=int, default=60, help="passes per mode")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--exp-threads", type=int, default=None, help="the exp-sum's (default: --threads)")
    parser.add_argument("--exp-sum", choices=sorted(exp_sum.EXP_SUMS), default=None, help="default: the best")
    parser.add_argument("--per-row", action="store_true", help="one exp-sum run a row, not one a pass")
    args = parser.parse_args()
    model = resolve_model(args.model)
    n_layer = ModelHParams.from_gguf(model).n_layer
    runtime = StageRuntime.load(model, 0, n_layer, ctx_size=2048, kernel=Kernel("ggml", threads=args.threads),
                                weight_cache=None)
    sessions = list(range(args.sessions))
    text = Tokenizer.from_gguf(model).encode((Path(__file__).parent / "data" / "quality_text.md").read_text())
    for session in sessions:
        runtime.open_session(session)
        runtime.forward(session, 0, np.array(text[session * 10:session * 10 + 10], np.int32))
    threads = args.exp_threads or args.threads
    kernel = exp_sum.EXP_SUMS[args.exp_sum](threads) if args.exp_sum else exp_sum.best(threads)
    samplers = [Sampler(SamplingParams(ignore_eos=True)) for _ in sessions]
    work = np.empty(ModelHParams.from_gguf(model).n_vocab, np.float32)
    modes: dict[str, int | None] = {"plain": None, "logprob": 0, f"top {args.top}": args.top}
    passes: dict[str, list[float]] = {mode: [] for mode in modes}
    picks: dict[str, list[float]] = {mode: [] for mode in modes}
    tokens = np.array(text[10:10 + args.sessions], np.int32)  # each session's next token, then its picks
    position = 10
    for turn in range(args.passes * len(modes) + len(modes)):
        mode = list(modes)[turn % len(modes)]
        began = time.perf_counter()
        hidden = runtime.forward_batch(sessions, [position] * args.sessions, tokens)
        logits = runtime.logits(hidden, reuse=True)
        picked = time.perf_counter()
        # As FinalOutput.exp_sums: the pass's rows that ask for logprobs summed in one run, unless
        # --per-row (the way before that).
        sums = pass_sums(logits, sessions, kernel) if modes[mode] is not None and not args.per_row else {}
        for index, (row, sampler) in enumerate(zip(logits, samplers, strict=True)):
            known = None
            if modes[mode] is not None:  # as FinalOutput.pick: the table's largest ids decide a greedy pick
                table = LogSoftmax.of(row, max(modes[mode] or 0, sampler.greedy_depth), exp_sum=kernel,
                                      summed=sums.get(index))
                known = sampler.greedy_from_top([i for i, _ in table.top], ())
            tokens[index] = known if known is not None else sampler.sample(row, (), work=work)
        ended = time.perf_counter()
        position += 1
        if turn >= len(modes):  # the first turn of each mode builds its graphs
            passes[mode].append(ended - began)
            picks[mode].append(ended - picked)
    plain = statistics.median(passes["plain"])
    print(f"model {model.name}, {args.sessions} sessions, {args.passes} passes per mode taking turns, "
          f"{args.threads} threads, exp-sum {kernel.name} on {threads} "
          f"({'a run a row' if args.per_row else 'a run a pass'}); {multiprocessing.cpu_count()} cpus, "
          f"python {platform.python_version()}")
    for mode in modes:
        median = statistics.median(passes[mode])
        print(f"  {mode:>8}: pass {median * 1e3:6.1f} ms, vs plain {median / plain:.3f}; "
              f"picks {statistics.median(picks[mode]) * 1e3:5.2f} ms")


if __name__ == "__main__":
    main()
