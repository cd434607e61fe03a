"""The expert layer's grouped products (docs/ARCHITECTURE.md, "The expert layer"): ggml_mul_mat_id, or the
package's op in its place where it is faster with ggml's bits.

ggml_mul_mat_id groups a pass's (row, slot) pairs by the expert they selected and multiplies each pair on its
own: a Q6_K expert by ggml's dot product, in 1.6-1.9 times the time the package's Q6_K kernels take,
and a repacked Q4_K expert by ggml's one-row GEMV, which reads an expert's blocks once per pair. `mul_mat_id`
puts the package's grouped op for the type (`GROUPED`: native/q6k.c's `skippy_q6k_mul_mat_id`, native/q4k.c's
`skippy_q4k_mul_mat_id`) in a graph in its place at the pass rows where it is faster: the same pairs grouped
by expert, an expert's pairs multiplied in tiles, each pair summed as ggml sums it, so the results are
llama.cpp's bit for bit (checked once per process against ggml's own op before any graph holds it;
docs/BENCHMARKS.md, "Mixture of experts", has the figures).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

import attrs
import numpy as np

from skippy_zmq.compute import ggml, products
from skippy_zmq.model.gguf_model import BlockMatrix

_log = logging.getLogger(__name__)

SINGLE_ROWS = 0x100
"""A flag of the Q6_K op's user data (q6k.c): multiply an expert's pairs one at a time, for matrices of the
variant's `long_k` inputs or more, where ggml's multi-row order is faster than the package's tiles."""
CHECK_USED = 4
"""Experts a row selects in the check (of 6)."""


@attrs.frozen
class GroupedOp:
    """One row of GROUPED: the package's grouped op for expert matrices of one type."""

    type_name: str
    symbol: str  # the op's C function in the product's library
    product: Callable[[], products.Native | str]  # the checked product whose library holds it
    repacked: bool  # it reads ggml's repacked layout, and only that
    min_rows: int  # the fewest pass rows it takes: below, ggml's is as fast or faster
    max_rows: int  # the most pass rows it takes: from more, ggml multiplies an expert's pairs in another order
    check_shapes: tuple[tuple[int, int], ...]  # (activation rows per pass row, pass rows) checked once

    def flags(self, product: products.Native, k: int) -> int:
        """The op's user data beyond the variant's number, for experts of `k` inputs."""
        long_k = product.variants[product.variant].long_k
        return SINGLE_ROWS if self.type_name == "Q6_K" and long_k is not None and k >= long_k else 0


GROUPED = {
    # ggml multiplies an expert's Q6_K pairs with its dot product below 8 of them, with its tiled kernel from 8
    # (docs/BENCHMARKS.md, "Mixture of experts": its dot product takes 1.6-1.9 times the package's time there)
    "Q6_K": GroupedOp("Q6_K", "skippy_q6k_mul_mat_id", ggml.q6k_product, repacked=False, min_rows=1,
                      max_rows=products.GGML_SWITCH_ROWS - 1,
                      check_shapes=((1, 1), (1, 7), (CHECK_USED, 1), (CHECK_USED, 7))),
    # ggml's repacked op multiplies every pair with its one-row GEMV, at any row count; below 8 pass rows (about
    # one pair an expert) that is as fast as the package's tiles, from 8 slower (docs/BENCHMARKS.md, "Mixture of
    # experts": half the speed at 128 rows)
    "Q4_K": GroupedOp("Q4_K", "skippy_q4k_mul_mat_id", ggml.q4k_product, repacked=True, min_rows=8,
                      max_rows=1 << 30,
                      check_shapes=((1, 1), (1, 7), (CHECK_USED, 7), (CHECK_USED, 70))),
}
"""The expert types the package multiplies itself, by GGUF type name; others go to ggml_mul_mat_id."""

_lock = threading.Lock()
_checked: dict[tuple[str, str], int | str] = {}  # (type, variant) -> the op's address, or why ggml's own runs


def mul_mat_id(lib: ggml.Library, ctx: int, experts: int, x: int, ids: int) -> int:
    """`ggml_mul_mat_id(experts, x, ids)` in the graph of `ctx`, (n, used, R): the package's grouped op where
    GROUPED has one for the experts' type and layout, R is within its rows and it passed its check; ggml's
    otherwise."""
    node = grouped(lib, ctx, experts, x, ids) if takes(lib, experts, int(ggml.TensorHead.of(ids).ne[1])) else None
    return int(lib.ggml_mul_mat_id(ctx, experts, x, ids)) if node is None else node


def takes(lib: ggml.Library, experts: int, rows: int) -> bool:
    """Whether GROUPED has an op for these experts' type and layout that takes `rows` pass rows (whether it can
    run here is `grouped`'s to say)."""
    op = _op_for(lib, experts)
    return op is not None and op.min_rows <= rows <= op.max_rows


def grouped(lib: ggml.Library, ctx: int, experts: int, x: int, ids: int) -> int | None:
    """The package's grouped op for these experts at any pass rows (`bench experts` times it beside ggml's
    outside the rows `mul_mat_id` gives it), or None where GROUPED has none or it cannot run here."""
    op = _op_for(lib, experts)
    found = None if op is None else _grouped_function(op)
    if not isinstance(found, int) or op is None:
        return None
    product = op.product()
    assert isinstance(product, products.Native)
    head, chosen = ggml.TensorHead.of(experts), ggml.TensorHead.of(ids)
    args = (ctypes.c_void_p * 3)(experts, x, ids)  # ggml copies them into the new tensor's sources
    return int(lib.ggml_custom_4d(ctx, ggml.GGML_TYPES["F32"], int(head.ne[1]), int(chosen.ne[0]),
                                  int(chosen.ne[1]), 1, ctypes.cast(args, ctypes.c_void_p), 3, found, -1,
                                  product.userdata | op.flags(product, int(head.ne[0]))))


