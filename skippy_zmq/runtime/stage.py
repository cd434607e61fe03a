"""StageRuntime: layers [layer_start, layer_end) of a GGUF model with per-session KV caches."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.defaults import CACHE_TYPE
from skippy_zmq.errors import ModelLoadError, SessionError, StageError
from skippy_zmq.runtime.ggml_blocks import POOL_SLOTS, BlockGraphs, NormedHead
from skippy_zmq.runtime.kernels import Kernel, Projection
from skippy_zmq.runtime.kv_cache import KVCacheSet, SessionKV
from skippy_zmq.runtime.layers import (
    Block,
    LayerWeights,
    RopeTable,
    Segment,
    embed_scale,
    load_layer,
    rms_norm,
)
from skippy_zmq.runtime.model import GGUFModel, ModelHParams, RowTable, head_tensor_name
from skippy_zmq.runtime.nbits_head import NbitsHead
from skippy_zmq.runtime.weight_cache import CacheEntry, WeightCache

F32 = npt.NDArray[np.float32]


def _return_free_heap_to_os() -> None:
    """Ask glibc to give freed heap pages back (the GGUF reader leaves hundreds of MiB)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the memory is reused by later allocations instead


class StageRuntime:
    """One pipeline stage: embeds (first stage), runs its layers, and computes logits (last)."""

    def __init__(self, model: GGUFModel, layer_start: int, layer_end: int, ctx_size: int,
                 progress: Callable[[str], None] | None, cache: CacheEntry | None = None,
                 kernel: Kernel | None = None, cache_types: tuple[str, str] = (CACHE_TYPE, CACHE_TYPE)) -> None:
        """Load the stage's weights from an open model (or `cache`); use StageRuntime.load instead."""
        hp = model.hparams
        self.hparams: ModelHParams = hp
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.ctx_size = ctx_size
        self.is_first = layer_start == 0
        self.is_last = layer_end == hp.n_layer
        self.model_path = model.path
        say = progress or (lambda _msg: None)
        self.kernel = kernel if kernel is not None else Kernel.from_environment()
        # Before any weight is read, so that an unknown cache type fails at once.
        self._kv = KVCacheSet(layer_end - layer_start, hp.n_head_kv, hp.head_dim, ctx_size,
                              values_transposed=self.kernel.quantized,
                              pool_slots=POOL_SLOTS if self.kernel.quantized else 0,
                              type_k=cache_types[0], type_v=cache_types[1])
        self.cache_types = cache_types
        started = time.perf_counter()
        self._graphs, self.blocks, self.head = _bind_weights(model, (layer_start, layer_end), ctx_size,
                                                             self.kernel, cache, say, started)
        self._block = hp.spec.block
        self._embed_scale = embed_scale(hp)
        # Stage 0 keeps the (quantized, memory-mapped) table and dequantizes rows on demand.
        self._embd: RowTable | None = None
        if self.is_first:
            self._embd = model.row_table("token_embd.weight", (hp.n_vocab, hp.n_embd))
        note = "" if cache is None else f"; {cache.summary()}"
        say(f"stage layers [{layer_start}, {layer_end}) loaded in "
            f"{time.perf_counter() - started:.1f}s with {self.kernel.described}, "
            f"KV cache keys {cache_types[0]} values {cache_types[1]}{note}")

    @classmethod
    def load(cls, model_path: str | os.PathLike[str], layer_start: int, layer_end: int, *,
             ctx_size: int = 2048, progress: Callable[[str], None] | None = None,
             weight_cache: WeightCache | Literal["environment"] | None = "environment",
             kernel: Kernel | None = None, cache_type_k: str = CACHE_TYPE,
             cache_type_v: str = CACHE_TYPE) -> StageRuntime:
        """Open a GGUF model and load only the weights of layers [layer_start, layer_end).

        Dequantized weights come from (and go to) `weight_cache`: by default the one the
        environment configures (runtime/weight_cache.py); None dequantizes every time.
        Products run on `kernel` (default: Kernel.from_environment(), runtime/kernels.py).
        Keys and values are kept in `cache_type_k` and `cache_type_v` (runtime/kv_cache.py
        CACHE_TYPES; f16 by default, as llama.cpp).
        """
        if progress is not None:
            progress(f"reading GGUF metadata of {model_path}")
        model = GGUFModel(model_path)
        n_layer = model.hparams.n_layer
        if not 0 <= layer_start < layer_end <= n_layer:
            raise ModelLoadError(
                f"{model_path}: layer range [{layer_start}, {layer_end}) is invalid; expected "
                f"0 <= layer_start < layer_end <= n_layer = {n_layer}"
            )
        if ctx_size <= 0:
            raise ModelLoadError(f"{model_path}: ctx_size {ctx_size} must be > 0")
        kernel = kernel if kernel is not None else Kernel.from_environment()
        # A kernel that computes from the file's blocks has nothing to cache.
        cache = None if kernel.quantized else (
            WeightCache.from_environment() if weight_cache == "environment" else weight_cache)
        entry = _cache_entry(cache, model)
        stage = cls(model, layer_start, layer_end, ctx_size, progress, entry, kernel, (cache_type_k, cache_type_v))
        if cache is not None and entry is not None:
            _after_use(cache, entry)
        # Dequantizing leaves large temporaries behind; hand their pages back to the OS.
        del model
        gc.collect()
        _return_free_heap_to_os()
        return stage

    def weight_bytes(self) -> int:
        """Bytes of weights this stage reads: float32, or the file's blocks with a quantized kernel."""
        total = sum(block.n_bytes() for block in self.blocks)
        if self._graphs is not None:
            total += self._graphs.nbytes
        if self.head is not None:
            total += self.head.weight_bytes
        return total

    # ------------------------------------------------------------------ sessions

    def open_session(self, session_id: int) -> None:
        """Start an empty session; SessionError if it is already open."""
        self._kv.open(session_id)

    def fork_session(self, source_id: int, target_id: int, n_positions: int) -> None:
        """Start session `target_id` with a copy of the first n_positions positions of `source_id`'s
        KV cache (one prompt, several choices); SessionError if the source is not open, the target
        is, or n_positions exceeds the source's length."""
        self._kv.fork(source_id, target_id, n_positions)

    def close_session(self, session_id: int) -> None:
        """Free a session's KV cache; unknown ids are a no-op."""
        self._kv.close(session_id)

    def release_free_caches(self) -> int:
        """Give the pages of the pool's free slots back to the system (a freed slot keeps them for
        the next session, runtime/kv_cache.py `SlotPool`); how many slots."""
        return self._kv.pool.release() if self._kv.pool is not None else 0

    def has_session(self, session_id: int) -> bool:
        """Whether a session is open on this stage."""
        return session_id in self._kv

    def session_ids(self) -> list[int]:
        """Ids of the open sessions."""
        return self._kv.ids()

    def session_length(self, session_id: int) -> int:
        """Number of positions held in the session's KV cache."""
        return self._kv.get(session_id).length

    def trim_session(self, session_id: int, n_positions: int) -> None:
        """Keep the first n_positions positions; SessionError if n_positions > length."""
        self._kv.get(session_id).trim(n_positions)

    def check_step(self, session_id: int, pos_start: int, n_tokens: int, *, what: str = "pos_start") -> None:
        """SessionError unless `n_tokens` at `pos_start` continue the session and fit the context.

        The one position rule (docs/PROTOCOL.md §5): a stage checks each message with it before
        batching, so a bad row fails alone, and `forward`/`forward_batch` apply it again.
        """
        _check_step(self._kv.get(session_id), pos_start, n_tokens, self.ctx_size, what)

    # ------------------------------------------------------------------ compute

    def forward(self, session_id: int, pos_start: int, inputs: np.ndarray) -> F32:
        """Run a chunk of T tokens (first stage) or hidden states of one session; (T, n_embd)."""
        kv = self._kv.get(session_id)
        x = self._input_rows(inputs, "forward")
        n = x.shape[0]
        _check_step(kv, pos_start, n, self.ctx_size, "pos_start")
        positions = np.arange(pos_start, pos_start + n, dtype=np.int64)
        out = self._run_layers(x, [Segment(kv, 0, n, pos_start)], positions)
        kv.length += n
        return out

    def forward_batch(self, session_ids: Sequence[int], positions: Sequence[int],
                      inputs: np.ndarray) -> F32:
        """Decode one token for each of B sessions as one batch; (B, n_embd)."""
        return self.forward_many(session_ids, positions, [1] * len(session_ids), inputs, where="forward_batch")

    def forward_many(self, session_ids: Sequence[int], positions: Sequence[int], counts: Sequence[int],
                     inputs: np.ndarray, *, where: str = "forward_many") -> F32:
        """Several sessions in one pass over the weights: `counts[i]` rows of session
        `session_ids[i]` from position `positions[i]` (prefill chunks and decode steps alike);
        inputs and output rows are in that order; (sum(counts), n_embd)."""
        b = len(session_ids)
        if b == 0 or len(positions) != b or len(counts) != b or min(counts, default=0) < 1:
            raise StageError(
                f"{where}: got {b} session ids, {len(positions)} positions and counts {list(counts)}; "
                "expected the same non-zero number of each and every count >= 1"
            )
        kvs = self._kv.get_many(session_ids)
        for kv, pos, n in zip(kvs, positions, counts, strict=True):
            _check_step(kv, pos, n, self.ctx_size, "position")
        x = self._input_rows(inputs, where)
        total = sum(counts)
        if x.shape[0] != total:
            raise StageError(f"{where}: inputs have {x.shape[0]} rows, expected {total}")
        pos_rows = np.empty(total, dtype=np.int64)
        segments = []
        row = 0
        for kv, pos, n in zip(kvs, positions, counts, strict=True):
            segments.append(Segment(kv, row, n, int(pos)))
            pos_rows[row : row + n] = np.arange(pos, pos + n)
            row += n
        out = self._run_layers(x, segments, pos_rows)
        for kv, n in zip(kvs, counts, strict=True):
            kv.length += n
        return out

    def logits(self, hidden: np.ndarray, *, reuse: bool = False) -> F32:
        """Output norm and head of the final stage: (T, n_embd) -> (T, n_vocab). With `reuse` the
        result may be the head's own buffer, valid until the head's next call: for a caller that
        reads (or changes) the rows before it projects again, without a copy of T x n_vocab."""
        if self.head is None:
            raise StageError(
                f"logits: stage [{self.layer_start}, {self.layer_end}) is not the final stage "
                f"(n_layer = {self.hparams.n_layer}); it has no output head"
            )
        h = self._hidden_rows(hidden, "logits")
        if isinstance(self.head, NormedHead):
            return self.head(h, reuse=reuse)  # (T, n_vocab)
        return self.head(h)  # (T, n_vocab), a new array

    def normed(self, hidden: np.ndarray) -> F32:
        """The final stage's output norm of hidden rows, exactly the rows its head multiplies (what
        embeddings pool, docs/PROTOCOL.md §7 "Session forks and embeddings"): (T, n_embd) -> (T, n_embd);
        StageError on another stage."""
        if self.head is None:
            raise StageError(
                f"normed: stage [{self.layer_start}, {self.layer_end}) is not the final stage "
                f"(n_layer = {self.hparams.n_layer}); it has no output norm"
            )
        return self.head.normed(self._hidden_rows(hidden, "normed"))  # (T, n_embd)

    def _run_layers(self, x: F32, segments: list[Segment], positions: npt.NDArray[np.int64]
                    ) -> F32:
        """The residual stream after this stage's layers; (R, n_embd)."""
        for seg in segments:  # before the pass writes them, so a failed pass's rows are cleared too
            seg.kv.will_write(seg.pos_start + seg.n_rows)
        if self._graphs is not None:
            return self._graphs.run(x, segments, positions)
        for slot, block in enumerate(self.blocks):
            x = self._block(x, block, slot, self.hparams, segments, positions)
        return x

    def _input_rows(self, inputs: np.ndarray, where: str) -> F32:
        """Token ids embedded (first stage) or hidden states checked; (R, n_embd) float32."""
        if not self.is_first:
            return self._hidden_rows(inputs, where)
        if not isinstance(inputs, np.ndarray) or inputs.dtype != np.int32 or inputs.ndim != 1:
            got = (f"{inputs.dtype} {inputs.shape}" if isinstance(inputs, np.ndarray)
                   else type(inputs).__name__)
            raise StageError(f"{where}: the first stage takes int32 (T,) token ids; got {got}")
        if inputs.shape[0] == 0:
            raise StageError(f"{where}: empty token chunk; expected at least one token")
        n_vocab = self.hparams.n_vocab
        if int(inputs.min()) < 0 or int(inputs.max()) >= n_vocab:
            raise StageError(f"{where}: token ids {inputs.tolist()} must be in [0, {n_vocab})")
        return self._embed(inputs)

    def _embed(self, ids: npt.NDArray[np.int32]) -> F32:
        """Embedding rows of the token ids, dequantized one row each; (T, n_embd)."""
        assert self._embd is not None
        x = self._embd.rows(ids.astype(np.int64))
        if self._embed_scale is not None:
            x *= np.float32(self._embed_scale)
        return x

    def _hidden_rows(self, hidden: np.ndarray, where: str) -> F32:
        """Check hidden states are float32 (R, n_embd) with R >= 1."""
        n_embd = self.hparams.n_embd
        if (not isinstance(hidden, np.ndarray) or hidden.dtype != np.float32
                or hidden.ndim != 2 or hidden.shape[1] != n_embd or hidden.shape[0] == 0):
            got = (f"{hidden.dtype} {hidden.shape}" if isinstance(hidden, np.ndarray)
                   else type(hidden).__name__)
            raise StageError(f"{where}: expected float32 (T, {n_embd}) hidden states; got {got}")
        return np.ascontiguousarray(hidden)


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

    def __call__(self, x: F32) -> F32:
        """Logits of hidden states."""
        return self.head(self.normed(x))

    def normed(self, x: F32) -> F32:
        """The output norm of hidden states, the rows the head multiplies: (R, n_embd)."""
        return rms_norm(x, self.norm, self.eps)


