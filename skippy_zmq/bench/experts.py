"""`bench experts`: the package's grouped expert ops against ggml_mul_mat_id, the products alone.

One layer's experts of a type and shape (the defaults: Qwen3-30B-A3B's, 128 experts of 2048 x 768, 8 used a
row) are random blocks quantized by ggml (and repacked, for Q4_K, as a stage holds them). Each pass row count
is one graph holding both ops on the same activations and ids; every computation draws new ids (each row's
experts distinct, as a router's top-k), so the experts come from memory as in a model's step, not from the
last computation's cache. The two ops are computed alternately, the order swapped every round; a round keeps
the median of as many computations as fill ROUND_SECONDS. Where `mul_mat_id` gives the row count to the
package's op, the two outputs must be equal bit for bit; elsewhere the row says which a stage runs
(docs/ARCHITECTURE.md, "The expert layer").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from skippy_zmq.bench.report import Report, markdown_table
from skippy_zmq.compute import expert_products, ggml
from skippy_zmq.errors import BenchError
from skippy_zmq.model.gguf_model import BlockMatrix

ROUND_SECONDS = 0.25
"""One round computes a graph as many times as fill this many seconds (at least 3)."""
ID_SETS = 64
"""Distinct id draws a row count cycles through, one per computation."""


@attrs.frozen
class ExpertsRow:
    """One pass row count: ggml's and the package's milliseconds per op, and which a stage runs."""

    type_name: str
    k: int
    n: int
    experts: int
    used: int
    rows: int
    ggml_ms: float
    ours_ms: float
    stage_runs: str  # "package" or "ggml"

    @property
    def ratio(self) -> float:
        """The package's time over ggml's."""
        return self.ours_ms / self.ggml_ms

    def as_json(self) -> dict[str, Any]:
        """The row's figures."""
        return {"type": self.type_name, "k": self.k, "n": self.n, "experts": self.experts, "used": self.used,
                "rows": self.rows, "ggml_ms": round(self.ggml_ms, 4), "ours_ms": round(self.ours_ms, 4),
                "ratio": round(self.ratio, 4), "stage_runs": self.stage_runs}


