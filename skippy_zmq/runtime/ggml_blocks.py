"""A stage's transformer blocks as ggml graphs over the file's own blocks (docs/ARCHITECTURE.md, "Kernels").

With the `ggml` kernel a block is not a chain of numpy steps between products: everything but
the attention itself runs in ggml, in the operations and the order llama.cpp's graph for the
architecture uses (RMSNorm, the products, per-head q/k norms, RoPE, the q scale; the output
product, post-norms, residual adds, the gated FFN). Between two attentions there is one graph:
step s of a stage with L layers is the post-attention half of layer s-1 followed by the
pre-attention half of layer s (step 0 has only the latter, step L only the former), so a pass
costs L + 1 graph computations and L numpy attentions over the sessions' KV caches.

Graphs are built once per row count and step and kept (`GRAPH_ROW_COUNTS` row counts); their
inputs and outputs are numpy arrays the graph's tensors are placed on (`ggml.HostArrays`), and
the intermediate tensors of a row count's graphs share one buffer, sized for the largest.
Shapes: R rows, E = n_embd, H heads, Hkv KV heads, D head_dim.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.runtime import ggml
from skippy_zmq.runtime.layers import Segment, attend
from skippy_zmq.runtime.model import GGUFModel, ModelHParams

F32 = npt.NDArray[np.float32]

GRAPH_ROW_COUNTS = 16
"""Row counts whose graphs (L + 1 each) a stage keeps; the least recently used goes first."""
ROPE_MODES = {False: 0, True: 2}
"""ggml's RoPE mode by `ArchSpec.rope_neox`: 0 rotates pairs (2i, 2i+1), 2 (NEOX) pairs (i, i + D/2)."""

_OPTIONAL = frozenset({"attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"})


@attrs.frozen
class LayerTensors:
    """ggml tensor handles of one block's weights (None: the architecture has no such weight)."""

    index: int
    rope_base: float
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


def _layer_matrices(model: GGUFModel, il: int) -> list[ggml.BlockMatrix]:
    """Block il's matrices as the file stores them, and its norms as F32 (n, 1) matrices."""
    hp = model.hparams
    spec = hp.spec
    e, d, ff = hp.n_embd, hp.head_dim, hp.n_ff
    q_dim, kv_dim = hp.n_head * d, hp.n_head_kv * d
    p = f"blk.{il}."
    present = {"attn_q_norm": spec.qk_norm, "attn_k_norm": spec.qk_norm,
               "post_attention_norm": spec.post_norms, "post_ffw_norm": spec.post_norms}
    norms = {"attn_norm": e, "attn_q_norm": d, "attn_k_norm": d, "post_attention_norm": e, "ffn_norm": e,
             "post_ffw_norm": e}
    matrices = [model.block_matrix(p + name + ".weight", shape) for name, shape in (
        ("attn_q", (q_dim, e)), ("attn_k", (kv_dim, e)), ("attn_v", (kv_dim, e)), ("attn_output", (e, q_dim)),
        ("ffn_gate", (ff, e)), ("ffn_up", (ff, e)), ("ffn_down", (e, ff)))]
    for name, n in norms.items():
        if present.get(name, True):
            values = model.load_f32(p + name + ".weight", (n,))
            matrices.append(ggml.BlockMatrix(name=p + name + ".weight", type_name="F32", k=n, n=1,
                                             data=values.view(np.uint8)))
    return matrices


class _IO:
    """The numpy arrays a row count's graphs read and write, with ggml tensors placed on them."""

    def __init__(self, lib: ggml.Library, hp: ModelHParams, rows: int) -> None:
        d = hp.head_dim
        self.host = ggml.HostArrays(lib)
        self.x = (self.host.empty((rows, hp.n_embd)), self.host.empty((rows, hp.n_embd)))  # ping, pong
        self.attn = self.host.empty((rows, hp.n_head * d))
        self.q = self.host.empty((rows, hp.n_head, d))
        self.k = self.host.empty((rows, hp.n_head_kv, d))
        self.v = self.host.empty((rows, hp.n_head_kv, d))
        self.positions = self.host.empty((rows,), np.int32)


