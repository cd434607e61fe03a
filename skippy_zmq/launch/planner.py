"""Where to cut a model into pipeline stages: per-layer and head costs in, contiguous ranges out.

One planner serves `skippy-zmq plan`, the local pipelines of `generate` and `serve`, and the
shipped config files. Costs come from a table measured on the real model by
`python3 -m tools.measure_costs` (time of one decode step at a fixed batch, 1 BLAS thread), keyed by
architecture and dimensions; a model not in the table gets an estimate from its float32
weight sizes, where a layer costs its weight bytes and the output head costs the bytes of
its (n_vocab, n_embd) matrix, because a decode step is memory bound and reads every weight
once. A kernel computing from the file's blocks costs the bytes a decode step reads of the file:
all of a dense layer, but of an expert layer only its other tensors and the experts the batch's
rows pick (launch/memory.py, `ExpertBytes`), while the memory check counts every expert.

The ranges minimize the cost of the busiest stage (what bounds a pipeline whose stages work
at the same time), then the spread between stages; every stage keeps at least one layer, so
a head heavier than everything else leaves the final stage the busiest whatever the cut.
Splitting the head itself would take head shards behind the final stage (each holding a slice
of the vocabulary rows) and an exact merge of their logits for sampling; not done here.

With a memory model (launch/memory.py) and a limit per stage, only cuts whose every stage fits
its limit are considered; when none does, the error names the fastest cut's stage that does not
fit, its bytes and its limit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from skippy_zmq.errors import ConfigError
from skippy_zmq.launch.memory import MemoryModel, StageLimits, StageMemory, check_fits, format_bytes
from skippy_zmq.model.gguf_model import ModelHParams

DEFAULT_BATCH = 16
READ_UNIT = "bytes read"
"""The unit of costs that are the bytes a decode step reads where a stage holds more (an expert file's)."""


@attrs.frozen
class CostKey:
    """What a measured cost depends on: architecture and the dimensions that size its matmuls."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int

    @classmethod
    def of(cls, hp: ModelHParams) -> CostKey:
        """The key of a model's hyper-parameters."""
        return cls(arch=hp.arch, n_layer=hp.n_layer, n_embd=hp.n_embd, n_head=hp.n_head,
                   n_head_kv=hp.n_head_kv, head_dim=hp.head_dim, n_ff=hp.n_ff, n_vocab=hp.n_vocab)


@attrs.frozen
class MeasuredCosts:
    """One row of the measured table: milliseconds per decode step at `batch` sessions."""

    batch: int
    layer_ms: tuple[float, ...]  # (n_layer,); layer 0 includes the token embedding
    head_ms: float               # output norm, head matmul and sampling of `batch` rows
    command: str                 # how the row was measured


_MEASURE_COMMAND = ("python3 -m tools.measure_costs --kernel onnxruntime --batches 8 16 --steps 30 --prompt 32 "
                    "--threads 1")

# Measured by tools/measure_costs.py on the 2-core development machine (x86-64, 1 thread, the
# onnxruntime kernel of runtime/kernels.py, then the default). Regenerate with the command above
# (from the repository's root) and paste its output here.
MEASURED: Mapping[CostKey, tuple[MeasuredCosts, ...]] = {
    # Gemma 3 270M (Q4_K_M weights, dequantized to f32): the tied head is ~33 layers of work.
    CostKey(arch="gemma3", n_layer=18, n_embd=640, n_head=4, n_head_kv=1, head_dim=256,
            n_ff=2048, n_vocab=262144): (
        MeasuredCosts(batch=8, layer_ms=(2.05, 2.0, 1.94, 1.96, 1.87, 1.91, 1.86, 1.85, 1.85, 1.83,
                                         1.85, 1.88, 1.88, 1.88, 1.93, 2.37, 2.51, 2.17),
                      head_ms=70.8, command=_MEASURE_COMMAND),
        MeasuredCosts(batch=16, layer_ms=(2.62, 2.36, 2.43, 2.45, 2.49, 2.45, 2.5, 2.37, 2.27, 2.44,
                                          2.45, 2.45, 2.43, 2.38, 2.47, 2.47, 2.5, 2.48),
                      head_ms=80.87, command=_MEASURE_COMMAND),
    ),
}


@attrs.frozen
class CostModel:
    """Cost of each layer and of the output head in one unit (ms of a decode step, or bytes)."""

    layer_costs: tuple[float, ...]
    head_cost: float
    source: str
    unit: str = "units"

    def __attrs_post_init__(self) -> None:
        """Costs must be non-negative and there must be a layer."""
        if not self.layer_costs:
            raise ConfigError("a cost model needs at least one layer")
        if min(self.layer_costs) < 0 or self.head_cost < 0:
            raise ConfigError(f"costs must be >= 0; got layers {self.layer_costs}, head {self.head_cost}")

    @classmethod
    def uniform(cls, n_layer: int, head_layers: float = 0.0) -> CostModel:
        """Every layer costs 1; the head costs `head_layers` layers."""
        if n_layer < 1:
            raise ConfigError(f"n_layer {n_layer} must be >= 1")
        return cls(layer_costs=(1.0,) * n_layer, head_cost=float(head_layers),
                   source=f"uniform layers, head = {head_layers:g} layers")

    @classmethod
    def from_weight_bytes(cls, hp: ModelHParams) -> CostModel:
        """Estimate from float32 weight sizes: matrices of a layer, and the head's (n_vocab, n_embd)."""
        attn = hp.n_embd * hp.head_dim * (2 * hp.n_head + 2 * hp.n_head_kv)
        ffn = 3 * hp.n_embd * hp.n_ff
        layer = 4.0 * (attn + ffn)
        head = 4.0 * hp.n_vocab * hp.n_embd
        return cls(layer_costs=(layer,) * hp.n_layer, head_cost=head,
                   source=f"estimated from f32 weight bytes (head = {head / layer:.1f} layers)",
                   unit="bytes")

    @classmethod
    def from_file_bytes(cls, memory: MemoryModel, batch: int = DEFAULT_BATCH) -> CostModel:
        """For a kernel reading the file's blocks: the bytes a decode step of `batch` rows reads of each
        layer (all of a dense one) and of the head."""
        experts = memory.experts
        if experts is None:
            layer = max(sum(memory.layer_weights) / memory.n_layer, 1.0)
            return cls(layer_costs=tuple(float(b) for b in memory.layer_weights),
                       head_cost=float(memory.head_weights),
                       source=f"the file's weight bytes per layer (head = {memory.head_weights / layer:.1f} layers)",
                       unit="bytes")
        costs = tuple(memory.active_bytes(il, batch) for il in range(memory.n_layer))
        read, held = sum(costs) / memory.n_layer, sum(memory.layer_weights) / memory.n_layer
        return cls(layer_costs=costs, head_cost=float(memory.head_weights),
                   source=(f"the file's bytes a decode step reads per layer at batch {batch}: experts "
                           f"{experts.n_expert_used} of {experts.n_expert} a row, "
                           f"{experts.expected_experts(batch):.1f} of {experts.n_expert} a layer under uniform "
                           f"routing; {format_bytes(read)} of a layer's {format_bytes(held)} "
                           f"(head = {memory.head_weights / max(read, 1.0):.1f} layers)"),
                   unit=READ_UNIT)

    @classmethod
    def for_model(cls, hp: ModelHParams, batch: int = DEFAULT_BATCH) -> CostModel:
        """The measured row nearest to `batch` for this model, else the weight-size estimate."""
        rows = MEASURED.get(CostKey.of(hp), ())
        if not rows:
            return cls.from_weight_bytes(hp)
        row = min(rows, key=lambda r: (abs(r.batch - batch), r.batch))
        return cls(layer_costs=row.layer_ms, head_cost=row.head_ms,
                   source=f"measured at batch {row.batch}: {row.command}", unit="ms")

    @property
    def n_layer(self) -> int:
        """Number of layers."""
        return len(self.layer_costs)

    def describe_cost(self, cost: float) -> str:
        """`12.5 ms`, `1.778e+09 bytes`, `reads 1.1 GiB a step` (bytes read, beside a stage's memory)."""
        return f"reads {format_bytes(cost)} a step" if self.unit == READ_UNIT else f"{cost:.4g} {self.unit}"

    def stage_cost(self, start: int, end: int) -> float:
        """Cost of layers [start, end), plus the head when the range ends the model."""
        cost = sum(self.layer_costs[start:end])
        return cost + self.head_cost if end == self.n_layer else cost


@attrs.frozen
class Plan:
    """Contiguous half-open layer ranges, one per stage, with each stage's predicted cost."""

    ranges: tuple[tuple[int, int], ...]
    stage_costs: tuple[float, ...]
    cost_model: CostModel
    stage_memory: tuple[StageMemory, ...] | None = None  # each stage's estimate, when planned with memory
    limits: StageLimits | None = None

    def describe(self) -> str:
        """One line per stage: range, layer count and share of the busiest stage."""
        busiest = max(self.stage_costs) or 1.0
        lines = [f"# cost model: {self.cost_model.source}"]
        if self.limits is not None:
            lines.append(f"# memory limit per stage: {self.limits.source}")
        for index, ((start, end), cost) in enumerate(zip(self.ranges, self.stage_costs, strict=True)):
            head = " + head" if end == self.cost_model.n_layer else ""
            host = self.limits.on_host(index) if self.limits is not None else ""
            line = (f"# stage {index}{host}: layers {start}..{end} ({end - start}{head}): "
                    f"{self.cost_model.describe_cost(cost)} ({cost / busiest:.0%} of the busiest)")
            if self.stage_memory is not None and self.limits is not None:
                line += (f"; memory {self.stage_memory[index].describe()} of "
                         f"{format_bytes(self.limits.limits[index])}")
            lines.append(line)
        return "\n".join(lines)


def plan_stages(costs: CostModel, n_stages: int, memory: MemoryModel | None = None,
                limits: StageLimits | None = None) -> Plan:
    """Cut the layers into `n_stages` contiguous ranges minimizing the busiest stage's cost.

    Ties go to the smaller sum of squared stage costs (the more even split), then to the
    earliest cuts. Exact dynamic programming: O(n_stages * n_layer^2), microseconds here.
    With `memory` and `limits`, a stage whose estimate exceeds its limit is never chosen.
    """
    n_layer = costs.n_layer
    if not 1 <= n_stages <= n_layer:
        raise ConfigError(f"cannot cut {n_layer} layers into {n_stages} stages; use 1..{n_layer}")
    if (memory is None) != (limits is None):
        raise ConfigError("planning by memory needs both a memory model and the stages' limits")
    if memory is not None and limits is not None:
        if memory.n_layer != n_layer or len(limits.limits) != n_stages:
            raise ConfigError(f"a memory model of {memory.n_layer} layers and {len(limits.limits)} limits "
                              f"do not fit a cut of {n_layer} layers into {n_stages} stages")
        ranges = _cheapest_cut(costs, n_stages, lambda s, a, b: memory.stage(a, b).total <= limits.limits[s])
        if ranges is None:
            fastest = _cheapest_cut(costs, n_stages, lambda _s, _a, _b: True)
            assert fastest is not None
            try:
                check_fits(memory, fastest, limits)
            except ConfigError as exc:
                raise ConfigError(f"no cut of {n_layer} layers into {n_stages} stages fits the memory limits; "
                                  f"the fastest cut's {exc}") from None
            raise ConfigError(f"no cut of {n_layer} layers into {n_stages} stages fits the memory limits")
        return Plan(ranges=ranges, stage_costs=ranges_cost(costs, ranges), cost_model=costs,
                    stage_memory=check_fits(memory, ranges, limits), limits=limits)
    ranges = _cheapest_cut(costs, n_stages, lambda _s, _a, _b: True)
    assert ranges is not None  # with no constraint every cut is allowed
    return Plan(ranges=ranges, stage_costs=ranges_cost(costs, ranges), cost_model=costs)


def _cheapest_cut(costs: CostModel, n_stages: int, allowed: Callable[[int, int, int], bool]
                  ) -> tuple[tuple[int, int], ...] | None:
    """The min-max cut over stages `allowed(stage, start, end)` permits, or None when none is."""
    n_layer = costs.n_layer
    # best[s][e]: (max cost, sum of squares) of the first e layers cut into s stages; cut[s][e]
    # the start of the last of those stages.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n_layer + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layer + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, n_stages + 1):
        for end in range(s, n_layer - (n_stages - s) + 1):
            for start in range(s - 1, end):
                prev = best[s - 1][start]
                if prev == inf or not allowed(s - 1, start, end):
                    continue
                cost = costs.stage_cost(start, end)
                candidate = (max(prev[0], cost), prev[1] + cost * cost)
                if _better(candidate, best[s][end]):
                    best[s][end], cut[s][end] = candidate, start
    if best[n_stages][n_layer] == inf:
        return None
    ranges: list[tuple[int, int]] = []
    end = n_layer
    for s in range(n_stages, 0, -1):
        start = cut[s][end]
        ranges.append((start, end))
        end = start
    ranges.reverse()
    return tuple(ranges)


def _better(candidate: tuple[float, float], incumbent: tuple[float, float]) -> bool:
    """Strictly better, with a relative tolerance so float noise does not pick between equals."""
    for new, old in zip(candidate, incumbent, strict=True):
        if new < old * (1 - 1e-9) - 1e-12:
            return True
        if new > old * (1 + 1e-9) + 1e-12:
            return False
    return False


def plan_model(hp: ModelHParams, n_stages: int, batch: int = DEFAULT_BATCH, *, memory: MemoryModel | None = None,
               limits: StageLimits | None = None, quantized: bool = False) -> Plan:
    """The plan for a model: by the file's bytes a decode step of `batch` rows reads for a `quantized`
    kernel (from `memory`), else by its measured (or estimated) float32 costs; within the stages'
    memory `limits` when given."""
    by_bytes = quantized and memory is not None
    costs = (CostModel.from_file_bytes(memory, batch) if by_bytes and memory is not None
             else CostModel.for_model(hp, batch))
    return plan_stages(costs, n_stages, memory, limits)


def balanced_ranges(n_layer: int, n_stages: int, head_layers: float = 0.0) -> list[tuple[int, int]]:
    """Ranges for layers of equal cost and a head worth `head_layers` layers."""
    return list(plan_stages(CostModel.uniform(n_layer, head_layers), n_stages).ranges)


def ranges_cost(costs: CostModel, ranges: Sequence[tuple[int, int]]) -> tuple[float, ...]:
    """Predicted cost of each stage of given ranges."""
    return tuple(costs.stage_cost(start, end) for start, end in ranges)
