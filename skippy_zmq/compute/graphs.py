"""A stage's transformer blocks as ggml graphs over the file's own blocks (docs/ARCHITECTURE.md, "Kernels").

With the `ggml` kernel a block is not a chain of numpy steps between products: the whole block
runs in ggml, in the operations and the order of llama.cpp's graph for the architecture
(RMSNorm, the products, per-head q/k norms, RoPE, the q scale; attention as scores, masked
softmax and values over each session's cache, as llama.cpp computes it without flash attention;
the output product, post-norms, residual adds, the fused gated FFN, or an expert file's expert
layer as llama.cpp's build_moe_ffn: docs/ARCHITECTURE.md, "The expert layer"). A stage's layers
form one graph: each layer writes its new keys and values into the sessions' caches itself
(`ggml_set_rows` at row indices the pass fills in, as llama.cpp's graph does), and its attention
reads the caches through views of those writes, so the graph orders every read after its write.
A pass is one graph computation.

A graph is built once per batch layout (`Layout`) and kept (`GRAPH_LAYOUTS` layouts); its
inputs and outputs are numpy arrays the graph's tensors are placed on (`ggml.HostArrays`), the
caches are written and read where they are, and its intermediate tensors share one buffer. The
caches are kept in their own types (compute/kv_cache.py CACHE_TYPES): an f16 cache as F16
tensors, as llama.cpp keeps its default cache. Shapes: R rows,
E = n_embd, H heads, Hkv KV heads, D head_dim.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.compute import expert_products, ggml, huge_pages
from skippy_zmq.compute.kv_cache import KVLayout, Segment, SessionKV
from skippy_zmq.compute.nbits_head import NbitsHead
from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.gguf_file import ArchKey
from skippy_zmq.model.gguf_model import ROPE_FREQS, BlockMatrix, GGUFModel, ModelHParams

F32 = npt.NDArray[np.float32]

GRAPH_LAYOUTS = 16
"""Batch layouts whose graph (one per pass) a stage keeps, and row counts of the head's graphs;
the least recently used goes first."""
GRAPH_BUFFER_BYTES = 128 << 20
"""Intermediate-tensor bytes the kept layouts may hold together (the newest is kept whatever its
size): a prefill layout of a wide model holds tens of MiB (scores of R rows x keys x heads) and is
seldom reused, where decode layouts are small and reused for 64 steps."""
ROPE_MODES = {False: 0, True: 2}
"""ggml's RoPE mode by `ArchSpec.rope_neox`: 0 rotates pairs (2i, 2i+1), 2 (NEOX) pairs (i, i + D/2)."""

_OPTIONAL = frozenset({"attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm",
                       "attn_q.bias", "attn_k.bias", "attn_v.bias", "ffn_gate", "ffn_up", "ffn_down",
                       "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp_shexp",
                       "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"})


@attrs.frozen
class LayerTensors:
    """ggml tensor handles of one block's weights (None: the architecture has no such weight)."""

    index: int
    rope_base: float
    rope_scale: float  # linear RoPE scaling's 1 / factor, 1.0 when unscaled
    rope_factors: int | None  # the file's rope_freqs (D/2,) F32, or None
    sliding_window: int
    tensors: dict[str, int | None]

    def __getitem__(self, name: str) -> int:
        """The tensor named `name` (attn_q, ffn_down, ...), which the architecture has."""
        tensor = self.tensors[name]
        assert tensor is not None, name
        return tensor

    def has(self, name: str) -> bool:
        """Whether this block has the weight `name`."""
        return self.tensors.get(name) is not None


def _layer_matrices(model: GGUFModel, il: int) -> list[BlockMatrix]:
    """Block il's matrices as the file stores them, and its norms as F32 (n, 1) matrices."""
    hp = model.hparams
    spec = hp.spec
    e, d, ff = hp.n_embd, hp.head_dim, hp.n_ff
    q_dim, kv_dim = hp.n_head * d, hp.n_head_kv * d
    p = f"blk.{il}."
    present = {"attn_q_norm.weight": spec.qk_norm, "attn_k_norm.weight": spec.qk_norm,
               "post_attention_norm.weight": spec.post_norms, "post_ffw_norm.weight": spec.post_norms,
               "attn_q.bias": spec.qkv_bias, "attn_k.bias": spec.qkv_bias, "attn_v.bias": spec.qkv_bias}
    vectors = {"attn_norm.weight": e, "attn_q_norm.weight": d, "attn_k_norm.weight": d,
               "post_attention_norm.weight": e, "ffn_norm.weight": e, "post_ffw_norm.weight": e,
               "attn_q.bias": q_dim, "attn_k.bias": kv_dim, "attn_v.bias": kv_dim}
    matrices = [model.block_matrix(p + name + ".weight", shape) for name, shape in (
        ("attn_q", (q_dim, e)), ("attn_k", (kv_dim, e)), ("attn_v", (kv_dim, e)), ("attn_output", (e, q_dim)))]
    if hp.has_experts:  # the router (n_expert, E) and each expert's three matrices
        matrices += _expert_matrices(model, il)
    else:
        matrices += [model.block_matrix(p + name + ".weight", shape) for name, shape in (
            ("ffn_gate", (ff, e)), ("ffn_up", (ff, e)), ("ffn_down", (e, ff)))]
    for name, n in vectors.items():  # norms and biases as F32 (n, 1) matrices
        if present.get(name, True):
            values = model.load_f32(p + name, (n,))
            matrices.append(BlockMatrix(name=p + name, type_name="F32", k=n, n=1, data=values.view(np.uint8)))
    return matrices


def _expert_matrices(model: GGUFModel, il: int) -> list[BlockMatrix]:
    """Block il's router and expert tensors as the file stores them; ModelLoadError naming the tensor,
    its shape and the keys its expected shape comes from where they disagree."""
    hp = model.hparams
    e, ff, n = hp.n_embd, hp.n_ff_exp, hp.n_expert
    p = f"blk.{il}."
    shapes = {"ffn_gate_inp": (n, e), "ffn_gate_exps": (n, ff, e), "ffn_up_exps": (n, ff, e),
              "ffn_down_exps": (n, e, ff)}
    arch = hp.arch
    width_key = ArchKey.EXPERT_FEED_FORWARD_LENGTH if hp.spec.expert_ff_key else ArchKey.FEED_FORWARD_LENGTH
    keys = (f"{ArchKey.EXPERT_COUNT.of(arch)} = {n}, {width_key.of(arch)} = {ff}, "
            f"{ArchKey.EMBEDDING_LENGTH.of(arch)} = {e}")
    matrices = []
    for name, shape in shapes.items():
        full = p + name + ".weight"
        if not model.has_tensor(full):
            raise ModelLoadError(f"{model.path}: tensor {full!r} is missing; an expert layer needs it ({keys})")
        held = model.header.tensor(full).shape
        if held != shape:
            raise ModelLoadError(f"{model.path}: tensor {full!r} has shape {held}, but the file's keys say "
                                 f"{shape} ({keys})")
        matrices.append(model.block_matrix(full, shape) if len(shape) == 2 else model.expert_matrix(full, shape))
    if hp.spec.shared_expert:  # its gate (E,) as an F32 (E, 1) matrix, then its gated FFN
        gate = model.load_f32(p + "ffn_gate_inp_shexp.weight", (e,))
        matrices.append(BlockMatrix(name=p + "ffn_gate_inp_shexp.weight", type_name="F32", k=e, n=1,
                                    data=gate.view(np.uint8)))
        shared = hp.n_ff_shexp
        matrices += [model.block_matrix(p + name + ".weight", shape) for name, shape in (
            ("ffn_gate_shexp", (shared, e)), ("ffn_up_shexp", (shared, e)), ("ffn_down_shexp", (e, shared)))]
    return matrices


