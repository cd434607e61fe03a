"""StageRuntime: layers [layer_start, layer_end) of a GGUF model with per-session KV caches."""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from skippy_zmq.compute.kv_cache import KVCacheSet, Segment, SessionKV
from skippy_zmq.defaults import CACHE_TYPE
from skippy_zmq.errors import ModelLoadError, SessionError, StageError
from skippy_zmq.float32.weight_cache import WeightCache
from skippy_zmq.model.gguf_model import GGUFModel, ModelHParams, RowTable
from skippy_zmq.runtime.kernels import Kernel, StageEngine, StageHead

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
                 progress: Callable[[str], None] | None, cache: WeightCache | None = None,
                 kernel: Kernel | None = None, cache_types: tuple[str, str] = (CACHE_TYPE, CACHE_TYPE)) -> None:
        """Load the stage's weights from an open model on the kernel's engine; use StageRuntime.load instead."""
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
        engine_type = self.kernel.engine
        self._kv = KVCacheSet(layer_end - layer_start, hp.n_head_kv, hp.head_dim, ctx_size,
                              values_transposed=engine_type.values_transposed, pool_slots=engine_type.pool_slots,
                              type_k=cache_types[0], type_v=cache_types[1])
        self.cache_types = cache_types
        started = time.perf_counter()
        self.engine: StageEngine = self.kernel.load_engine(model, layer_start, layer_end, ctx_size, cache=cache,
                                                           say=say, started=started)
        self._embed_scale = hp.embed_scale
        # Stage 0 keeps the (quantized, memory-mapped) table and dequantizes rows on demand.
        self._embd: RowTable | None = None
        if self.is_first:
            self._embd = model.row_table("token_embd.weight", (hp.n_vocab, hp.n_embd))
        say(f"stage layers [{layer_start}, {layer_end}) loaded in "
            f"{time.perf_counter() - started:.1f}s with {self.kernel.described}, "
            f"KV cache keys {cache_types[0]} values {cache_types[1]}{self.engine.note}")

    @classmethod
    def load(cls, model_path: str | os.PathLike[str], layer_start: int, layer_end: int, *,
             ctx_size: int = 2048, progress: Callable[[str], None] | None = None,
             weight_cache: WeightCache | Literal["environment"] | None = "environment",
             kernel: Kernel | None = None, cache_type_k: str = CACHE_TYPE,
             cache_type_v: str = CACHE_TYPE) -> StageRuntime:
        """Open a GGUF model and load only the weights of layers [layer_start, layer_end).

        Dequantized weights come from (and go to) `weight_cache`: by default the one the
        environment configures (float32/weight_cache.py); None dequantizes every time.
        Products run on `kernel` (default: Kernel.from_environment(), runtime/kernels.py).
        Keys and values are kept in `cache_type_k` and `cache_type_v` (compute/kv_cache.py
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
        stage = cls(model, layer_start, layer_end, ctx_size, progress, cache, kernel, (cache_type_k, cache_type_v))
        # Dequantizing leaves large temporaries behind; hand their pages back to the OS.
        del model
        gc.collect()
        _return_free_heap_to_os()
        return stage

    @property
    def head(self) -> StageHead | None:
        """The output norm and head on the last stage, else None."""
        return self.engine.head

    @property
    def invariant(self) -> bool:
        """True when a row's numbers do not depend on its pass (docs/ARCHITECTURE.md, "Batch-invariant mode")."""
        return self.engine.invariant

    def weight_bytes(self) -> int:
        """Bytes of weights this stage reads: float32, or the file's blocks with a quantized kernel."""
        return self.engine.weight_bytes

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
        the next session, compute/kv_cache.py `SlotPool`); how many slots."""
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
        return self.head(self._hidden_rows(hidden, "logits"), reuse=reuse)  # (T, n_vocab)

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
        return self.engine.run(x, segments, positions)

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