def _check_step(kv: SessionKV, pos_start: int, n_tokens: int, ctx_size: int, what: str) -> None:
    if pos_start != kv.length:
        raise SessionError(
            f"session {kv.session_id}: {what} {pos_start} does not match the "
            f"{kv.length} positions held in the KV cache"
        )
    if kv.length + n_tokens > ctx_size:
        raise SessionError(
            f"session {kv.session_id}: {kv.length} + {n_tokens} positions exceed the context "
            f"size {ctx_size}"
        )


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
        "q_norm": (d,) if qk else None, "k_norm": (d,) if qk else None,
        "wo_t": (q_dim, e), "post_attn_norm": (e,) if post else None, "ffn_norm": (e,),
        "w_gate_up_t": (e, 2 * ff), "w_down_t": (ff, e), "post_ffw_norm": (e,) if post else None,
    }


# The code whose output the cache holds: a change to any of it makes a new cache entry.
_PRODUCERS = (load_layer, LayerWeights, GGUFModel.load_f32, GGUFModel.load_f32_transposed,
              _layer_shapes)


def _load_blocks(model: GGUFModel, layers: tuple[int, int], ctx_size: int, kernel: Kernel, cache: CacheEntry | None,
                 say: Callable[[str], None], started: float) -> list[Block]:
    """The blocks of layers [start, end) with float32 matrices (from `cache` when it holds them),
    bound to the kernel."""
    hp = model.hparams
    ropes: dict[tuple[float, float], RopeTable] = {}
    factors = model.rope_freq_factors()
    blocks: list[Block] = []
    start, end = layers
    for il in range(start, end):
        rope = (hp.layer_rope_base(il), hp.layer_rope_scale(il))
        if rope not in ropes:
            ropes[rope] = RopeTable.build(ctx_size, hp.head_dim, *rope, freq_factors=factors)
        layer, mapped = _load_layer(model, il, ropes[rope], cache)
        # The kernel may keep its own copy; the loaded arrays are then dropped here.
        blocks.append(Block.bind(layer, kernel))
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