class _PassGraph:
    """Both ops over one layer's experts for `rows` pass rows: ggml_mul_mat_id and the package's op."""

    def __init__(self, weights: ggml.Weights, k: int, n: int, used: int, rows: int, inputs: int,
                 rng: np.random.Generator, backend: ggml.Backend) -> None:
        lib = self.lib = ggml.Library.get()
        tensor, self.backend, self.host = weights.tensors[0], backend, ggml.HostArrays(lib)
        size = lib.ggml_tensor_overhead() * 8 + lib.ggml_graph_overhead_custom(8, False)
        self.ctx = lib.ggml_init(ggml.InitParams(size, None, True))
        self.x, self.ids = self.host.empty((rows, inputs, k)), self.host.empty((rows, used), np.int32)
        self.x[:] = rng.standard_normal(self.x.shape).astype(np.float32)
        x = lib.ggml_new_tensor_3d(self.ctx, ggml.GGML_TYPES["F32"], k, inputs, rows)
        ids = lib.ggml_new_tensor_2d(self.ctx, ggml.GGML_I32, used, rows)
        self.host.place(x, self.x)
        self.host.place(ids, self.ids)
        ours = expert_products.grouped(lib, self.ctx, tensor, x, ids)
        if ours is None:
            raise BenchError(f"the package's grouped op cannot run here: {expert_products.described()}")
        self.stage_runs = "package" if expert_products.takes(lib, tensor, rows) else "ggml"
        self.graphs: dict[str, int] = {}
        self.outputs: dict[str, np.ndarray] = {}
        for name, node in (("ggml", int(lib.ggml_mul_mat_id(self.ctx, tensor, x, ids))), ("package", ours)):
            self.outputs[name] = self.host.empty((rows, used, n))
            self.host.place(node, self.outputs[name])
            self.graphs[name] = lib.ggml_new_graph_custom(self.ctx, 8, False)
            lib.ggml_build_forward_expand(self.graphs[name], node)

    def compute(self, name: str) -> None:
        """One computation of one op."""
        with self.backend.lock:
            self.backend.compute(self.graphs[name])

    def __del__(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.ggml_free(self.ctx)


def _experts(type_name: str, experts: int, k: int, n: int, rng: np.random.Generator) -> ggml.Weights:
    """One layer's experts: random values quantized by ggml, repacked where the op reads ggml's repacking."""
    op = expert_products.GROUPED[type_name]
    data = ggml.quantize(type_name, rng.standard_normal((experts * n, k)).astype(np.float32))
    matrix = BlockMatrix(name=f"<{type_name} experts>", type_name=type_name, k=k, n=n, data=data, experts=experts)
    return ggml.Weights(ggml.Library.get(), [matrix], "bench experts", repack=op.repacked)


def run_experts_bench(type_name: str, shape: tuple[int, int], experts: int, used: int, rows: Sequence[int],
                      threads: int, rounds: int, report: Report, progress: Callable[[str], None], *,
                      per_slot: bool = False, seed: int = 20261206) -> list[ExpertsRow]:
    """One row per pass row count; BenchError where the package's op cannot run here or, where a stage would
    run it, its products differ from ggml's. `per_slot`: one activation row per (row, slot), as the down
    matrices take them, where gate and up take the row's own."""
    if used > experts:
        raise BenchError(f"--used {used} is more than --experts {experts}; a row selects distinct experts")
    k, n = shape
    rng = np.random.default_rng(seed)
    progress(f"{type_name} experts: {experts} of {k} x {n}, quantizing")
    weights = _experts(type_name, experts, k, n, rng)
    backend = ggml.Backend(ggml.Library.get(), threads)
    id_sets = [np.argsort(rng.random((max(rows), experts)), axis=1)[:, :used].astype(np.int32)
               for _ in range(ID_SETS)]
    out: list[ExpertsRow] = []
    for count in rows:
        progress(f"{type_name} experts, {count} pass row(s): {rounds} rounds")
        graph = _PassGraph(weights, k, n, used, count, used if per_slot else 1, rng, backend)
        graph.ids[:] = id_sets[0][:count]
        for name in graph.graphs:
            graph.outputs[name][:] = np.nan
            graph.compute(name)
        if graph.stage_runs == "package" and not np.array_equal(graph.outputs["ggml"], graph.outputs["package"]):
            raise BenchError(f"{type_name} experts, {count} rows: the package's grouped op differs from "
                             "ggml_mul_mat_id")
        ms: dict[str, list[float]] = {"ggml": [], "package": []}
        for round_ in range(rounds):
            for name in ("ggml", "package") if round_ % 2 == 0 else ("package", "ggml"):
                ms[name].append(_median_ms(graph, name, id_sets, count))
        row = ExpertsRow(type_name, k, n, experts, used, count, statistics.median(ms["ggml"]),
                         statistics.median(ms["package"]), graph.stage_runs)
        out.append(row)
        report.add({"rounds": rounds, "threads": threads, "per_slot": per_slot, **row.as_json()})
    return out


def _median_ms(graph: _PassGraph, name: str, id_sets: Sequence[np.ndarray], rows: int) -> float:
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < ROUND_SECONDS:
        graph.ids[:] = id_sets[len(times) % len(id_sets)][:rows]
        t0 = time.perf_counter()
        graph.compute(name)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def experts_table(rows: Sequence[ExpertsRow]) -> str:
    """Pass rows with ggml's and the package's ms per op, their ratio, and which a stage runs."""
    return markdown_table(("type", "experts", "pass rows", "ggml_mul_mat_id ms", "package's ms", "ratio",
                           "a stage runs"), [
        (r.type_name, f"{r.experts} x {r.k} x {r.n}, {r.used} used", str(r.rows), f"{r.ggml_ms:.3f}",
         f"{r.ours_ms:.3f}", f"{r.ratio:.2f}", "the package's" if r.stage_runs == "package" else "ggml's")
        for r in rows
    ], "llrrrrl")
