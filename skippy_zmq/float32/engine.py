"""The float32 engine behind the stage runtime: a stage's layers dequantized to float32 (or mapped from
the weight cache) and multiplied by ONNX Runtime or numpy (docs/ARCHITECTURE.md, "Kernels").

Both products compute in float32 from the same weights; only the order of the additions differs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.compute.kv_cache import Segment
from skippy_zmq.errors import ModelLoadError
from skippy_zmq.float32.layers import Block, LayerWeights, RopeTable, block, load_layer, rms_norm
from skippy_zmq.float32.projections import Projection
from skippy_zmq.float32.weight_cache import CacheEntry, WeightCache
from skippy_zmq.model.gguf_model import GGUFModel, ModelHParams, head_tensor_name

F32 = npt.NDArray[np.float32]


class FloatEngine:
    """Layers [start, end) as float32 `Block`s and the last stage's `FloatHead`."""

    values_transposed = False
    pool_slots = 0

    def __init__(self, blocks: list[Block], head: FloatHead | None, hp: ModelHParams, note: str = "") -> None:
        """Hold bound blocks and head; use FloatEngine.load."""
        self.blocks = blocks
        self.head = head
        self.hparams = hp
        self.note = note  # what the stage's load line adds: the weight cache's summary
        # numpy's and ONNX Runtime's products choose their blocking by row count: no claim of one order per row
        self.invariant = False

    @classmethod
    def load(cls, model: GGUFModel, layer_start: int, layer_end: int, ctx_size: int, *,
             bind: Callable[[F32], Projection], cache: WeightCache | None, say: Callable[[str], None],
             started: float) -> FloatEngine:
        """Dequantize (or map from `cache`) the layers' weights and hand their matrices to `bind`."""
        if model.hparams.has_experts:
            # Dequantized to float32, Q4_K experts would take seven times their bytes in the file.
            raise ModelLoadError(f"{model.path}: the float32 kernels have no expert layer and this file's layers "
                                 f"are {model.hparams.n_expert} experts each; run it on the ggml kernel, the "
                                 "default (SKIPPY_ZMQ_KERNEL=ggml, or kernel = \"ggml\" in the topology's stage; "
                                 "docs/ARCHITECTURE.md, \"The expert layer\")")
        entry = _cache_entry(cache, model)
        blocks = _load_blocks(model, (layer_start, layer_end), ctx_size, bind, entry, say, started)
        head = None
        if layer_end == model.hparams.n_layer:
            output_norm, head_t = _load_head(model, head_tensor_name(model.header), entry, say)
            head = FloatHead(output_norm, bind(head_t), model.hparams.rms_eps)
        note = "" if entry is None else f"; {entry.summary()}"
        if cache is not None and entry is not None:
            _after_use(cache, entry)
        return cls(blocks, head, model.hparams, note)

    @property
    def weight_bytes(self) -> int:
        """Float32 bytes of the blocks and the head."""
        return sum(b.n_bytes() for b in self.blocks) + (self.head.weight_bytes if self.head is not None else 0)

    def run(self, x: F32, segments: Sequence[Segment], positions: npt.NDArray[np.int64]) -> F32:
        """The residual stream after the layers: (R, n_embd) -> (R, n_embd)."""
        for slot, layer in enumerate(self.blocks):
            x = block(x, layer, slot, self.hparams, segments, positions)
        return x


@attrs.frozen(eq=False)
class FloatHead:
    """The output norm in numpy, then the head's float32 product: (R, n_embd) -> (R, n_vocab)."""

    norm: F32  # (n_embd,)
    head: Projection
    eps: float

    @property
    def in_features(self) -> int:
        """n_embd."""
        return self.head.in_features

    @property
    def out_features(self) -> int:
        """n_vocab."""
        return self.head.out_features

    @property
    def weight_bytes(self) -> int:
        """The norm's and the head's bytes."""
        return self.norm.nbytes + self.head.weight_bytes

    def __call__(self, x: F32, *, reuse: bool = False) -> F32:
        """Logits of hidden states: a new array (R, n_vocab) whatever `reuse` says."""
        return self.head(self.normed(x))

    def normed(self, x: F32) -> F32:
        """The output norm of hidden states, the rows the head multiplies: (R, n_embd)."""
        return rms_norm(x, self.norm, self.eps)


# ---------------------------------------------------------------- weight cache

_FROM_CACHE = " from the weight cache"
_LAYER_SCALARS = frozenset({"index", "sliding_window", "rope"})


def _layer_shapes(hp: ModelHParams) -> dict[str, tuple[int, ...] | None]:
    """Shape of every array field of LayerWeights (None: the architecture has no such weight)."""
    e, d, ff = hp.n_embd, hp.head_dim, hp.n_ff
    q_dim, kv_dim = hp.n_head * d, hp.n_head_kv * d
    qk, post = hp.spec.qk_norm, hp.spec.post_norms
    return {
        "attn_norm": (e,), "wqkv_t": (e, q_dim + 2 * kv_dim),
        "qkv_bias": (q_dim + 2 * kv_dim,) if hp.spec.qkv_bias else None,
        "q_norm": (d,) if qk else None, "k_norm": (d,) if qk else None,
        "wo_t": (q_dim, e), "post_attn_norm": (e,) if post else None, "ffn_norm": (e,),
        "w_gate_up_t": (e, 2 * ff), "w_down_t": (ff, e), "post_ffw_norm": (e,) if post else None,
    }