def _bind_weights(model: GGUFModel, layers: tuple[int, int], ctx_size: int, kernel: Kernel,
                  cache: CacheEntry | None, say: Callable[[str], None], started: float
                  ) -> tuple[BlockGraphs | None, list[Block], FloatHead | NormedHead | None]:
    """A stage's layers (ggml graphs over the file's blocks, or float32 blocks) and, on the last stage,
    its output norm and head ((n_embd) -> (n_vocab))."""
    start, end = layers
    graphs: BlockGraphs | None = None
    blocks: list[Block] = []
    is_last = end == model.hparams.n_layer
    # A MatMulNBits head is decoded and packed on a thread of its own while the layers bind: numpy
    # and ONNX Runtime let go of the GIL for nearly all of it (0.9 s of Gemma 3 270M's start).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="head") as pool:
        nbits = _start_nbits_head(model, kernel, pool) if is_last else None
        if kernel.quantized:  # the matrices stay the file's blocks, in its mapping
            graphs = BlockGraphs(model, start, end, kernel.threads, kernel.repack)
            say(f"bound layers [{start}, {end}) as ggml graphs over the file's blocks "
                f"in {time.perf_counter() - started:.1f}s{graphs.pages_note}{graphs.products_note}")
        else:
            blocks = _load_blocks(model, layers, ctx_size, kernel, cache, say, started)
        head = _bind_head(model, kernel, cache, say, None if nbits is None else nbits.result()) if is_last else None
    return graphs, blocks, head