class _RowGraphs:
    """The L + 1 step graphs of one row count, their arrays, and one buffer for their intermediates.

    ggml's graph allocator gives a graph's intermediate tensors their addresses once, and a tensor
    that has an address keeps it; so the buffer must never move after that: every graph is first
    reserved (the buffer grows to the largest), then allocated, and the size is checked unchanged.
    The graphs run one after another, so their intermediates may share the bytes.
    """

    def __init__(self, owner: BlockGraphs, rows: int) -> None:
        lib = owner.lib
        self.lib = lib
        self.io = _IO(lib, owner.hparams, rows)
        self.allocator = lib.ggml_gallocr_new(lib.ggml_backend_cpu_buffer_type())
        self.steps = [_Step(owner, self.io, s) for s in range(len(owner.layers) + 1)]
        for step in self.steps:
            if not lib.ggml_gallocr_reserve(self.allocator, step.graph):
                raise ModelLoadError(f"ggml could not reserve the intermediate tensors of a block graph of {rows} rows")
        size = lib.ggml_gallocr_get_buffer_size(self.allocator, 0)
        for step in self.steps:
            if not lib.ggml_gallocr_alloc_graph(self.allocator, step.graph):
                raise ModelLoadError(f"ggml could not allocate the intermediates of a block graph of {rows} rows")
        if lib.ggml_gallocr_get_buffer_size(self.allocator, 0) != size:
            raise ModelLoadError(f"ggml moved the intermediate buffer of the block graphs of {rows} rows while "
                                 f"allocating them ({size} bytes reserved)")

    def __del__(self) -> None:
        lib = getattr(self, "lib", None)
        self.steps = []
        if lib is not None and getattr(self, "allocator", None):
            lib.ggml_gallocr_free(self.allocator)