# The code whose output the cache holds: a change to any of it makes a new cache entry.
_PRODUCERS = (load_layer, LayerWeights, GGUFModel.load_f32, GGUFModel.load_f32_transposed,
              _layer_shapes)


def _load_blocks(model: GGUFModel, layers: tuple[int, int], ctx_size: int, bind: Callable[[F32], Projection],
                 cache: CacheEntry | None,
                 say: Callable[[str], None], started: float) -> list[Block]:
    """The blocks of layers [start, end) with float32 matrices (from `cache` when it holds them),
    bound by `bind`."""
    hp = model.hparams
    ropes: dict[tuple[float, float], RopeTable] = {}
    factors = model.rope_freq_factors()
    blocks: list[Block] = []
    start, end = layers
    for il in range(start, end):
        rope = (hp.layer_rope_base(il), hp.layer_rope_scale(il))
        if rope not in ropes:
            ropes[rope] = RopeTable.build(ctx_size, hp.head_dim, *rope, freq_factors=factors,
                                          scaling=hp.rope_scaling, n_ctx_orig=hp.rope_n_ctx_orig)
        layer, mapped = _load_layer(model, il, ropes[rope], cache)
        # The kernel may keep its own copy; the loaded arrays are then dropped here.
        blocks.append(Block.bind(layer, bind))
        del layer
        say(f"loaded layer {il} ({il - start + 1}/{end - start}) "
            f"in {time.perf_counter() - started:.1f}s{_FROM_CACHE if mapped else ''}")
    return blocks


def _cache_entry(cache: WeightCache | None, model: GGUFModel) -> CacheEntry | None:
    """The cache entry of this model file, or None (no cache, or LayerWeights changed shape)."""
    if cache is None:
        return None
    fields = {f.name for f in attrs.fields(LayerWeights)}
    if fields != set(_layer_shapes(model.hparams)) | _LAYER_SCALARS:
        return None  # layers.py holds other arrays now; _layer_shapes must learn them first
    try:
        return cache.entry(model.path, _PRODUCERS)
    except OSError:
        return None


def _after_use(cache: WeightCache, entry: CacheEntry) -> None:
    """Mark the entry used and keep the cache within its bound."""
    entry.touch()
    if entry.stores:
        # Another process may be pruning the same files; the next load tries again.
        with contextlib.suppress(OSError):
            cache.prune(keep=entry.directory)


def _load_layer(model: GGUFModel, il: int, rope: RopeTable, cache: CacheEntry | None
                ) -> tuple[LayerWeights, bool]:
    """Layer il memory-mapped from the cache when all its arrays are there (True), else
    dequantized and stored (False)."""
    hp = model.hparams
    if cache is None:
        return load_layer(model, il, rope), False
    shapes = _layer_shapes(hp)
    arrays: dict[str, Any] = {}  # field name -> F32 | None, as LayerWeights' keywords
    for name, shape in shapes.items():
        arrays[name] = None if shape is None else cache.load(f"blk.{il}.{name}", shape)
        if shape is not None and arrays[name] is None:
            break
    else:
        window = hp.sliding_window if hp.is_sliding_layer(il) else 0
        return LayerWeights(index=il, sliding_window=window, rope=rope, **arrays), True
    layer = load_layer(model, il, rope)
    stored: dict[str, Any] = {}
    for name, shape in shapes.items():
        value: F32 | None = getattr(layer, name)
        if value is not None and shape is not None and value.shape == shape:
            value = cache.store(f"blk.{il}.{name}", value)
        stored[name] = value
    return attrs.evolve(layer, **stored), False


def _load_head(model: GGUFModel, head: str, cache: CacheEntry | None, say: Callable[[str], None]
               ) -> tuple[F32, F32]:
    """The output norm (n_embd,) and the head transposed (n_embd, n_vocab)."""
    hp = model.hparams
    norm_shape, head_shape = (hp.n_embd,), (hp.n_embd, hp.n_vocab)
    if cache is not None:
        norm, head_t = cache.load("output_norm", norm_shape), cache.load("output_t", head_shape)
        if norm is not None and head_t is not None:
            say(f"loading output head {head} ({model.tensor_type_name(head)}){_FROM_CACHE}")
            return norm, head_t
    say(f"loading output head {head} ({model.tensor_type_name(head)})")
    norm = model.load_f32("output_norm.weight", norm_shape)
    head_t = model.load_f32_transposed(head, (hp.n_vocab, hp.n_embd))
    if cache is not None:
        norm, head_t = cache.store("output_norm", norm), cache.store("output_t", head_t)
    return norm, head_t