def _start_nbits_head(model: GGUFModel, kernel: Kernel, pool: ThreadPoolExecutor) -> Future[NbitsHead] | None:
    """The MatMulNBits head being built on `pool`, where the kernel multiplies by it (Kernel.head_by_nbits)."""
    head = head_tensor_name(model.header)
    if not kernel.head_by_nbits(model.tensor_type_name(head), f"{model.path}: tensor {head!r}"):
        return None
    hp = model.hparams
    return pool.submit(NbitsHead, model.block_matrix(head, (hp.n_vocab, hp.n_embd)), kernel.threads,
                       str(model.path))


def _bind_head(model: GGUFModel, kernel: Kernel, cache: CacheEntry | None, say: Callable[[str], None],
               nbits: NbitsHead | None) -> FloatHead | NormedHead:
    """The output norm and head on `kernel`; a quantized kernel's product is `nbits` where it is given."""
    head = head_tensor_name(model.header)
    if kernel.quantized:
        type_name = model.tensor_type_name(head)
        bound = NormedHead(model, head, kernel.threads, kernel.repack, nbits=nbits)
        say(f"binding output head {head} ({type_name}) from the file's blocks; products by {bound.product}")
        return bound
    output_norm, head_t = _load_head(model, head, cache, say)
    return FloatHead(output_norm, kernel.bind(head_t), model.hparams.rms_eps)


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
