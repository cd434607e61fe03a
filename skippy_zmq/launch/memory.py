"""What a stage will hold in memory, estimated from the model file before any stage starts
(docs/ARCHITECTURE.md, "Memory-aware planning").

A stage holds four things: its weights (the file's blocks for a quantized kernel, mapped and
resident as they are read, or copied once into ggml's repacked layout of the same size; four
bytes a value for the float32 kernels), its
sessions' KV caches at the configured context and lanes, the intermediate tensors of its
graphs, and the process itself (Python, numpy, pyzmq, ggml). The figures are upper bounds of
what steady serving touches, not of the address space: caches and weights are mapped, so
untouched pages cost nothing.

What a stage holds and what a decode step reads differ in an expert (MoE) file: a stage holds
every expert, but a step reads of each layer its other tensors and only the experts its rows'
router picks (`ExpertBytes`), so memory counts the total and the planner's time the part read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import attrs

from skippy_zmq import defaults
from skippy_zmq.compute import nbits_head
from skippy_zmq.compute.kv_cache import kv_bytes_per_position
from skippy_zmq.errors import ConfigError, SkippyError
from skippy_zmq.model.gguf_file import GGUFHeader, TensorInfo
from skippy_zmq.model.gguf_model import ModelHParams, head_tensor_name, require_gguf

MiB = 1 << 20
GiB = 1 << 30

RUNTIME_BYTES = 96 * MiB
"""A stage process before its model: Python, numpy, pyzmq, attrs and the ggml library. Measured:
51 MiB RSS after imports, a 2-layer tiny model and a 198-token prompt (`python3 -m tools.write_tiny_model
tiny.gguf --arch gemma3 --n-layer 2 --seed 1`, then `skippy-zmq bench memory --stage --model tiny.gguf`);
rounded up for the logging and socket buffers of a worker."""
GRAPH_BYTES = 128 * MiB
"""Intermediate tensors a quantized stage keeps for its graphs: compute/graphs.py keeps layouts
while their buffers fit in this (see GRAPH_BUFFER_BYTES there); the float kernels' temporaries are
of the same order."""


EXPERT_MARK = "_exps."
"""In the names of the tensors holding all of a layer's experts (`blk.N.ffn_gate_exps.weight`, up, down)."""