def described() -> str:
    """Who multiplies the experts of each type GROUPED names in this process, for a stage's load line."""
    parts = []
    for op in GROUPED.values():
        found = _grouped_function(op)
        rows = f"{op.min_rows} to {op.max_rows} rows" if op.max_rows < 1 << 30 else f"{op.min_rows} rows or more"
        parts.append(f"{op.type_name} experts at {rows} by the package's grouped op" if isinstance(found, int)
                     else f"{op.type_name} experts by ggml_mul_mat_id ({found})")
    return "; ".join(parts)


def _op_for(lib: ggml.Library, experts: int) -> GroupedOp | None:
    """The GROUPED row for an expert tensor of this type and layout, or None."""
    type_id = ggml.TensorHead.of(experts).type
    for op in GROUPED.values():
        if type_id == ggml.GGML_TYPES[op.type_name] and op.repacked == ggml.repacked(lib, experts):
            return op
    return None


def _grouped_function(op: GroupedOp) -> int | str:
    """The checked op's address, or why ggml_mul_mat_id runs instead."""
    product = op.product()
    if isinstance(product, str):
        return product
    if product.min_rows > 1:  # ggml's kernel is the faster at the one row most experts get (q6k.VARIANTS)
        return f"the {product.variant} {op.type_name} product takes {product.min_rows} rows or more"
    with _lock:
        key = (op.type_name, product.variant)
        if key not in _checked:
            address = ctypes.cast(getattr(product.library, op.symbol), ctypes.c_void_p).value
            assert address is not None
            why = _check(op, product, int(address))
            _checked[key] = int(address) if why is None else why
            if why is not None:
                _log.warning("%s experts multiply by ggml_mul_mat_id: %s", op.type_name, why)
        return _checked[key]


def _check_experts(op: GroupedOp, rng: np.random.Generator) -> tuple[ggml.Weights, int, int]:
    """Random experts of the op's type, as a stage holds them: (weights, n, k)."""
    lib = ggml.Library.get()
    n_experts, n, k = 6, 24, 512
    if op.type_name == "Q6_K":
        blocks = rng.integers(0, 256, (n_experts * n * k // 256, 210), dtype=np.uint8)
        blocks[:, 208:210] = np.full((1,), 2.0 ** -7, dtype=np.float16).view(np.uint8)  # d, finite
        data = blocks.reshape(-1)
    else:
        data = ggml.quantize(op.type_name, rng.standard_normal((n_experts * n, k)).astype(np.float32))
    matrix = BlockMatrix(name=f"<the grouped {op.type_name} check>", type_name=op.type_name, k=k, n=n, data=data,
                         experts=n_experts)
    return ggml.Weights(lib, [matrix], matrix.name, repack=op.repacked), n, k


def _check(op: GroupedOp, product: products.Native, function: int) -> str | None:
    """None when the op gives ggml_mul_mat_id's products of random experts bit for bit at every one of its
    check shapes, else what differs (this also checks the tensor layout the op reads against this ggml)."""
    lib = ggml.Library.get()
    rng = np.random.default_rng(0)
    if op.repacked and not lib.repacks(op.type_name, 24):
        return f"ggml repacks no {op.type_name} matrix on this CPU or build"
    weights, n, k = _check_experts(op, rng)
    tensor, used = weights.tensors[0], CHECK_USED
    backend = ggml.Backend(lib, 2)  # its own: the check runs while a stage builds a graph under the shared locks
    for inputs, rows in op.check_shapes:
        host = ggml.HostArrays(lib)
        nodes = 8
        size = lib.ggml_tensor_overhead() * nodes + lib.ggml_graph_overhead_custom(nodes, False)
        ctx = lib.ggml_init(ggml.InitParams(size, None, True))
        try:
            graph = lib.ggml_new_graph_custom(ctx, nodes, False)
            x_values, id_values = host.empty((rows, inputs, k)), host.empty((rows, used), np.int32)
            x = lib.ggml_new_tensor_3d(ctx, ggml.GGML_TYPES["F32"], k, inputs, rows)
            ids = lib.ggml_new_tensor_2d(ctx, ggml.GGML_I32, used, rows)
            host.place(x, x_values)
            host.place(ids, id_values)
            x_values[:] = rng.standard_normal(x_values.shape).astype(np.float32)
            id_values[:] = np.argsort(rng.random((rows, 6)), axis=1)[:, :used]
            theirs_tensor = lib.ggml_mul_mat_id(ctx, tensor, x, ids)
            args = (ctypes.c_void_p * 3)(tensor, x, ids)
            ours_tensor = lib.ggml_custom_4d(ctx, ggml.GGML_TYPES["F32"], n, used, rows, 1,
                                             ctypes.cast(args, ctypes.c_void_p), 3, function, -1,
                                             product.userdata | op.flags(product, k))
            theirs, ours = host.empty((rows, used, n)), host.empty((rows, used, n))
            ours[:] = np.nan  # an op that wrote nothing must not pass on what memory held before
            host.place(theirs_tensor, theirs)
            host.place(ours_tensor, ours)
            lib.ggml_build_forward_expand(graph, theirs_tensor)
            lib.ggml_build_forward_expand(graph, ours_tensor)
            with backend.lock:
                backend.compute(graph)
        finally:
            lib.ggml_free(ctx)
        if not np.array_equal(theirs, ours):
            differ = int(np.count_nonzero(theirs != ours))
            return (f"the grouped {product.variant} {op.type_name} op differs from ggml_mul_mat_id in {differ} of "
                    f"{theirs.size} outputs ({rows} rows, {inputs} inputs a row); expected its bits")
    return None
