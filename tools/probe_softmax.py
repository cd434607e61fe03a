"""Per-row cost of a logprobs normalizer: ggml's softmax against numpy's exp-sum (docs/BENCHMARKS.md,
"Logprobs").

    python3 tools/probe_softmax.py [--vocab 262144] [--rows 1 16] [--threads 2] [--model PATH]

Times, per row of `--vocab` float32 logits: ggml's `ggml_soft_max_ext` in a graph of R rows on the
CPU backend (what a normalizer inside the head's graph would cost), numpy's exp then pairwise sum
into a kept scratch row, each available `exp_sum` kernel, and `LogSoftmax.of` with 0, 5 and 20
alternatives on each, and a greedy sampler's pick (what a row costs without logprobs). The numpy
figures take 50 different rows in turn, so each comes from memory as the head's output does;
ggml's rows are its graph's input. The rows are Gaussian (std 5) unless `--model` names a GGUF:
then they are that model's logits at 50 positions of tools/data/quality_text.md, whose few
large values are what the alternatives' search meets in serving. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np


def _model_rows(model: str, threads: int) -> np.ndarray:
    """(50, n_vocab) logits of `model` at 50 positions of the committed quality text."""
    from skippy_zmq.model.gguf_model import ModelHParams
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime
    from skippy_zmq.tokens.tokenizer import Tokenizer

    text = (Path(__file__).parent / "data" / "quality_text.md").read_text()
    runtime = StageRuntime.load(model, 0, ModelHParams.from_gguf(model).n_layer, ctx_size=256,
                                kernel=Kernel("ggml", threads=threads), weight_cache=None)
    ids = np.array(Tokenizer.from_gguf(model).encode(text)[:50], np.int32)
    runtime.open_session(0)
    return np.ascontiguousarray(runtime.logits(runtime.forward(0, 0, ids)))


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="take real logits rows from this GGUF")
    args = parser.parse_args(argv)
    from skippy_zmq.compute import ggml
    from skippy_zmq.tokens import exp_sum
    from skippy_zmq.tokens.logprobs import LogSoftmax
    from skippy_zmq.tokens.sampling import Sampler, SamplingParams

    lib, backend = ggml.Library.get(), ggml.Backend.shared(args.threads)
    rng = np.random.default_rng(0)
    rows = (_model_rows(args.model, args.threads) if args.model else
            (rng.standard_normal((50, args.vocab)) * 5).astype(np.float32))  # 50 MiB at 262,144: not in cache
    args.vocab = rows.shape[1]
    result: dict[str, float] = {}
    for count in args.rows:
        graph = ggml.Graph(lib, args.vocab, count, lambda ctx, x: [lib.ggml_soft_max_ext(ctx, x, None, 1.0, 0.0)],
                           [args.vocab])
        graph.x[:] = rows[:count]
        seconds = min(timeit.repeat(lambda g=graph: backend.compute(g.graph), number=20, repeat=5)) / 20
        result[f"ggml_softmax_{count}_rows_ms_per_row"] = round(seconds * 1e3 / count, 3)
    scratch = np.empty(args.vocab, dtype=np.float32)
    turn = iter(range(10**9))

    def next_row() -> np.ndarray:
        return rows[next(turn) % len(rows)]

    def per_row(call: Callable[[], object]) -> float:
        seconds = min(timeit.repeat(call, number=50, repeat=5)) / 50
        return round(seconds * 1e3, 3)

    result["numpy_exp_then_pairwise_sum_ms"] = per_row(lambda: np.exp(next_row(), out=scratch).sum())
    for name in exp_sum.available():
        kernel = exp_sum.EXP_SUMS[name](1)  # one thread, as BENCHMARKS quotes it
        result[f"exp_sum_{name}_ms"] = per_row(lambda kernel=kernel: kernel(next_row()))
        for top in (0, 5, 20):
            result[f"logsoftmax_{name}_top{top}_ms"] = per_row(
                lambda top=top, kernel=kernel: LogSoftmax.of(next_row(), top, exp_sum=kernel))
    sampler = Sampler(SamplingParams(ignore_eos=True))
    result["greedy_pick_ms"] = per_row(lambda: sampler.sample(next_row(), (), work=scratch))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
