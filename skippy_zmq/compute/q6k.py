"""The package's own Q6_K product (native/q6k.c, built as `skippy_zmq.compute._q6k`), a ggml custom op
that unpacks each block once for all activation rows (docs/ARCHITECTURE.md, "The Q6_K product").

This module holds its variants and its route (compute/products.py loads the library and picks the
variant); compute/ggml.py puts the op in graphs (`ggml.mul_mat`) and checks it against ggml's own
product once per process before it does.
"""

from __future__ import annotations

from skippy_zmq.compute.products import Compiled, Native, Variant

Q6K_ENV = "SKIPPY_ZMQ_Q6K"
"""Who multiplies Q6_K matrices with the ggml kernel: `auto` (the default: the package's product in the
best variant this CPU runs, where it is built), `ggml` (ggml's own), or one variant by name (refused where
this CPU cannot run it)."""


VARIANTS: dict[str, Variant] = {
    # 7 rows: from 8 on ggml multiplies Q6_K with another kernel, in another order, and a prompt's tiny
    # differences grew into other greedy tokens on the llama3-8b file (docs/BENCHMARKS.md, "The Q4_K
    # product"); below 8 the products are llama.cpp's bits
    # long matrices (an 8B model's ffn_down, 12,288-14,336 inputs) only by single rows: from 2 or 3 rows ggml's
    # takes 0.80-0.90x the time there; short ones (attention, the head) from 2 rows: ggml's dot is the faster at
    # one row there (the head: 9.3 against 12.2 ms; docs/BENCHMARKS.md, "The Q6_K product")
    "avx512": Variant(1, "AVX-512 F, BW, VL and DQ", max_rows=7, long_k=8192),
    # one row: ggml's AVX2 dot is the faster (llama3-8b, one decode step: 169-174 + 16 ms against 176 + 17
    # ms on the EPYC; docs/BENCHMARKS.md, "The Q6_K product"); from 2 rows the package's
    "avx2": Variant(2, "AVX2, FMA and F16C", max_rows=7, min_rows=2),
    # slower than ggml's own on every CPU ggml has SIMD for: tests, and only when named
    "scalar": Variant(3, "nothing: portable C", max_rows=1 << 30, automatic=False),
}
"""The variants q6k.c compiles, best first (`skippy_q6k_best_route` names the best one a CPU runs)."""
PRODUCT = Compiled("Q6_K", Q6K_ENV, "skippy_zmq.compute._q6k", "skippy_q6k", VARIANTS)
"""Its route ($SKIPPY_ZMQ_Q6K: `PRODUCT.route()`) and libraries (`PRODUCT.load(route)`)."""
ROUTES = PRODUCT.routes
__all__ = ["PRODUCT", "Q6K_ENV", "ROUTES", "VARIANTS", "Native", "Variant"]
