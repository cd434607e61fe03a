"""The package's own Q4_K product over ggml's repacked blocks (native/q4k.c, built as
`skippy_zmq.compute._q4k`), a ggml custom op for 2 or more activation rows (docs/ARCHITECTURE.md,
"The Q4_K product").

This module loads the compiled library and picks its variant, as compute/q6k.py does for Q6_K;
compute/ggml.py puts the op in graphs (`ggml.mul_mat`) and checks it against ggml's own product once
per process before it does.
"""

from __future__ import annotations

from skippy_zmq.compute.products import Compiled, Native, Variant

Q4K_ENV = "SKIPPY_ZMQ_Q4K"
"""Who multiplies repacked Q4_K matrices with 2 or more rows: `auto` (the default: the package's product where
it is built and this CPU runs it), `ggml` (ggml's own), or the variant by name (refused where it cannot run)."""
MIN_ROWS = 2
"""One row stays ggml's: its one-row kernel already reads the weights at the memory's speed."""
ROW_BY_ROW = 0x100
"""A flag of the op's user data (q4k.c): every activation row summed as ggml's one-row GEMV sums it, whatever
the row count (the batch-invariant mode, docs/ARCHITECTURE.md, "Batch-invariant mode")."""

VARIANTS: dict[str, Variant] = {
    # rows in tiles of 32 (q4k.c's ROW_TILE), faster than ggml's at every count from 2 (docs/BENCHMARKS.md,
    # "The Q4_K product"): no limit
    "avx512vnni": Variant(1, "AVX-512 F, BW, VL, DQ and VNNI", max_rows=1 << 30),
    # rows in tiles of 8 (AVX2_ROW_TILE), faster than ggml's AVX2 kernels at every count measured from 2 to 64
    # (docs/BENCHMARKS.md, "The Q4_K product", EPYC): no limit either
    "avx2": Variant(2, "AVX2, FMA and F16C", max_rows=1 << 30),
}
"""The variants q4k.c compiles, best first (`skippy_q4k_best_route` names the best one this CPU runs, or none)."""
PRODUCT = Compiled("Q4_K", Q4K_ENV, "skippy_zmq.compute._q4k", "skippy_q4k", VARIANTS)
"""Its route ($SKIPPY_ZMQ_Q4K: `PRODUCT.route()`) and libraries (`PRODUCT.load(route)`)."""
ROUTES = PRODUCT.routes
__all__ = ["MIN_ROWS", "PRODUCT", "Q4K_ENV", "ROUTES", "ROW_BY_ROW", "VARIANTS", "Native", "Variant"]
