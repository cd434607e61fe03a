"""The package's own Q8_0 product (native/q80.c, built as `skippy_zmq.compute._q80`), a ggml custom op that
sums four weight rows side by side, each block read once for up to eight activation rows, with ggml's bits
for every pair (docs/ARCHITECTURE.md, "The Q8_0 product").

This module holds its variants and its route (compute/products.py loads the library and picks the
variant); compute/ggml.py puts the op in graphs (`ggml.mul_mat`) and checks it against ggml's own
product once per process before it does.
"""

from __future__ import annotations

from skippy_zmq.compute.products import Compiled, Native, Variant

Q80_ENV = "SKIPPY_ZMQ_Q80"
"""Who multiplies Q8_0 matrices with the ggml kernel: `auto` (the default: the package's product in the
best variant this CPU runs, where it is built), `ggml` (ggml's own), or one variant by name (refused where
this CPU cannot run it)."""

VARIANTS: dict[str, Variant] = {
    # every row count: each pair is summed as ggml sums it, so which product runs is a matter of speed only;
    # a single row of 2,048 and 4,096 inputs took 1.01-1.48x ggml's time (its one chain of adds a row is long
    # enough there), of 640 and 1,024 inputs 0.38-0.77x (docs/BENCHMARKS.md, "The Q8_0 product")
    "avx512vnni": Variant(1, "AVX-512 F, BW, VL, DQ and VNNI, AVX2, FMA and F16C", max_rows=1 << 30,
                          single_k_below=2048),
    "avx2": Variant(2, "AVX2, FMA and F16C", max_rows=1 << 30, single_k_below=2048),
    # slower than ggml's own on every CPU ggml has SIMD for: tests, and only when named
    "scalar": Variant(3, "nothing: portable C", max_rows=1 << 30, automatic=False),
}
"""The variants q80.c compiles, best first (`skippy_q80_best_route` names the best one a CPU runs)."""
PRODUCT = Compiled("Q8_0", Q80_ENV, "skippy_zmq.compute._q80", "skippy_q80", VARIANTS)
"""Its route ($SKIPPY_ZMQ_Q80: `PRODUCT.route()`) and libraries (`PRODUCT.load(route)`)."""
ROUTES = PRODUCT.routes
__all__ = ["PRODUCT", "Q80_ENV", "ROUTES", "VARIANTS", "Native", "Variant"]