def tensor_bytes(info: TensorInfo) -> int:
    """Bytes of a tensor as the file stores it (whole blocks of its type)."""
    gguf = require_gguf()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
    return int(info.n_elements // block * size)


def format_bytes(n: float) -> str:
    """`1.25 GiB`, `96 MiB`: binary units, three significant digits."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def available_bytes() -> int:
    """Memory the host can give new work now (`MemAvailable` of /proc/meminfo; else physical memory)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@attrs.frozen
class StageMemory:
    """One stage's estimated bytes, by what holds them."""

    weights: int
    kv: int
    graphs: int
    runtime: int

    @property
    def total(self) -> int:
        """All of it."""
        return self.weights + self.kv + self.graphs + self.runtime

    def describe(self) -> str:
        """`6.1 GiB (weights 5.2 GiB, KV 768 MiB, graphs 128 MiB, runtime 96 MiB)`."""
        return (f"{format_bytes(self.total)} (weights {format_bytes(self.weights)}, KV {format_bytes(self.kv)}, "
                f"graphs {format_bytes(self.graphs)}, runtime {format_bytes(self.runtime)})")


@attrs.frozen
class ExpertBytes:
    """Each layer's bytes of expert tensors (a part of its weights), and how many experts a row reads."""

    per_layer: tuple[int, ...]
    n_expert: int
    n_expert_used: int

    def __attrs_post_init__(self) -> None:
        """A row reads 1 to n_expert experts; byte counts are not negative."""
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ConfigError(f"{self.n_expert_used} experts used of {self.n_expert}; expected 1 to n_expert used")
        if self.per_layer and min(self.per_layer) < 0:
            raise ConfigError(f"expert bytes per layer {self.per_layer} must be >= 0")

    def expected_experts(self, batch: int) -> float:
        """Distinct experts a layer reads in a decode step of `batch` rows, expected under uniform routing."""
        if batch < 1:
            raise ConfigError(f"batch {batch} must be >= 1")
        # Each row picks k = n_expert_used of n = n_expert, so a given expert escapes one row with
        # probability 1 - k/n and all B rows with (1 - k/n)^B. Uniform routing is the fair guess
        # from a header, which says nothing of the router's preferences: training balances
        # expert use towards it, and for independently routed rows it is the most a step can
        # expect to read (1 - (1 - p)^B is concave in an expert's share p), so skewed routing
        # only makes a step cheaper than planned.
        share = self.n_expert_used / self.n_expert
        return self.n_expert * (1.0 - (1.0 - share) ** batch)

    def read_fraction(self, batch: int) -> float:
        """The share of a layer's expert bytes a decode step of `batch` rows reads."""
        return self.expected_experts(batch) / self.n_expert


@attrs.frozen
class MemoryModel:
    """Per-layer and head bytes of one model under one kernel, context, lane count and cache type."""

    layer_weights: tuple[int, ...]
    head_weights: int  # output norm and head matrix (the tied embedding when there is no output.weight)
    kv_per_layer: int  # one layer's caches of every lane at the full context
    head_graphs: int  # the final stage's logits buffers
    settings: str  # what the KV figure assumes, for messages
    cache_types: tuple[str, str] = (defaults.CACHE_TYPE, defaults.CACHE_TYPE)  # keys', values'
    experts: ExpertBytes | None = None  # an expert file's share of layer_weights; None in a dense one

    def __attrs_post_init__(self) -> None:
        """Expert bytes, when given, are a part of each layer's weights."""
        if self.experts is not None and (
                len(self.experts.per_layer) != len(self.layer_weights)
                or any(e > w for e, w in zip(self.experts.per_layer, self.layer_weights, strict=True))):
            raise ConfigError(f"expert bytes per layer {self.experts.per_layer} must be a part of each of the "
                              f"{len(self.layer_weights)} layers' weights {self.layer_weights}")

    @classmethod
    def of_model(cls, header: GGUFHeader, hp: ModelHParams, *, quantized: bool, ctx_size: int, lanes: int,
                 cache_type_k: str = defaults.CACHE_TYPE, cache_type_v: str = defaults.CACHE_TYPE,
                 head_by_nbits: Callable[[str], bool] | None = None) -> MemoryModel:
        """The model's figures; `quantized` when the stages' kernel computes from the file's blocks;
        `head_by_nbits` says of the head's type whether MatMulNBits multiplies by it (its packed copy)."""
        if ctx_size < 1 or lanes < 1:
            raise ConfigError(f"ctx_size {ctx_size} and lanes {lanes} must be >= 1")

        def held(info: TensorInfo) -> int:
            return tensor_bytes(info) if quantized else 4 * info.n_elements

        layers = [0] * hp.n_layer
        experts = [0] * hp.n_layer
        for name, info in header.tensors.items():
            parts = name.split(".")
            if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() and int(parts[1]) < hp.n_layer:
                layers[int(parts[1])] += held(info)
                if EXPERT_MARK in name:
                    experts[int(parts[1])] += held(info)
        head_info = header.tensors[head_tensor_name(header)]
        head = held(head_info)
        head_type = require_gguf().GGMLQuantizationType(head_info.ggml_type).name
        if quantized and head_by_nbits is not None and len(head_info.dims) == 2 and head_by_nbits(head_type):
            k, n = head_info.dims
            head = nbits_head.resident_bytes(head_type, n, k)
        if "output_norm.weight" in header.tensors:
            head += held(header.tensors["output_norm.weight"])
        try:
            per_position = kv_bytes_per_position(1, hp.n_head_kv, hp.head_dim, cache_type_k, cache_type_v)
        except SkippyError as exc:
            raise ConfigError(str(exc)) from None
        return cls(layer_weights=tuple(layers), head_weights=head, kv_per_layer=per_position * ctx_size * lanes,
                   head_graphs=2 * lanes * hp.n_vocab * 4,
                   settings=f"ctx {ctx_size} x {lanes} lanes, K {cache_type_k} / V {cache_type_v}",
                   cache_types=(cache_type_k, cache_type_v),
                   experts=(ExpertBytes(per_layer=tuple(experts), n_expert=hp.n_expert,
                                        n_expert_used=hp.n_expert_used) if hp.has_experts else None))

    @property
    def n_layer(self) -> int:
        """Number of layers."""
        return len(self.layer_weights)

    def active_bytes(self, layer: int, batch: int) -> float:
        """Bytes of layer `layer` a decode step of `batch` rows reads: all of a dense layer; of an expert
        layer its other tensors and the share of its experts the rows are expected to pick."""
        total = self.layer_weights[layer]
        if self.experts is None:
            return float(total)
        expert = self.experts.per_layer[layer]
        return (total - expert) + expert * self.experts.read_fraction(batch)

    def stage(self, start: int, end: int) -> StageMemory:
        """The estimate of a stage running layers [start, end) (with the head when it ends the model)."""
        if not 0 <= start < end <= self.n_layer:
            raise ConfigError(f"layers {start}..{end} are not a range of the model's {self.n_layer} layers")
        last = end == self.n_layer
        weights = sum(self.layer_weights[start:end]) + (self.head_weights if last else 0)
        graphs = GRAPH_BYTES + (self.head_graphs if last else 0)
        return StageMemory(weights=weights, kv=self.kv_per_layer * (end - start), graphs=graphs,
                           runtime=RUNTIME_BYTES)


@attrs.frozen
class StageLimits:
    """The most bytes each stage may hold: one per stage, and where the figures came from."""

    limits: tuple[int, ...]
    source: str
    hosts: tuple[str, ...] | None = None  # the host each stage runs on, for messages (`plan --hosts`)

    @classmethod
    def even_share(cls, n_stages: int, *, available: int | None = None) -> StageLimits:
        """The host's available memory divided by the stages on it (the default of local pipelines)."""
        total = available_bytes() if available is None else available
        return cls(limits=(total // n_stages,) * n_stages,
                   source=f"the host's available {format_bytes(total)} / {n_stages} stages")

    @classmethod
    def uniform(cls, limit: int, n_stages: int, source: str = "--max-stage-memory") -> StageLimits:
        """The same limit for every stage."""
        return cls(limits=(limit,) * n_stages, source=source)

    @classmethod
    def per_host(cls, hosts: Sequence[tuple[str, int]], source: str = "--hosts") -> StageLimits:
        """One stage per (host, bytes) entry, in pipeline order: each stage may hold its host's bytes."""
        return cls(limits=tuple(limit for _host, limit in hosts), source=source,
                   hosts=tuple(host for host, _limit in hosts))

    def on_host(self, index: int) -> str:
        """` on host 10.0.0.2` for stage `index` when the limits name hosts, else nothing."""
        return f" on host {self.hosts[index]}" if self.hosts is not None else ""


def check_fits(memory: MemoryModel, ranges: Sequence[tuple[int, int]], limits: StageLimits,
               labels: Sequence[str] | None = None) -> tuple[StageMemory, ...]:
    """Each stage's estimate; ConfigError naming the first stage over its limit (by `labels`, else
    `stage I (layers A..B)`)."""
    if len(limits.limits) != len(ranges):
        raise ConfigError(f"{len(limits.limits)} memory limits for {len(ranges)} stages")
    estimates = tuple(memory.stage(start, end) for start, end in ranges)
    for index, ((start, end), estimate, limit) in enumerate(zip(ranges, estimates, limits.limits, strict=True)):
        if estimate.total > limit:
            head = " + head" if end == memory.n_layer else ""
            label = labels[index] if labels is not None else f"stage {index} (layers {start}..{end})"
            f16 = ", an f16 cache" if "f32" in memory.cache_types else ""
            raise ConfigError(
                f"{label}{head}{limits.on_host(index)} needs {estimate.describe()} at "
                f"{memory.settings}, over its limit of {format_bytes(limit)} ({limits.source}); "
                f"use more stages, fewer lanes, a shorter context{f16} or a larger limit")
    return estimates
