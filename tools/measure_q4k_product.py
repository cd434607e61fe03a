"""Time the package's Q4_K product against ggml's own over repacked blocks, kernel by kernel.

    python3 -m tools.measure_q4k_product [--variant auto] [--shapes 4096x4096,4096x14336,14336x4096]
        [--rows 1,2,3,4,5,6,7,8,16,32,64] [--threads 2,1] [--rounds 7]

For each shape (K x N: K inputs, N outputs; the defaults are an 8B model's attention, up and down
matrices) a random Q4_K matrix is quantized and repacked by ggml, in enough copies with other
bytes to pass 64 MiB, so the weights come from memory as in a model's step and not from the last
level of cache. Each row count is one `MatmulGraphs` graph of random float32 rows through all the
copies, built with $SKIPPY_ZMQ_Q4K set to `ggml` and to the variant in turn; the two graphs are
computed (the products alone: no copies in or out) in alternation, the order swapped every round;
a round keeps the median of as many computations as fill 0.25 s, and the table the median of the
rounds, per copy. Both routes' outputs must be equal bit for bit. One row is ggml's under either
route (q4k.MIN_ROWS) unless `--one-row` lets the variant take it too. Not a test: run it on a quiet
machine; other work only adds time, and alternating the routes spreads it over both.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

COPY_BYTES = 64 << 20
"""At least this many bytes of weights per shape: more than the last level of cache."""
ROUND_S = 0.25
"""Calls per round: as many as fill this many seconds."""


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _shapes(text: str) -> list[tuple[int, int]]:
    return [(int(k), int(n)) for k, _, n in (part.partition("x") for part in text.split(",") if part)]


def _median_ms(compute: Callable[[], Any]) -> float:
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < ROUND_S:
        t0 = time.perf_counter()
        compute()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    """Parse the options, measure, print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="auto", help="the package's route against ggml's (default auto)")
    parser.add_argument("--shapes", type=_shapes, default=_shapes("4096x4096,4096x14336,14336x4096"))
    parser.add_argument("--rows", type=_ints, default=_ints("1,2,3,4,5,6,7,8,16,32,64"))
    parser.add_argument("--threads", type=_ints, default=_ints("2,1"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--one-row", action="store_true", help="let the variant take single rows too")
    args = parser.parse_args()

    import numpy as np

    from skippy_zmq.compute import ggml, q4k
    from skippy_zmq.model.gguf_model import BlockMatrix

    if args.one_row:
        q4k.MIN_ROWS = 1
    product = q4k.load(args.variant)
    if isinstance(product, str):
        raise SystemExit(f"the package's Q4_K product cannot run here: {product}")
    routes = ("ggml", args.variant)
    rng = np.random.default_rng(0)
    print(f"| K x N | threads | rows | ggml's ms | {product.variant} ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, n in args.shapes:
        block_bytes = 144  # a Q4_K block of 256 values
        copies = max(1, -(-COPY_BYTES // (n * k // 256 * block_bytes)))
        base = ggml.quantize("Q4_K", rng.standard_normal((n, k)).astype(np.float32))
        matrices = []
        for i in range(copies):  # the blocks' codes rolled: other bytes, the same work
            data = base.copy().reshape(-1, block_bytes)
            data[:, 16:] = np.roll(data[:, 16:], i, axis=0)
            matrices.append(BlockMatrix(f"w{i}", "Q4_K", k, n, data.reshape(-1)))
        for threads in args.threads:
            graphs = {route: ggml.MatmulGraphs(matrices, threads, "measure_q4k_product", repack=True)
                      for route in routes}
            for rows in args.rows:
                x = rng.standard_normal((rows, k)).astype(np.float32)
                computes: dict[str, Callable[[], None]] = {}
                for route in routes:  # each route's graph for this row count is built under its own variable
                    os.environ[q4k.Q4K_ENV] = route
                    graphs[route](x)
                    computes[route] = functools.partial(graphs[route].backend.compute, graphs[route]._graph(rows).graph)
                if not np.array_equal(graphs["ggml"](x), graphs[args.variant](x)):
                    raise SystemExit(f"{k}x{n}, {rows} rows: the {product.variant} product differs from ggml's")
                ms: dict[str, list[float]] = {route: [] for route in routes}
                for round_ in range(args.rounds):
                    for route in routes if round_ % 2 == 0 else routes[::-1]:
                        ms[route].append(_median_ms(computes[route]) / copies)
                theirs, ours = (statistics.median(ms[route]) for route in routes)
                print(f"| {k} x {n} | {threads} | {rows} | {theirs:.3f} | {ours:.3f} | {ours / theirs:.2f} |",
                      flush=True)
            del graphs


if __name__ == "__main__":
    main()
