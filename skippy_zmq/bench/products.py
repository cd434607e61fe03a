"""`bench products`: the package's Q4_K, Q6_K and Q8_0 products against ggml's own, the products alone.

For each shape (K x N: K inputs, N outputs; the defaults are an 8B model's attention, up and down
matrices) a random matrix of the type is quantized by ggml (and repacked, for Q4_K, as the CPU backend
repacks a model's), in enough copies with other bytes to pass COPY_BYTES, so the weights come from
memory as in a model's step and not from the last level of cache. Each row count is one graph of random
float32 rows through all the copies, built with the product's route variable set to `ggml` and to the
package's route in turn; the two graphs are computed (the products alone: no copies in or out) in
alternation, the order swapped every round, and both outputs must be equal bit for bit. A round keeps the
median of as many computations as fill ROUND_SECONDS; a row reports the median of the rounds, per copy.
Row counts the package's product does not take run ggml's under either route (docs/BENCHMARKS.md,
"Kernels").
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from skippy_zmq.bench.report import Report, markdown_table
from skippy_zmq.compute import ggml, products, q4k, q6k, q80
from skippy_zmq.errors import BenchError
from skippy_zmq.model.gguf_model import BlockMatrix

COPY_BYTES = 64 << 20
"""At least this many bytes of weights per shape: more than the last level of cache."""
ROUND_SECONDS = 0.25
"""One round computes a graph as many times as fill this many seconds (at least 3)."""


@attrs.frozen
class Product:
    """One of the package's products as this bench drives it: its route variable and loader, and the
    layout ggml keeps its matrices in."""

    compiled: products.Compiled
    block_bytes: int  # bytes of one block
    repack: bool  # ggml's CPU backend repacks the type (the package's product reads that layout)
    block_values: int = 256  # values of one block (the K-quants': 256)


PRODUCTS: Mapping[str, Product] = {
    "Q4_K": Product(q4k.PRODUCT, block_bytes=144, repack=True),
    "Q6_K": Product(q6k.PRODUCT, block_bytes=210, repack=False),
    "Q8_0": Product(q80.PRODUCT, block_bytes=34, repack=False, block_values=32),
}
"""The products `bench products --type` measures, by ggml type."""


@attrs.frozen
class ProductRow:
    """One shape, thread count and row count: ggml's and the package's milliseconds per product."""

    type_name: str
    variant: str
    k: int
    n: int
    threads: int
    rows: int
    ggml_ms: float
    ours_ms: float

    @property
    def ratio(self) -> float:
        """The package's time over ggml's."""
        return self.ours_ms / self.ggml_ms

    def as_json(self) -> dict[str, Any]:
        """The row's figures."""
        return {"type": self.type_name, "variant": self.variant, "k": self.k, "n": self.n, "threads": self.threads,
                "rows": self.rows, "ggml_ms": round(self.ggml_ms, 4), "ours_ms": round(self.ours_ms, 4),
                "ratio": round(self.ratio, 4)}


@contextlib.contextmanager
def _route(env: str, value: str) -> Iterator[None]:
    """$env = value while graphs are built (ggml.mul_mat reads the route when it puts a product in a graph)."""
    before = os.environ.get(env)
    os.environ[env] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[env]
        else:
            os.environ[env] = before


def _median_ms(compute: Callable[[], None]) -> float:
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < ROUND_SECONDS:
        t0 = time.perf_counter()
        compute()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _matrices(type_name: str, k: int, n: int, product: Product, rng: np.random.Generator) -> list[BlockMatrix]:
    """Copies of one random matrix, each with its blocks' codes rolled (other bytes, the same work), together
    at least COPY_BYTES."""
    block_bytes = product.block_bytes
    copies = max(1, -(-COPY_BYTES // (n * k // product.block_values * block_bytes)))
    base = ggml.quantize(type_name, rng.standard_normal((n, k)).astype(np.float32)).reshape(-1, block_bytes)
    matrices = []
    for i in range(copies):
        data = base.copy()
        data[:, :-4] = np.roll(data[:, :-4], i, axis=0)  # every field still some block's own bytes
        matrices.append(BlockMatrix(f"w{i}", type_name, k, n, data.reshape(-1)))
    return matrices


def run_products_bench(type_name: str, variant: str, shapes: Sequence[tuple[int, int]], rows: Sequence[int],
                       threads: Sequence[int], rounds: int, report: Report,
                       progress: Callable[[str], None], seed: int = 20261205) -> list[ProductRow]:
    """Every (shape, threads, rows) row; one report row each. BenchError where the package's product cannot
    run here or its products differ from ggml's."""
    product = PRODUCTS[type_name]
    choices = [route for route in product.compiled.routes if route != "ggml"]
    if variant not in choices:
        raise BenchError(f"--variant {variant!r}: the {type_name} product's routes against ggml's are {choices}")
    for k, _n in shapes:
        if k % product.block_values:
            raise BenchError(f"--shapes: a {type_name} matrix's K (inputs) must be a multiple of "
                             f"{product.block_values}, its block; got {k}")
    native = product.compiled.load(variant)
    if isinstance(native, str):
        raise BenchError(f"the package's {type_name} product cannot run here: {native}")
    rng = np.random.default_rng(seed)
    routes = ("ggml", variant)
    out: list[ProductRow] = []
    for k, n in shapes:
        matrices = _matrices(type_name, k, n, product, rng)
        for count in threads:
            graphs = {route: ggml.MatmulGraphs(matrices, count, "bench products", repack=product.repack)
                      for route in routes}
            for m in rows:
                progress(f"{type_name} {k}x{n}, {count} thread(s), {m} row(s): {rounds} rounds")
                x = rng.standard_normal((m, k)).astype(np.float32)
                computes: dict[str, Callable[[], None]] = {}
                results = {}
                for route in routes:
                    with _route(product.compiled.env, route):
                        results[route] = graphs[route](x)
                        computes[route] = graphs[route].compute_only(x)
                if not np.array_equal(results["ggml"], results[variant]):
                    raise BenchError(f"{type_name} {k}x{n}, {m} rows: the {native.variant} product differs from "
                                     "ggml's")
                ms: dict[str, list[float]] = {route: [] for route in routes}
                for round_ in range(rounds):
                    for route in routes if round_ % 2 == 0 else routes[::-1]:
                        ms[route].append(_median_ms(computes[route]) / len(matrices))
                row = ProductRow(type_name, native.variant, k, n, count, m,
                                 statistics.median(ms["ggml"]), statistics.median(ms[variant]))
                out.append(row)
                report.add({"rounds": rounds, **row.as_json()})
            del graphs
    return out


def products_table(rows: Sequence[ProductRow]) -> str:
    """Shapes, threads and row counts with ggml's and the package's ms per product, and their ratio."""
    return markdown_table(("type", "K x N", "threads", "rows", "ggml's ms", "package's ms", "ratio"), [
        (r.type_name, f"{r.k} x {r.n}", str(r.threads), str(r.rows), f"{r.ggml_ms:.3f}",
         f"{r.ours_ms:.3f} ({r.variant})", f"{r.ratio:.2f}") for r in rows
    ], "llrrrrr")