class _Step:
    """The graph of one step at one row count, built from the layers around it."""

    def __init__(self, owner: BlockGraphs, io: _IO, step: int) -> None:
        lib, hp = owner.lib, owner.hparams
        self.lib = lib
        nodes = 64
        self.ctx = lib.ggml_init(ggml.InitParams(
            lib.ggml_tensor_overhead() * nodes + lib.ggml_graph_overhead_custom(nodes, False), None, True))
        self.graph = lib.ggml_new_graph_custom(self.ctx, nodes, False)
        # Step 0 reads the stage's input from x[0]; step s >= 1 reads what step s - 1 wrote.
        self.reads = io.x[0] if step <= 1 else io.x[(step + 1) % 2]
        self.writes = io.x[step % 2]
        build = _Builder(lib, self.ctx, hp, io)
        x = build.placed(self.reads, ggml.GGML_TYPES["F32"])
        if step > 0:
            x = build.post_attention(owner.layers[step - 1], x, build.placed(io.attn, ggml.GGML_TYPES["F32"]))
            build.place(x, self.writes)
            lib.ggml_build_forward_expand(self.graph, x)
        if step < len(owner.layers):
            for out in build.pre_attention(owner.layers[step], x,
                                           build.placed(io.positions, ggml.GGML_I32)):
                lib.ggml_build_forward_expand(self.graph, out)

    def __del__(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is not None and getattr(self, "ctx", None):
            lib.ggml_free(self.ctx)


class _Builder:
    """Adds one block's halves to a graph context, as llama.cpp's graph for the architecture does."""

    def __init__(self, lib: ggml.Library, ctx: int, hp: ModelHParams, io: _IO) -> None:
        self.lib, self.ctx, self.hp, self.io = lib, ctx, hp, io
        self.rows = int(io.positions.shape[0])

    def placed(self, array: npt.NDArray[Any], type_id: int) -> int:
        """A tensor of `array`'s shape (reversed: ggml's ne0 is numpy's last axis) over its memory."""
        shape = array.shape[::-1]
        if len(shape) == 1:
            tensor = self.lib.ggml_new_tensor_1d(self.ctx, type_id, *shape)
        elif len(shape) == 2:
            tensor = self.lib.ggml_new_tensor_2d(self.ctx, type_id, *shape)
        else:
            tensor = self.lib.ggml_new_tensor_3d(self.ctx, type_id, *shape)
        self.place(tensor, array)
        return int(tensor)

    def place(self, tensor: int, array: npt.NDArray[Any]) -> None:
        """Put a graph's tensor (an input, or the result of an operation) on `array`'s memory."""
        self.io.host.place(tensor, array)

    def norm(self, x: int, weight: int) -> int:
        """RMSNorm over ne0, times the weight (llama.cpp's build_norm, LLM_NORM_RMS)."""
        return int(self.lib.ggml_mul(self.ctx, self.lib.ggml_rms_norm(self.ctx, x, self.hp.rms_eps), weight))

    def rope(self, x: int, positions: int, base: float) -> int:
        """RoPE of (D, heads, R) by each row's position: no scaling, no YaRN (ext_factor 0)."""
        hp = self.hp
        return int(self.lib.ggml_rope_ext(self.ctx, x, positions, None, hp.head_dim, ROPE_MODES[hp.rope_neox],
                                          hp.n_ctx_train, base, 1.0, 0.0, 1.0, 32.0, 1.0))

    def pre_attention(self, lw: LayerTensors, x: int, positions: int) -> tuple[int, int, int]:
        """attn_norm, the q/k/v products, the q/k norms, RoPE and q's scale; outputs on io.q, io.k, io.v."""
        lib, ctx, hp, r = self.lib, self.ctx, self.hp, self.rows
        d = hp.head_dim
        h = self.norm(x, lw["attn_norm"])
        q = lib.ggml_reshape_3d(ctx, lib.ggml_mul_mat(ctx, lw["attn_q"], h), d, hp.n_head, r)  # (D, H, R)
        k = lib.ggml_reshape_3d(ctx, lib.ggml_mul_mat(ctx, lw["attn_k"], h), d, hp.n_head_kv, r)  # (D, Hkv, R)
        v = int(lib.ggml_mul_mat(ctx, lw["attn_v"], h))  # (Hkv*D, R)
        if lw.has("attn_q_norm"):
            q, k = self.norm(q, lw["attn_q_norm"]), self.norm(k, lw["attn_k_norm"])
        q = lib.ggml_scale(ctx, self.rope(q, positions, lw.rope_base), float(np.float32(1.0 / np.sqrt(d))))
        k = self.rope(k, positions, lw.rope_base)
        for tensor, array in ((q, self.io.q), (k, self.io.k), (v, self.io.v)):
            self.place(tensor, array)
        return int(q), int(k), v

    def post_attention(self, lw: LayerTensors, x: int, attn: int) -> int:
        """The output product, post-norm and residual, then the gated FFN and its residual; (E, R)."""
        lib, ctx = self.lib, self.ctx
        out = lib.ggml_mul_mat(ctx, lw["attn_output"], attn)
        if lw.has("post_attention_norm"):
            out = self.norm(out, lw["post_attention_norm"])
        x = lib.ggml_add(ctx, out, x)
        h = self.norm(x, lw["ffn_norm"])
        gate, up = lib.ggml_mul_mat(ctx, lw["ffn_gate"], h), lib.ggml_mul_mat(ctx, lw["ffn_up"], h)
        glu = lib.ggml_geglu_split if self.hp.spec.name == "gemma3" else lib.ggml_swiglu_split
        ffn = lib.ggml_mul_mat(ctx, lw["ffn_down"], glu(ctx, gate, up))
        if lw.has("post_ffw_norm"):
            ffn = self.norm(ffn, lw["post_ffw_norm"])
        return int(lib.ggml_add(ctx, ffn, x))


class BlockGraphs:
    """Blocks [layer_start, layer_end) of a model as ggml graphs over the file's blocks."""

    def __init__(self, model: GGUFModel, layer_start: int, layer_end: int, threads: int) -> None:
        """Bind the blocks' tensors where they lie in the file's mapping (nothing is copied)."""
        hp = model.hparams
        if hp.spec.name not in ("gemma3", "llama"):
            raise ModelLoadError(f"{model.path}: the ggml kernel has no graph for architecture {hp.spec.name!r}")
        self.lib = ggml.Library.get()
        self.backend = ggml.Backend.shared(threads)
        self.hparams = hp
        self.layers: list[LayerTensors] = []
        self._weights: list[ggml.Weights] = []
        self.nbytes = 0
        for il in range(layer_start, layer_end):
            matrices = _layer_matrices(model, il)
            weights = ggml.Weights(self.lib, matrices, str(model.path))
            self._weights.append(weights)
            self.nbytes += sum(m.data.nbytes for m in matrices)
            named: dict[str, int | None] = dict.fromkeys(_OPTIONAL)
            named.update({m.name.split(".")[2]: t for m, t in zip(matrices, weights.tensors, strict=True)})
            self.layers.append(LayerTensors(index=il, rope_base=hp.layer_rope_base(il), tensors=named,
                                            sliding_window=hp.sliding_window if hp.is_sliding_layer(il) else 0))
        self._graphs: OrderedDict[int, _RowGraphs] = OrderedDict()
        self._lock = threading.Lock()

    def run(self, x: F32, segments: Sequence[Segment], positions: npt.NDArray[np.int64]) -> F32:
        """The residual stream (R, E) after the blocks; stores each block's keys and values."""
        rows = int(x.shape[0])
        with self._lock:
            graphs = self._row_graphs(rows)
            io = graphs.io
            io.x[0][:] = x
            io.positions[:] = positions
            for step, graph in enumerate(graphs.steps):
                with self.backend.lock:
                    self.backend.compute(graph.graph)
                if step < len(self.layers):
                    self._attend(io, step, segments, positions)
            return graphs.steps[-1].writes.copy()

    def _attend(self, io: _IO, slot: int, segments: Sequence[Segment], positions: npt.NDArray[np.int64]) -> None:
        """Each session's queries against its cached keys (this step's stored first); into io.attn."""
        window = self.layers[slot].sliding_window
        for seg in segments:
            rows = slice(seg.row_start, seg.row_start + seg.n_rows)
            seg.kv.store(slot, seg.pos_start, io.k[rows], io.v[rows])
            key_start = max(0, seg.pos_start - window + 1) if window > 0 else 0
            keys, values = seg.kv.view(slot, key_start, seg.pos_start + seg.n_rows)
            io.attn[rows] = attend(io.q[rows], keys, values, positions[rows], key_start, window)

    def _row_graphs(self, rows: int) -> _RowGraphs:
        graphs = self._graphs.get(rows)
        if graphs is None:
            graphs = self._graphs[rows] = _RowGraphs(self, rows)
            while len(self._graphs) > GRAPH_ROW_COUNTS:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(rows)
        return graphs


class NormedHead:
    """The last stage's output norm and head as one ggml graph per row count: (R, E) -> (R, n_vocab)."""

    def __init__(self, model: GGUFModel, head: str, threads: int) -> None:
        """Bind the output norm and the head matrix (`output.weight`, or the tied embedding table)."""
        hp = model.hparams
        norm = model.load_f32("output_norm.weight", (hp.n_embd,))
        self.lib = ggml.Library.get()
        self.backend = ggml.Backend.shared(threads)
        self.hparams = hp
        matrix = model.block_matrix(head, (hp.n_vocab, hp.n_embd))
        self.weights = ggml.Weights(self.lib, [
            matrix, ggml.BlockMatrix(name="output_norm.weight", type_name="F32", k=hp.n_embd, n=1,
                                     data=norm.view(np.uint8))], str(model.path))
        self.nbytes = matrix.data.nbytes + norm.nbytes
        self.in_features, self.out_features = hp.n_embd, hp.n_vocab
        self._graphs: OrderedDict[int, ggml.Graph] = OrderedDict()

    @property
    def weight_bytes(self) -> int:
        """The head's blocks and the norm's float32."""
        return self.nbytes

    def __call__(self, x: F32) -> F32:
        """Logits (R, n_vocab) of hidden states (R, E)."""
        rows = int(x.shape[0])
        with self.backend.lock:
            graph = self._graphs.get(rows)
            if graph is None:
                graph = self._graphs[rows] = self._build(rows)
                while len(self._graphs) > GRAPH_ROW_COUNTS:
                    self._graphs.popitem(last=False)
            else:
                self._graphs.move_to_end(rows)
            np.copyto(graph.x, x, casting="same_kind")
            self.backend.compute(graph.graph)
            return graph.outputs[0].copy()

    def _build(self, rows: int) -> ggml.Graph:
        head, norm = self.weights.tensors
        lib, eps = self.lib, self.hparams.rms_eps

        def logits(ctx: int, x: int) -> list[int]:
            return [int(lib.ggml_mul_mat(ctx, head, lib.ggml_mul(ctx, lib.ggml_rms_norm(ctx, x, eps), norm)))]

        return ggml.Graph(lib, self.in_features, rows, logits, [self.out_features])