def _tensor_key(name: str) -> str:
    """A block tensor's key in LayerTensors: `blk.3.attn_q.weight` -> `attn_q`, `blk.3.attn_q.bias` ->
    `attn_q.bias`."""
    key = name.split(".", 2)[2]
    return key.removesuffix(".weight")


KV_PAD = 64
"""A session's attended keys are its positions rounded up to this (at most its context): the graphs
of a batch then stay the same for 64 steps, and the masked keys add exact zeros, so the numbers do
not depend on the padding (tests/compute/test_graphs.py checks the bits). 64 is the step of ggml's
f16 dot product on AVX-512F (AVX2's 32 and NEON's 16 or 32 divide it; with AVX512-FP16 it is 128,
not measured here): the part of a dot below a whole step goes through its scalar loop. llama.cpp
pads its view of the cache to 256; every read key costs, and padded to 256, a 16-session decode
pass of Gemma 3 270M took 40 ms against 33.5 at 64 (docs/BENCHMARKS.md at commit f9d1290, "Attention padded to 64
keys")."""


def padded_keys(pos_end: int, ctx_size: int) -> int:
    """How many cache positions a session's attention reads when it holds `pos_end`."""
    return min(ctx_size, max(KV_PAD, -(-pos_end // KV_PAD) * KV_PAD))


POOL_SLOTS = 32
"""Session caches a stage keeps side by side in one `SlotPool` (address space only until written)."""
POOLED_MIN_SESSIONS = 4
"""A decode pass over at least this many pooled sessions attends for all of them in one operation."""


@attrs.frozen
class Layout:
    """What a pass's graph is built for: R rows, and per session that attends apart (the memory its
    cache lives in, first row, rows, attended keys). Equal layouts reuse the same graph; positions,
    masks and cache rows are inputs. A pool slot's memory is named by the slot, not the session
    (`SessionKV.memory_key`): the next session in that slot reuses the graphs of its prompt's
    layout and of its decode steps, where a new session would otherwise build them on its way
    to its first token.

    The decode rows (one row of a session) of `POOLED_MIN_SESSIONS` or more sessions of one
    `SlotPool` are *pooled* (`split_pooled`): their attention reads the pool's first
    `pool_slots` slots through one strided view, `pooled_keys` keys each, and the layout names
    none of them, only how many there are (`pooled_rows`); the other rows (prefill chunks, a
    session without a slot) attend apart. A decode pass of pooled sessions names no session at
    all, so it serves any batch of that many rows, slots and keys."""

    rows: int
    segments: tuple[tuple[tuple[int, int], int, int, int], ...]
    pooled_keys: int = 0
    pool_slots: int = 0
    cache_types: tuple[tuple[str, str], ...] = ()  # the sessions' (keys', values') types (kv_cache.CACHE_TYPES)
    pooled_rows: int = 0
    value_block: int = 0  # positions per block of the sessions' values (kv_cache.VALUE_BLOCK)

    @classmethod
    def of(cls, rows: int, pooled: Sequence[Segment], apart: Sequence[Segment]) -> Layout:
        """The layout of a pass over segments split by `split_pooled` (keys padded by `padded_keys`)."""
        # A pooled pass's sessions share one pool, so one KVCacheSet and its cache types.
        types = tuple(sorted({(seg.kv.layout.type_k.name, seg.kv.layout.type_v.name) for seg in (*pooled, *apart)}))
        keys = max((padded_keys(seg.pos_start + 1, seg.kv.ctx_size) for seg in pooled), default=0)
        slots = 1 + max((seg.kv.slot.index for seg in pooled if seg.kv.slot is not None), default=-1)
        blocks = {seg.kv.layout.value_block for seg in (*pooled, *apart)}
        if len(blocks) > 1:  # one KVCacheSet's sessions share their layout
            raise ModelLoadError(f"one pass over caches of values in blocks of {sorted(blocks)} positions; "
                                 "expected one block size")
        return cls(rows, tuple((seg.kv.memory_key, seg.row_start, seg.n_rows,
                                padded_keys(seg.pos_start + seg.n_rows, seg.kv.ctx_size)) for seg in apart),
                   pooled_keys=keys, pool_slots=slots, cache_types=types, pooled_rows=len(pooled),
                   value_block=max(blocks, default=0))

    @property
    def value_products(self) -> int:
        """Products of values and scores a layer takes: one per block of attended keys, per session
        that attends apart and for the pooled rows."""
        if not self.value_block:
            return 0
        keys = [segment[3] for segment in self.segments] + ([self.pooled_keys] if self.pooled_keys else [])
        return sum(-(-count // self.value_block) for count in keys)


def split_pooled(segments: Sequence[Segment]) -> tuple[list[Segment], list[Segment]]:
    """A pass's segments that attend through their pool (decode rows of sessions with slots in the
    first such row's pool, when at least `POOLED_MIN_SESSIONS`), and the others, in batch order."""
    decode = [seg for seg in segments if seg.n_rows == 1 and seg.kv.slot is not None]
    if decode:
        pool = decode[0].kv.slot.pool  # type: ignore[union-attr]
        decode = [seg for seg in decode if seg.kv.slot.pool is pool]  # type: ignore[union-attr]
    if len(decode) < POOLED_MIN_SESSIONS or not _slots_hold_whole_key_rows(decode[0].kv):
        return [], list(segments)
    pooled = {id(seg) for seg in decode}
    return decode, [seg for seg in segments if id(seg) not in pooled]


def _slots_hold_whole_key_rows(kv: SessionKV) -> bool:
    """Whether a pool's slots are a whole number of key rows (D values) apart, so that one write
    can put every pooled row's keys where they go."""
    assert kv.slot is not None
    return kv.slot.pool.slot_bytes % (kv.layout.head_dim * kv.layout.type_k.value_bytes) == 0


class _IO:
    """The numpy arrays a layout's graph reads and writes, with ggml tensors placed on them."""

    def __init__(self, lib: ggml.Library, hp: ModelHParams, layout: Layout, windows: Sequence[int]) -> None:
        d, rows, hkv = hp.head_dim, layout.rows, hp.n_head_kv
        self.host = ggml.HostArrays(lib)
        self.x = self.host.empty((rows, hp.n_embd))  # the stage's input rows
        self.out = self.host.empty((rows, hp.n_embd))  # the residual stream after the last layer
        self.attn = self.host.empty((rows, hp.n_head * d))
        self.positions = self.host.empty((rows,), np.int32)
        # Per session and window (0: global), (n_rows, keys): 0 where a row may attend, -inf elsewhere.
        self.masks = {(i, w): self.host.empty((n_rows, keys)) for i, (_, _, n_rows, keys) in enumerate(layout.segments)
                      for w in sorted(set(windows))}
        # Per session, where its new keys go (cache rows of D values: its positions) and its new
        # values (single values of the blocked transposed cache, `_value_cells`).
        self.key_rows = {i: self.host.empty((n_rows,), np.int64) for i, (_, _, n_rows, _) in
                         enumerate(layout.segments)}
        self.value_cells = {i: self.host.empty((n_rows * hkv * d,), np.int64) for i, (_, _, n_rows, _) in
                            enumerate(layout.segments)}
        if layout.pooled_keys:
            pooled, slots = layout.pooled_rows, layout.pool_slots
            self.row_of_slot = self.host.empty((slots,), np.int32)  # the batch row whose query a slot takes
            self.pooled_batch_rows = self.host.empty((pooled,), np.int32)  # the pooled rows, in batch order
            self.pooled_slots = self.host.empty((pooled,), np.int32)  # and their slots
            self.pool_masks = {w: self.host.empty((slots, 1, 1, layout.pooled_keys))
                               for w in sorted(set(windows))}
            # Where the pooled rows' keys and values go, counted from the start of a layer's keys
            # (values) in slot 0: (P, Hkv) key rows and (P, Hkv * D) value cells.
            self.pool_key_rows = self.host.empty((pooled * hkv,), np.int64)
            self.pool_value_cells = self.host.empty((pooled * hkv * d,), np.int64)

    def fill_pooled(self, positions: npt.NDArray[np.int64], segments: Sequence[Segment]) -> None:
        """For the pooled rows (`segments`, one row each): their batch rows and slots, the slots'
        masks (a slot no row uses sees its first key only), and where their keys and values go."""
        slots = np.array([seg.kv.slot.index for seg in segments if seg.kv.slot is not None])
        rows = np.array([seg.row_start for seg in segments])
        positions = positions[rows]
        self.row_of_slot[:] = 0
        self.row_of_slot[slots] = rows
        self.pooled_batch_rows[:] = rows
        self.pooled_slots[:] = slots
        for window, mask in self.pool_masks.items():
            mask[:] = -np.inf
            mask[:, 0, 0, 0] = 0.0
            mask[slots, 0, 0, :] = _mask(positions, mask.shape[-1], window)  # one row per session
        first = segments[0].kv
        assert first.slot is not None
        kv, ctx_size, slot_bytes = first.layout, first.ctx_size, first.slot.pool.slot_bytes
        row_bytes = kv.head_dim * kv.type_k.value_bytes
        heads = np.arange(kv.n_head_kv) * ctx_size  # (Hkv,)
        self.pool_key_rows[:] = ((slots * (slot_bytes // row_bytes) + positions)[:, None] + heads[None, :]).ravel()
        self.pool_value_cells[:] = _value_cells(kv, positions, slots * (slot_bytes // kv.type_v.value_bytes))

    def fill(self, positions: npt.NDArray[np.int64], layout: Layout, segments: Sequence[Segment]) -> None:
        """Causal (and sliding-window) masks of the rows of the sessions that attend apart
        (`segments`), and where their new keys and values go in their caches."""
        for (i, window), mask in self.masks.items():
            _, start, n_rows, keys = layout.segments[i]
            mask[:] = _mask(positions[start:start + n_rows], keys, window)
        for i, seg in enumerate(segments):  # those that attend apart, as layout.segments
            rows = positions[seg.row_start:seg.row_start + seg.n_rows]
            self.key_rows[i][:] = rows
            self.value_cells[i][:] = _value_cells(seg.kv.layout, rows, 0)


def _value_cells(kv: KVLayout, positions: npt.NDArray[np.int64], base: npt.NDArray[np.int64] | int
                 ) -> npt.NDArray[np.int64]:
    """(len(positions) * Hkv * D,) where each position's values go among a layer's single values in
    blocks (kv_cache.VALUE_BLOCK): value e (of Hkv * D) of position p at block p // B's start, e * B,
    plus p mod B; `base` (per position, or one) counts from the first layer's values to this one's."""
    block = kv.value_block
    starts = base + (positions // block) * (kv.n_head_kv * kv.head_dim * block) + positions % block  # (P,)
    cells = np.arange(kv.n_head_kv * kv.head_dim) * block  # (Hkv * D,)
    return np.asarray((starts[:, None] + cells[None, :]).ravel(), np.int64)


def _mask(positions: npt.NDArray[np.int64], keys: int, window: int) -> F32:
    """(rows, keys): 0 where a row at its position may attend to a key (causal, and within the
    sliding window when `window` > 0), -inf elsewhere."""
    distance = positions[:, None] - np.arange(keys)[None, :]
    visible = distance >= 0
    if window > 0:
        visible &= distance < window
    return np.where(visible, np.float32(0.0), np.float32(-np.inf))


class _LayoutGraphs:
    """The one graph of a layout's pass over the stage's layers, its arrays, and the buffer of its
    intermediate tensors (ggml's graph allocator, reserved then allocated; the size is checked
    unchanged, since a tensor keeps the address it was first given)."""

    def __init__(self, owner: BlockGraphs, layout: Layout, pooled: Sequence[Segment],
                 apart: Sequence[Segment]) -> None:
        lib, hp = owner.lib, owner.hparams
        self.lib = lib
        self.io = _IO(lib, hp, layout, [lw.sliding_window for lw in owner.layers])
        self.allocator = lib.ggml_gallocr_new(lib.ggml_backend_cpu_buffer_type())
        per_session = len(layout.segments)  # attended apart, each with its value products
        value_products = layout.value_products
        expert_nodes = 32 + 2 * hp.n_expert_used if hp.has_experts else 0
        nodes = 64 + len(owner.layers) * (64 + expert_nodes + 32 * per_session + 4 * value_products)
        # Tensors: the graph's nodes and leaves, and the views and reshapes between them.
        self.ctx = lib.ggml_init(ggml.InitParams(
            lib.ggml_tensor_overhead() * 2 * nodes + lib.ggml_graph_overhead_custom(nodes, False), None, True))
        self.graph = lib.ggml_new_graph_custom(self.ctx, nodes, False)
        build = _Builder(lib, self.ctx, self.graph, hp, self.io, invariant=owner.invariant)
        x = build.placed(self.io.x, ggml.GGML_TYPES["F32"])
        positions = build.placed(self.io.positions, ggml.GGML_I32)
        for slot, lw in enumerate(owner.layers):
            q, k, v = build.pre_attention(lw, x, positions)
            if layout.segments:
                attn = build.attention(lw, slot, layout, apart, q, k, v)
            if layout.pooled_keys:
                attn = build.pooled_attention(lw, slot, layout, pooled, q, k, v)
            x = build.post_attention(lw, x, attn)
            lib.ggml_build_forward_expand(self.graph, x)
        build.place(x, self.io.out)
        what = f"the block graph of {layout.rows} rows"
        if not lib.ggml_gallocr_reserve(self.allocator, self.graph):
            raise ModelLoadError(f"ggml could not reserve the intermediate tensors of {what}")
        size = lib.ggml_gallocr_get_buffer_size(self.allocator, 0)
        if not lib.ggml_gallocr_alloc_graph(self.allocator, self.graph):
            raise ModelLoadError(f"ggml could not allocate the intermediate tensors of {what}")
        if lib.ggml_gallocr_get_buffer_size(self.allocator, 0) != size:
            raise ModelLoadError(f"ggml moved the intermediate buffer of {what} while allocating them")
        self.nbytes = int(size) + self.io.host.nbytes

    def __del__(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if getattr(self, "allocator", None):
            lib.ggml_gallocr_free(self.allocator)
        if getattr(self, "ctx", None):
            lib.ggml_free(self.ctx)


# The fused gated activation of each `ArchSpec.ffn_glu` (llama.cpp's build_ffn with LLM_FFN_PAR).
GLU_OPS = {"gelu": "ggml_geglu_split", "silu": "ggml_swiglu_split"}


class _Builder:
    """Adds one block's parts to a graph, in the operations and order of llama.cpp's graph."""

    def __init__(self, lib: ggml.Library, ctx: int, graph: int, hp: ModelHParams, io: _IO, *,
                 invariant: bool = False) -> None:
        self.lib, self.ctx, self.graph, self.hp, self.io = lib, ctx, graph, hp, io
        self.glu = GLU_OPS[hp.spec.ffn_glu]
        self.rows = int(io.positions.shape[0])
        self.invariant = invariant  # every row computed in one order whatever its pass (BlockGraphs)

    def mul_mat(self, weight: int, x: int) -> int:
        """A product with one of the block's matrices (ggml.mul_mat, in the graph's mode)."""
        return ggml.mul_mat(self.lib, self.ctx, weight, x, invariant=self.invariant)

    def placed(self, array: npt.NDArray[Any], type_id: int) -> int:
        """A tensor of `array`'s shape (reversed: ggml's ne0 is numpy's last axis) over its memory."""
        shape = array.shape[::-1]
        if len(shape) == 1:
            tensor = self.lib.ggml_new_tensor_1d(self.ctx, type_id, *shape)
        elif len(shape) == 2:
            tensor = self.lib.ggml_new_tensor_2d(self.ctx, type_id, *shape)
        elif len(shape) == 3:
            tensor = self.lib.ggml_new_tensor_3d(self.ctx, type_id, *shape)
        else:
            tensor = self.lib.ggml_new_tensor_4d(self.ctx, type_id, *shape)
        self.place(tensor, array)
        return int(tensor)

    def place(self, tensor: int, array: npt.NDArray[Any]) -> None:
        """Put a graph's tensor (an input, or the result of an operation) on `array`'s memory."""
        self.io.host.place(tensor, array)

    def norm(self, x: int, weight: int) -> int:
        """RMSNorm over ne0, times the weight (llama.cpp's build_norm, LLM_NORM_RMS)."""
        return int(self.lib.ggml_mul(self.ctx, self.lib.ggml_rms_norm(self.ctx, x, self.hp.rms_eps), weight))

    def rope(self, x: int, positions: int, lw: LayerTensors) -> int:
        """RoPE of (D, heads, R) by each row's position, scaled by the layer's scale and the file's RoPE
        scaling (YaRN's blend and the attention factor), with llama.cpp's arguments."""
        hp, scaling = self.hp, self.hp.rope_scaling
        return int(self.lib.ggml_rope_ext(self.ctx, x, positions, lw.rope_factors, hp.head_dim,
                                          ROPE_MODES[hp.rope_neox], hp.rope_n_ctx_orig, lw.rope_base, lw.rope_scale,
                                          scaling.ext_factor, scaling.attn_factor, scaling.beta_fast,
                                          scaling.beta_slow))

    def projected(self, lw: LayerTensors, name: str, h: int) -> int:
        """The product with matrix `name`, plus its bias where the block has one (llama.cpp's build_qkv)."""
        out = self.mul_mat(lw[name], h)
        if lw.has(name + ".bias"):
            out = self.lib.ggml_add(self.ctx, out, lw[name + ".bias"])
        return int(out)

    def pre_attention(self, lw: LayerTensors, x: int, positions: int) -> tuple[int, int, int]:
        """attn_norm, the q/k/v products, the q/k norms, RoPE (and q's scale): q (D, H, R), k (D, Hkv, R)
        and v (Hkv*D, R)."""
        lib, ctx, hp, r = self.lib, self.ctx, self.hp, self.rows
        d = hp.head_dim
        h = self.norm(x, lw["attn_norm"])
        q = lib.ggml_reshape_3d(ctx, self.projected(lw, "attn_q", h), d, hp.n_head, r)  # (D, H, R)
        k = lib.ggml_reshape_3d(ctx, self.projected(lw, "attn_k", h), d, hp.n_head_kv, r)  # (D, Hkv, R)
        v = self.projected(lw, "attn_v", h)  # (Hkv*D, R)
        if lw.has("attn_q_norm"):
            q, k = self.norm(q, lw["attn_q_norm"]), self.norm(k, lw["attn_k_norm"])
        q = self.rope(q, positions, lw)
        if self.hp.spec.scale_q:
            q = lib.ggml_scale(ctx, q, float(np.float32(1.0 / np.sqrt(d))))
        k = self.rope(k, positions, lw)
        return int(q), int(k), v

    def attention(self, lw: LayerTensors, slot: int, layout: Layout, segments: Sequence[Segment],
                  q_all: int, k_all: int, v_all: int) -> int:
        """Each session's new keys and values (k_all (D, Hkv, R), v_all (Hkv*D, R)) written into its
        cache, then its queries (q_all (D, H, R)) against the cache, as llama.cpp without flash
        attention: scores, masked softmax, values; (H*D, R) on io.attn, written segment by segment.
        The caches are written and read in their cache types: into f16, ggml rounds to nearest
        even; reading f16, it rounds q and the softmaxed scores to f16 for the two products and
        accumulates in float32, as llama.cpp's graph does."""
        lib, ctx, hp = self.lib, self.ctx, self.hp
        d, hkv, heads, f32 = hp.head_dim, hp.n_head_kv, hp.n_head, 4
        attn = self.placed(self.io.attn, ggml.GGML_TYPES["F32"])  # (H*D, R)
        scale = 1.0 if self.hp.spec.scale_q else float(np.float32(1.0 / np.sqrt(d)))
        for i, (seg, (_, start, n, keys)) in enumerate(zip(segments, layout.segments, strict=True)):
            ctx_size, type_k, type_v = seg.kv.ctx_size, seg.kv.layout.type_k, seg.kv.layout.type_v
            bk = type_k.value_bytes
            k_cache = self.placed(seg.kv.keys[slot], type_k.ggml_type)  # (D, ctx, Hkv)
            v_cache = self.placed(seg.kv.values[slot], type_v.ggml_type)  # (block, D, Hkv, blocks)
            k_new = lib.ggml_permute(ctx, lib.ggml_view_3d(ctx, k_all, d, hkv, n, d * f32, hkv * d * f32,
                                                           start * hkv * d * f32), 0, 2, 1, 3)  # (D, n, Hkv)
            k_cache = lib.ggml_set_rows(ctx, k_cache, k_new, self.placed(self.io.key_rows[i], ggml.GGML_I64))
            v_new = lib.ggml_reshape_2d(ctx, lib.ggml_view_2d(ctx, v_all, hkv * d, n, hkv * d * f32,
                                                              start * hkv * d * f32), 1, hkv * d * n)
            v_cells = lib.ggml_reshape_2d(ctx, v_cache, 1, seg.kv.values[slot].size)  # single values
            v_cache = lib.ggml_set_rows(ctx, v_cells, v_new, self.placed(self.io.value_cells[i], ggml.GGML_I64))
            # The reads below view the writes' results: the graph computes them after the writes.
            k = lib.ggml_view_3d(ctx, k_cache, d, keys, hkv, d * bk, ctx_size * d * bk, 0)
            mask = self.placed(self.io.masks[(i, lw.sliding_window)], ggml.GGML_TYPES["F32"])  # (keys, n)
            q = lib.ggml_permute(ctx, lib.ggml_view_3d(ctx, q_all, d, heads, n, d * f32, heads * d * f32,
                                                       start * heads * d * f32), 0, 2, 1, 3)  # (D, n, H)
            # The batch-invariant mode gives a lone row (a decode step attending apart) a duplicate: products of two
            # rows or more keep one order per element whatever the count, a one-row product takes another (pooled
            # decode rows already get a chunk row's bits: tests/compute/test_invariant.py).
            padded = self.invariant and n == 1
            if padded:
                q, mask = lib.ggml_concat(ctx, q, q, 1), lib.ggml_concat(ctx, mask, mask, 1)  # (D, 2, H), (keys, 2)
            width = 2 if padded else n
            scores = lib.ggml_soft_max_ext(ctx, lib.ggml_mul_mat(ctx, k, q), mask, scale, 0.0)  # (keys, width, H)
            weighted = self.values_times_scores(v_cache, scores, seg.kv.layout, keys, width, slots=1,
                                                slot_bytes=seg.kv.values[slot].nbytes)  # (D, width, H)
            if padded:
                weighted = lib.ggml_view_3d(ctx, weighted, d, 1, heads, d * f32, 2 * d * f32, 0)  # (D, 1, H)
            out = lib.ggml_permute(ctx, weighted, 0, 2, 1, 3)  # (D, H, n, 1)
            rows = lib.ggml_view_2d(ctx, attn, heads * d, n, heads * d * f32, start * heads * d * f32)
            # One copy from the permuted result into its rows (element order (D, H, n) is (H*D, n)'s).
            lib.ggml_build_forward_expand(self.graph, lib.ggml_cpy(ctx, out, rows))
        return attn

    def values_times_scores(self, values: int, scores: int, kv: KVLayout, keys: int, rows: int, *, slots: int,
                            slot_bytes: int) -> int:
        """(D, rows, H, slots): a layer's cached values (single values from the layer's first, in
        blocks of kv.value_block positions, `slots` caches `slot_bytes` apart) times the softmaxed
        scores (keys, rows, H, slots), one product per block of keys added in block order. A session
        within one block gets the one product over its row that llama.cpp's graph computes."""
        lib, ctx, hp = self.lib, self.ctx, self.hp
        d, hkv, block, bv, f32 = hp.head_dim, hp.n_head_kv, kv.value_block, kv.type_v.value_bytes, 4
        total: int | None = None
        for index in range(-(-keys // block)):
            span = min(block, keys - index * block)
            v = lib.ggml_view_4d(ctx, values, span, d, hkv, slots, block * bv, d * block * bv, slot_bytes,
                                 index * hkv * d * block * bv)  # (span, D, Hkv, S)
            s = lib.ggml_view_4d(ctx, scores, span, rows, hp.n_head, slots, keys * f32, keys * rows * f32,
                                 keys * rows * hp.n_head * f32, index * block * f32)  # (span, rows, H, S)
            product = int(lib.ggml_mul_mat(ctx, v, s))
            total = product if total is None else int(lib.ggml_add(ctx, total, product))
        assert total is not None, "a session attends at least one key"
        return total

    def pooled_attention(self, lw: LayerTensors, slot: int, layout: Layout, segments: Sequence[Segment],
                         q_all: int, k_all: int, v_all: int) -> int:
        """`attention` for the pooled decode rows (`segments`, one row each), every slot in one set
        of operations: the rows' keys and values written into their slots with one write each,
        each slot's query taken from its row, one strided view of the pool's keys and values per
        layer (in their cache types); (H*D, R). In a pass of pooled rows only the results are
        gathered back in row order; beside rows that attend apart, they are written into their
        rows of io.attn, which `attention` fills for the others."""
        lib, ctx, hp = self.lib, self.ctx, self.hp
        d, s, keys, hkv = hp.head_dim, layout.pool_slots, layout.pooled_keys, hp.n_head_kv
        first = segments[0].kv
        assert first.slot is not None
        pool, ctx_size, kv = first.slot.pool, first.ctx_size, first.layout
        bk, bv = kv.type_k.value_bytes, kv.type_v.value_bytes
        mixed = bool(layout.segments)
        k_rows, v_rows = lib.ggml_reshape_2d(ctx, k_all, d * hkv, self.rows), v_all  # (Hkv*D, R) each
        if mixed:  # the pooled rows' keys and values only, (Hkv*D, P) each
            batch_rows = self.placed(self.io.pooled_batch_rows, ggml.GGML_I32)
            k_rows, v_rows = lib.ggml_get_rows(ctx, k_rows, batch_rows), lib.ggml_get_rows(ctx, v_rows, batch_rows)
        n = layout.pooled_rows
        whole_k = self.placed(pool.array(kv.type_k), kv.type_k.ggml_type)
        whole_v = self.placed(pool.array(kv.type_v), kv.type_v.ggml_type)
        # The pool from this layer's keys in slot 0 on, as rows of D values; its values as single values.
        k_offset, v_offset = slot * kv.key_layer_bytes, kv.values_offset + slot * kv.value_layer_bytes
        k_dest = lib.ggml_view_2d(ctx, whole_k, d, (pool.nbytes - k_offset) // (d * bk), d * bk, k_offset)
        v_dest = lib.ggml_view_2d(ctx, whole_v, 1, (pool.nbytes - v_offset) // bv, bv, v_offset)
        k_cache = lib.ggml_set_rows(ctx, k_dest, lib.ggml_reshape_2d(ctx, k_rows, d, hkv * n),
                                    self.placed(self.io.pool_key_rows, ggml.GGML_I64))
        v_cache = lib.ggml_set_rows(ctx, v_dest, lib.ggml_reshape_2d(ctx, v_rows, 1, hkv * d * n),
                                    self.placed(self.io.pool_value_cells, ggml.GGML_I64))
        q_rows = lib.ggml_reshape_2d(ctx, q_all, hp.n_head * d, self.rows)
        q_pool = lib.ggml_get_rows(ctx, q_rows, self.placed(self.io.row_of_slot, ggml.GGML_I32))  # (H*D, S)
        q = lib.ggml_permute(ctx, lib.ggml_reshape_4d(ctx, q_pool, d, hp.n_head, 1, s), 0, 2, 1, 3)  # (D, 1, H, S)
        # Views of the writes' results, so that the graph reads after it writes.
        k = lib.ggml_view_4d(ctx, k_cache, d, keys, hkv, s, d * bk, ctx_size * d * bk, pool.slot_bytes,
                             0)  # (D, keys, Hkv, S)
        mask = self.placed(self.io.pool_masks[lw.sliding_window], ggml.GGML_TYPES["F32"])  # (keys, 1, 1, S)
        scale = 1.0 if self.hp.spec.scale_q else float(np.float32(1.0 / np.sqrt(d)))
        scores = lib.ggml_soft_max_ext(ctx, lib.ggml_mul_mat(ctx, k, q), mask, scale, 0.0)  # (keys, 1, H, S)
        weighted = self.values_times_scores(v_cache, scores, kv, keys, 1, slots=s, slot_bytes=pool.slot_bytes)
        out = lib.ggml_cont(ctx, lib.ggml_permute(ctx, weighted, 0, 2, 1, 3))  # (D, H, 1, S)
        results = lib.ggml_get_rows(ctx, lib.ggml_reshape_2d(ctx, out, hp.n_head * d, s),
                                    self.placed(self.io.pooled_slots, ggml.GGML_I32))  # (H*D, P)
        if not mixed:
            return int(results)
        attn = self.placed(self.io.attn, ggml.GGML_TYPES["F32"])  # (H*D, R)
        lib.ggml_build_forward_expand(self.graph, lib.ggml_set_rows(ctx, attn, results, batch_rows))
        return attn

    def post_attention(self, lw: LayerTensors, x: int, attn: int) -> int:
        """The output product, post-norm and residual, then the gated FFN and its residual; (E, R)."""
        lib, ctx = self.lib, self.ctx
        out = self.mul_mat(lw["attn_output"], attn)
        if lw.has("post_attention_norm"):
            out = self.norm(out, lw["post_attention_norm"])
        x = lib.ggml_add(ctx, out, x)
        h = self.norm(x, lw["ffn_norm"])
        if lw.has("ffn_gate_inp"):
            ffn = self.experts(lw, h)
        else:
            gate, up = self.mul_mat(lw["ffn_gate"], h), self.mul_mat(lw["ffn_up"], h)
            ffn = self.mul_mat(lw["ffn_down"], getattr(lib, self.glu)(ctx, gate, up))
        if lw.has("post_ffw_norm"):
            ffn = self.norm(ffn, lw["post_ffw_norm"])
        return int(lib.ggml_add(ctx, ffn, x))

    def experts(self, lw: LayerTensors, h: int) -> int:
        """The expert layer of normed rows h (E, R), as llama.cpp's build_moe_ffn builds it for a
        softmax router: router logits (n_expert, R), softmax, the k = n_expert_used best experts per
        row (ggml_argsort_top_k), their probabilities as weights (renormalised to sum 1 where the
        architecture says, the sum clamped at f16's smallest normal), each row's k experts' gated
        FFNs as three grouped products (ggml_mul_mat_id: the CPU backend groups the pass's rows by
        expert, so each selected expert's blocks are read once per pass), each output times its
        weight, then the k outputs added in order; (E, R)."""
        lib, ctx, hp = self.lib, self.ctx, self.hp
        n_expert, k, e, rows = hp.n_expert, hp.n_expert_used, hp.n_embd, self.rows
        logits = ggml.mul_mat(lib, ctx, lw["ffn_gate_inp"], h)  # (n_expert, R)
        probs = lib.ggml_soft_max(ctx, logits)
        selected = lib.ggml_argsort_top_k(ctx, probs, k)  # (k, R) I32
        weights = lib.ggml_get_rows(ctx, lib.ggml_reshape_3d(ctx, probs, 1, n_expert, rows), selected)  # (1, k, R)
        if hp.spec.norm_expert_weights:
            weights = lib.ggml_reshape_2d(ctx, weights, k, rows)
            sums = lib.ggml_clamp(ctx, lib.ggml_sum_rows(ctx, weights), F16_SMALLEST_NORMAL, float("inf"))  # (1, R)
            weights = lib.ggml_reshape_3d(ctx, lib.ggml_div(ctx, weights, sums), 1, k, rows)
        lib.ggml_build_forward_expand(self.graph, weights)
        cur = lib.ggml_reshape_3d(ctx, h, e, 1, rows)
        up = expert_products.mul_mat_id(lib, ctx, lw["ffn_up_exps"], cur, selected)  # (ff, k, R)
        gate = expert_products.mul_mat_id(lib, ctx, lw["ffn_gate_exps"], cur, selected)
        act = getattr(lib, self.glu)(ctx, gate, up)
        down = expert_products.mul_mat_id(lib, ctx, lw["ffn_down_exps"], act, selected)
        out = lib.ggml_mul(ctx, down, weights)  # (E, k, R)
        lib.ggml_build_forward_expand(self.graph, out)
        f32 = 4
        # views of each of the k outputs first, then their sum in order (llama.cpp orders them so)
        views = [lib.ggml_view_2d(ctx, out, e, rows, e * k * f32, i * e * f32) for i in range(k)]
        for view in views:
            lib.ggml_build_forward_expand(self.graph, view)
        total = views[0]
        for view in views[1:]:
            total = lib.ggml_add(ctx, total, view)
            lib.ggml_build_forward_expand(self.graph, total)
        if k == 1:
            total = lib.ggml_cont(ctx, total)
        if lw.has("ffn_gate_inp_shexp"):  # llama.cpp's qwen2moe: the shared expert, gated by a sigmoid
            gate_in = ggml.mul_mat(lib, ctx, lw["ffn_gate_inp_shexp"], h)  # (1, R)
            sigmoid = lib.ggml_div(ctx, lib.ggml_silu(ctx, gate_in), gate_in)  # as llama.cpp computes it
            shared_up = ggml.mul_mat(lib, ctx, lw["ffn_up_shexp"], h)
            shared_gate = ggml.mul_mat(lib, ctx, lw["ffn_gate_shexp"], h)
            shared = ggml.mul_mat(lib, ctx, lw["ffn_down_shexp"], getattr(lib, self.glu)(ctx, shared_gate, shared_up))
            total = lib.ggml_add(ctx, total, lib.ggml_mul(ctx, shared, sigmoid))
        return int(total)


F16_SMALLEST_NORMAL = 6.103515625e-5
"""The floor of a row's sum of expert weights before it divides them (llama.cpp's, against a zero sum)."""


def invariant_refusal(hp: ModelHParams, types: set[str], unrepacked: Sequence[str]) -> str | None:
    """Why the batch-invariant mode cannot hold every row in one order on this file (docs/ARCHITECTURE.md,
    "Batch-invariant mode"), or None where it can: products of matrix `types` in ggml.INVARIANT_TYPES, no Q4_K
    matrix left `unrepacked` (its one-row GEMV order is the package's product's over the repacked layout), no
    expert layer (ggml groups a pass's rows by expert)."""
    others = sorted(types - ggml.INVARIANT_TYPES)
    if others:
        return (f"the batch-invariant mode holds one order per row for "
                f"{', '.join(sorted(ggml.INVARIANT_TYPES))} matrices; this file has {', '.join(others)}")
    if unrepacked:
        return (f"the batch-invariant mode multiplies Q4_K matrices repacked (SKIPPY_ZMQ_REPACK=1, the default); "
                f"{unrepacked[0]} is not")
    if hp.has_experts:
        return "the batch-invariant mode does not cover expert layers yet (ggml groups a pass's rows by expert)"
    return None


def resolve_invariant(asked: bool | None, refusal: str | None, *, where: str) -> bool:
    """Whether to compute batch-invariantly: `asked` True requires it (ModelLoadError naming the `refusal`),
    False declines it, None (the default, "auto") takes it wherever there is no refusal."""
    if asked and refusal is not None:
        raise ModelLoadError(f"{where}: {refusal}")
    return refusal is None if asked is None else asked


class BlockGraphs:
    """Blocks [layer_start, layer_end) of a model as ggml graphs over the file's blocks."""

    def __init__(self, model: GGUFModel, layer_start: int, layer_end: int, threads: int,
                 repack: bool = False, *, invariant: bool | None = False) -> None:
        """Bind the blocks' tensors where they lie in the file's mapping (nothing is copied), or, with
        `repack`, the matrices the CPU backend repacks in its interleaved layout (copied once); with
        `invariant`, every row is computed in one order whatever its pass (None: wherever the file allows it,
        `resolve_invariant`; `refusal` then says why not)."""
        hp = model.hparams
        self.lib = ggml.Library.get()
        self.backend = ggml.Backend.shared(threads)
        self.hparams = hp
        self.layers: list[LayerTensors] = []
        self._weights: list[ggml.Weights] = []
        self.nbytes = 0
        self.repacked_bytes = 0
        self.huge_bytes = 0  # of the weights' copies, asked to live on huge pages (compute/huge_pages.py)
        self.types: set[str] = set()  # the matrices' types
        product_types: set[str] = set()  # of those multiplied (not the norms and biases: (n, 1) vectors)
        unrepacked: list[str] = []  # Q4_K matrices left in the file's layout
        rope_factors = self._rope_factors(model)
        for il in range(layer_start, layer_end):
            matrices = _layer_matrices(model, il)
            self.types.update(m.type_name for m in matrices)
            product_types.update(m.type_name for m in matrices if m.n > 1)
            weights = ggml.Weights(self.lib, matrices, str(model.path), repack=repack)
            unrepacked += [m.name for m, t in zip(matrices, weights.tensors, strict=True)
                           if m.type_name == "Q4_K" and not ggml.repacked(self.lib, t)]
            self._weights.append(weights)
            self.nbytes += sum(m.data.nbytes for m in matrices)
            self.repacked_bytes += weights.repacked_bytes
            self.huge_bytes += weights.huge_bytes
            named: dict[str, int | None] = dict.fromkeys(_OPTIONAL)
            named.update({_tensor_key(m.name): t for m, t in zip(matrices, weights.tensors, strict=True)})
            self.layers.append(LayerTensors(index=il, rope_base=hp.layer_rope_base(il),
                                            rope_scale=hp.layer_rope_scale(il), rope_factors=rope_factors,
                                            tensors=named,
                                            sliding_window=hp.sliding_window if hp.is_sliding_layer(il) else 0))
        self._graphs: OrderedDict[Layout, _LayoutGraphs] = OrderedDict()
        self._lock = threading.Lock()
        self.refusal = invariant_refusal(hp, product_types, unrepacked)
        self.invariant = resolve_invariant(invariant, self.refusal, where=str(model.path))

    @property
    def products_note(self) -> str:
        """Who multiplies the blocks' Q6_K matrices and, where they are repacked, their Q4_K ones at 2 rows or
        more, and an expert file's experts, for the stage's load line (empty where it has none of them)."""
        note = f"; Q6_K matrices by {ggml.q6k_described()}" if "Q6_K" in self.types else ""
        if "Q4_K" in self.types and self.repacked_bytes:
            note += f"; repacked Q4_K matrices at 2 rows or more by {ggml.q4k_described()}"
        if self.hparams.has_experts:
            note += f"; {expert_products.described()}"
        return note

    @property
    def pages_note(self) -> str:
        """How much of the weights asked for huge pages and how much of the process the kernel put on
        them, for the stage's load line (empty where none asked)."""
        if not self.huge_bytes:
            return ""
        return (f"; {self.huge_bytes / 2**30:.2f} GiB of them asked for huge pages "
                f"({huge_pages.huge_bytes() / 2**30:.2f} GiB of the process is on them)")

    def _rope_factors(self, model: GGUFModel) -> int | None:
        """The file's RoPE frequency factors as one tensor every layer's RoPE reads, or None."""
        factors = model.rope_freq_factors()
        if factors is None:
            return None
        matrix = BlockMatrix(name=ROPE_FREQS, type_name="F32", k=factors.size, n=1, data=factors.view(np.uint8))
        weights = ggml.Weights(self.lib, [matrix], str(model.path))
        self._weights.append(weights)
        return weights.tensors[0]

    def run(self, x: F32, segments: Sequence[Segment], positions: npt.NDArray[np.int64]) -> F32:
        """The residual stream (R, E) after the blocks; stores each block's keys and values.

        The caches need values transposed (`KVCacheSet(values_transposed=True)`)."""
        pooled, apart = split_pooled(segments)
        layout = Layout.of(int(x.shape[0]), pooled, apart)
        with self._lock:
            graphs = self._layout_graphs(layout, pooled, apart)
            io = graphs.io
            io.x[:] = x
            io.positions[:] = positions
            io.fill(positions, layout, apart)
            if layout.pooled_keys:
                io.fill_pooled(positions, pooled)
            with self.backend.lock:
                self.backend.compute(graphs.graph)
            return io.out.copy()

    def _layout_graphs(self, layout: Layout, pooled: Sequence[Segment], apart: Sequence[Segment]) -> _LayoutGraphs:
        if any(not seg.kv.values_transposed for seg in (*pooled, *apart)):
            raise ModelLoadError("the ggml kernel's graphs read values transposed; open the caches with "
                                 "KVCacheSet(values_transposed=True)")
        graphs = self._graphs.get(layout)
        if graphs is None:
            graphs = self._graphs[layout] = _LayoutGraphs(self, layout, pooled, apart)
            while len(self._graphs) > 1 and (len(self._graphs) > GRAPH_LAYOUTS or
                                             sum(g.nbytes for g in self._graphs.values()) > GRAPH_BUFFER_BYTES):
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(layout)
        return graphs


class NormedHead:
    """The last stage's output norm and head: (R, E) -> (R, n_vocab). The norm is a ggml graph per row
    count; the head's product is in the same graph, or MatMulNBits' (compute/nbits_head.py)."""

    def __init__(self, model: GGUFModel, head: str, threads: int, repack: bool = False,
                 nbits: NbitsHead | None = None, *, invariant: bool | None = False) -> None:
        """Bind the output norm and the head matrix (`output.weight`, or the tied embedding table); with
        `repack`, a head of a type the CPU backend repacks is copied into its layout (ggml.Weights); with
        `nbits` (built over the same matrix), the product is ONNX Runtime's MatMulNBits."""
        hp = model.hparams
        norm = model.load_f32("output_norm.weight", (hp.n_embd,))
        self.lib = ggml.Library.get()
        self.backend = ggml.Backend.shared(threads)
        self.hparams = hp
        matrix = model.block_matrix(head, (hp.n_vocab, hp.n_embd))
        norm_matrix = BlockMatrix(name="output_norm.weight", type_name="F32", k=hp.n_embd, n=1,
                                       data=norm.view(np.uint8))
        if nbits is not None and (nbits.out_features, nbits.in_features) != (hp.n_vocab, hp.n_embd):
            raise ModelLoadError(f"{model.path}: a MatMulNBits head of {nbits.out_features} x {nbits.in_features} "
                                 f"given for {head!r}, which is {hp.n_vocab} x {hp.n_embd}")
        self.nbits = nbits
        self.weights = ggml.Weights(self.lib, [norm_matrix] if self.nbits else [matrix, norm_matrix],
                                    str(model.path), repack=repack)
        self.refusal: str | None = None  # MatMulNBits: a row's logits do not depend on its batch already
        if nbits is None:
            unrepacked = [head] if matrix.type_name == "Q4_K" and not ggml.repacked(
                self.lib, self.weights.tensors[0]) else []
            self.refusal = invariant_refusal(hp, {matrix.type_name}, unrepacked)
        # the head's products in one order per row (BlockGraphs)
        self.invariant = resolve_invariant(invariant, self.refusal, where=str(model.path))
        self.norm = norm  # (n_embd,) output_norm.weight, which the norm-only graphs read too
        self.nbytes = (self.nbits.weight_bytes if self.nbits else matrix.data.nbytes) + norm.nbytes
        self.in_features, self.out_features = hp.n_embd, hp.n_vocab
        self._graphs: OrderedDict[int, ggml.Graph] = OrderedDict()
        self._norm_graphs: OrderedDict[int, ggml.Graph] = OrderedDict()

    @property
    def product(self) -> str:
        """Who computes the head's product, for a stage's load line."""
        if self.nbits:
            return "ONNX Runtime's MatMulNBits"
        head_type = ggml.TensorHead.of(self.weights.tensors[0]).type
        if head_type == ggml.GGML_TYPES["Q6_K"]:
            return ggml.q6k_described()
        if head_type == ggml.GGML_TYPES["Q8_0"]:
            return ggml.q80_described()
        return "ggml"

    @property
    def weight_bytes(self) -> int:
        """The head's blocks and the norm's float32."""
        return self.nbytes

    def __call__(self, x: F32, *, reuse: bool = False) -> F32:
        """Logits (R, n_vocab) of hidden states (R, E); with `reuse`, the graph's own output array
        (no copy of R x n_vocab floats), which the next call of as many rows overwrites."""
        if self.nbits is not None:
            return self.nbits(self._compute(self._norm_graphs, x, with_head=False), reuse=reuse)
        return self._compute(self._graphs, x, with_head=True, reuse=reuse)

    def normed(self, x: F32) -> F32:
        """The output norm of hidden states (R, E) -> (R, E): the rows the head multiplies
        (llama.cpp's `result_norm`, which it pools for embeddings)."""
        return self._compute(self._norm_graphs, x, with_head=False)

    def _compute(self, graphs: OrderedDict[int, ggml.Graph], x: F32, *, with_head: bool,
                 reuse: bool = False) -> F32:
        rows = int(x.shape[0])
        with self.backend.lock:
            graph = graphs.get(rows)
            if graph is None:
                graph = graphs[rows] = self._build(rows, with_head)
                while len(graphs) > GRAPH_LAYOUTS:
                    graphs.popitem(last=False)
            else:
                graphs.move_to_end(rows)
            np.copyto(graph.x, x, casting="same_kind")
            self.backend.compute(graph.graph)
            return graph.outputs[0] if reuse else graph.outputs[0].copy()

    def _build(self, rows: int, with_head: bool) -> ggml.Graph:
        norm = self.weights.tensors[-1]
        head = self.weights.tensors[0]  # read only by graphs `with_head`, never built with `nbits`
        lib, eps = self.lib, self.hparams.rms_eps

        def normed(ctx: int, x: int) -> int:
            return int(lib.ggml_mul(ctx, lib.ggml_rms_norm(ctx, x, eps), norm))

        def logits(ctx: int, x: int) -> list[int]:
            return [ggml.mul_mat(lib, ctx, head, normed(ctx, x), invariant=self.invariant)]

        if not with_head:
            return ggml.Graph(lib, self.in_features, rows, lambda ctx, x: [normed(ctx, x)], [self.in_features])
        return ggml.Graph(lib, self.in_features, rows, logits, [self.out_features])
