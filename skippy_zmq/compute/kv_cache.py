"""Per-session key/value cache for the layers one stage runs."""

from __future__ import annotations

import contextlib
import itertools
import mmap
from collections.abc import Iterator, Sequence
from typing import ClassVar

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq import defaults
from skippy_zmq.errors import ConfigError, SessionError


@attrs.frozen
class CacheType:
    """A type the KV cache may store keys or values in: its name as llama.cpp's `--cache-type-k`
    spells it, the numpy dtype, bytes per value and ggml's type id (docs/ARCHITECTURE.md, "Kernels")."""

    name: str
    dtype: np.dtype[np.floating]
    value_bytes: int
    ggml_type: int

    def __attrs_post_init__(self) -> None:
        if self.dtype.itemsize != self.value_bytes:
            raise ConfigError(f"cache type {self.name!r}: numpy dtype {self.dtype} holds {self.dtype.itemsize} "
                              f"bytes per value; the table says {self.value_bytes}")


CACHE_TYPES: dict[str, CacheType] = {row.name: row for row in (
    CacheType("f32", np.dtype(np.float32), 4, 0),  # GGML_TYPE_F32
    CacheType("f16", np.dtype(np.float16), 2, 1),  # GGML_TYPE_F16, llama.cpp's default
)}
"""The KV cache types by llama.cpp's names; each row's dtype is checked against its width at import."""
if tuple(CACHE_TYPES) != defaults.CACHE_TYPE_NAMES:  # the command line offers the names before numpy loads
    raise ConfigError(f"compute/kv_cache.py: CACHE_TYPES has {list(CACHE_TYPES)} but defaults.CACHE_TYPE_NAMES "
                      f"says {list(defaults.CACHE_TYPE_NAMES)}; expected the same names in the same order")


def cache_type(name: str, where: str = "the KV cache") -> CacheType:
    """The row of a cache type named as llama.cpp names it; ConfigError naming the accepted ones."""
    row = CACHE_TYPES.get(name)
    if row is None:
        raise ConfigError(f"{where}: cache type {name!r} is unknown; expected one of {', '.join(CACHE_TYPES)}")
    return row


def kv_bytes_per_position(n_layers: int, n_head_kv: int, head_dim: int, type_k: str, type_v: str) -> int:
    """Bytes one session's cache holds per position over n_layers layers (keys plus values)."""
    values = n_layers * n_head_kv * head_dim
    return values * (cache_type(type_k, "type_k").value_bytes + cache_type(type_v, "type_v").value_bytes)


VALUE_BLOCK = 256
"""Positions per block of a transposed values cache (at most its context): a layer's values are kept
(blocks, Hkv, D, block), each block holding every value row of its positions, so a session touches
the pages of the blocks its positions reach, not one page per value row of the whole context (a
session of Gemma 3 270M at 2,048 positions: 2.3 instead of 18 MiB of pages while it is shorter than
256; docs/BENCHMARKS.md at commit f9d1290, "Values in blocks of 256 positions"). Attention sums one product per block
(compute/graphs.py); a session shorter than a block gets the bits of one product over its row."""

_LAYER_ALIGN = 64
"""Each layer's keys (and values) start at a multiple of this many bytes: ggml places a tensor only
on an address aligned to 32 (compute/ggml.py), whatever the cache type and dimensions."""


@attrs.frozen
class KVLayout:
    """Where a session's keys and values lie in its bytes: every layer's keys, then every layer's
    values, each layer `*_layer_bytes` apart, in their own cache types."""

    n_layers: int
    n_head_kv: int
    head_dim: int
    ctx_size: int
    type_k: CacheType
    type_v: CacheType
    value_block: int  # positions per block of transposed values (`VALUE_BLOCK`, at most ctx_size)

    @classmethod
    def of(cls, n_layers: int, n_head_kv: int, head_dim: int, ctx_size: int, type_k: str, type_v: str) -> KVLayout:
        """The layout of these dimensions with keys and values in types named as llama.cpp names them."""
        return cls(n_layers, n_head_kv, head_dim, ctx_size, cache_type(type_k, "type_k"), cache_type(type_v, "type_v"),
                   max(1, min(VALUE_BLOCK, ctx_size)))

    @property
    def value_blocks(self) -> int:
        """Blocks of `value_block` positions that cover the context."""
        return -(-self.ctx_size // self.value_block)

    def _layer_bytes(self, row: CacheType, positions: int) -> int:
        raw = self.n_head_kv * positions * self.head_dim * row.value_bytes
        return -(-raw // _LAYER_ALIGN) * _LAYER_ALIGN

    @property
    def key_layer_bytes(self) -> int:
        """Bytes from one layer's keys to the next layer's."""
        return self._layer_bytes(self.type_k, self.ctx_size)

    @property
    def value_layer_bytes(self) -> int:
        """Bytes from one layer's values to the next layer's (whole blocks of positions)."""
        return self._layer_bytes(self.type_v, self.value_blocks * self.value_block)

    @property
    def values_offset(self) -> int:
        """Where layer 0's values start."""
        return self.n_layers * self.key_layer_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of one session's keys and values at full context."""
        return self.values_offset + self.n_layers * self.value_layer_bytes


def _block_spans(start: int, end: int, block: int) -> Iterator[tuple[int, int, int, int]]:
    """Positions [start, end) block by block: (block index, first and end offset in the block,
    offset of the span from `start`)."""
    for index in range(start // block, -(-end // block)):
        low, high = max(start, index * block), min(end, (index + 1) * block)
        yield index, low - index * block, high - index * block, low - start


class SessionKV:
    """Keys and values of one session for a stage's layers, positions [0, length), each in its
    cache type (`CACHE_TYPES`; f32 unless told: the exact store).

    The arrays are views of one anonymous memory mapping at full context size: the operating
    system backs only the pages that positions reach, and opening a session touches none.
    (np.zeros gave no such promise: once glibc had raised its mmap threshold, after large
    buffers were freed while a stage loaded, it came from the heap and was zeroed at once;
    tests/compute/test_kv_cache.py sets up that allocator state, docs/ARCHITECTURE.md "Runtime" the cost.)
    """

    _serials: ClassVar[Iterator[int]] = itertools.count(1)

    def __init__(self, session_id: int, n_layers: int, n_head_kv: int, head_dim: int,
                 ctx_size: int, *, values_transposed: bool = False, slot: SlotPool.Slot | None = None,
                 type_k: str = "f32", type_v: str = "f32") -> None:
        """Allocate empty keys and values for n_layers layers of ctx_size positions (in a slot of a
        `SlotPool` when given one); with `values_transposed`, values are kept transposed in blocks of
        positions, (blocks, n_head_kv, head_dim, block), as ggml's products read them
        (`VALUE_BLOCK`, compute/graphs.py)."""
        self.session_id = session_id
        self.serial = next(self._serials)  # never reused in the process, unlike session ids and addresses
        self.ctx_size = ctx_size
        self.length = 0
        self.written = 0  # positions [0, written) may hold values: what `clear` zeroes
        self.values_transposed = values_transposed
        self.slot = slot
        self.layout = layout = KVLayout.of(n_layers, n_head_kv, head_dim, ctx_size, type_k, type_v)
        if slot is None:
            # Anonymous and private: zero pages until written, returned when the last view goes.
            self._memory: mmap.mmap | memoryview = mmap.mmap(-1, layout.nbytes)
        else:
            self._memory = slot.memory
        # per layer: (n_head_kv, ctx_size, head_dim); head-major so one head's keys are contiguous
        self.keys: list[npt.NDArray[np.floating]] = [
            np.ndarray((n_head_kv, ctx_size, head_dim), layout.type_k.dtype, self._memory,
                       il * layout.key_layer_bytes) for il in range(n_layers)]
        # per layer: (n_head_kv, ctx_size, head_dim), or transposed (blocks, n_head_kv, head_dim, block)
        value_shape = ((layout.value_blocks, n_head_kv, head_dim, layout.value_block) if values_transposed
                       else (n_head_kv, ctx_size, head_dim))
        self.values: list[npt.NDArray[np.floating]] = [
            np.ndarray(value_shape, layout.type_v.dtype, self._memory,
                       layout.values_offset + il * layout.value_layer_bytes) for il in range(n_layers)]

    @property
    def memory_key(self) -> tuple[int, int]:
        """Names the memory the cache lives in, for graphs built over its addresses: a pool slot's
        (pool serial, slot index), the same for every session the slot holds while the pool lives;
        (0, serial) for a cache of its own, never reused in the process."""
        if self.slot is not None:
            return (self.slot.pool.serial, self.slot.index)
        return (0, self.serial)

    def store(self, layer: int, pos_start: int, k: npt.NDArray[np.float32],
              v: npt.NDArray[np.float32]) -> None:
        """Write keys/values (T, n_head_kv, head_dim) of one layer at positions pos_start.., in the
        cache types.

        numpy rounds float32 to f16 to the nearest, ties to even, as ggml's own conversion does
        (F16C's _cvtss_sh with rounding mode 0, or its portable bit arithmetic) when llama.cpp
        copies new rows into an f16 cache; tests/compute/test_kv_cache.py compares the two."""
        n = k.shape[0]
        self.will_write(pos_start + n)
        self.keys[layer][:, pos_start:pos_start + n, :] = k.transpose(1, 0, 2)
        if self.values_transposed:
            for block, low, high, at in _block_spans(pos_start, pos_start + n, self.layout.value_block):
                self.values[layer][block, :, :, low:high] = v[at:at + high - low].transpose(1, 2, 0)
        else:
            self.values[layer][:, pos_start:pos_start + n, :] = v.transpose(1, 0, 2)

    def view(self, layer: int, key_start: int, key_end: int
             ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """Keys and values (n_head_kv, key_end - key_start, head_dim) of one layer in float32: views
        of an f32 cache (transposed values spanning blocks: a copy), upcast copies of an f16 one (the
        float kernels attend in float32)."""
        keys = self.keys[layer][:, key_start:key_end, :]
        if self.values_transposed:
            layer_values = self.values[layer]
            spans = [layer_values[block, :, :, low:high]
                     for block, low, high, _ in _block_spans(key_start, key_end, self.layout.value_block)]
            if len(spans) == 1:  # within one block: a view, as the keys are
                span = spans[0]
            else:
                span = np.concatenate(spans, axis=-1) if spans else layer_values[0, :, :, :0]
            values = span.transpose(0, 2, 1)  # (n_head_kv, head_dim, n) -> (n_head_kv, n, head_dim)
        else:
            values = self.values[layer][:, key_start:key_end, :]
        return keys.astype(np.float32, copy=False), values.astype(np.float32, copy=False)

    def copy_prefix(self, source: SessionKV, n_positions: int) -> None:
        """Take positions [0, n_positions) of every layer's keys and values from `source` (same
        layout), and hold exactly those."""
        assert source.layout == self.layout and source.values_transposed == self.values_transposed
        for mine, theirs in zip(self.keys, source.keys, strict=True):
            mine[:, :n_positions, :] = theirs[:, :n_positions, :]  # (n_head_kv, n, head_dim)
        for mine, theirs in zip(self.values, source.values, strict=True):
            if self.values_transposed:
                for block, low, high, _ in _block_spans(0, n_positions, self.layout.value_block):
                    mine[block, :, :, low:high] = theirs[block, :, :, low:high]  # (n_head_kv, head_dim, span)
            else:
                mine[:, :n_positions, :] = theirs[:, :n_positions, :]
        self.will_write(n_positions)
        self.length = n_positions

    def will_write(self, pos_end: int) -> None:
        """Note that positions up to `pos_end` are (about to be) written, before any write."""
        self.written = max(self.written, pos_end)

    def clear(self) -> None:
        """Zero every position written so far, in every layer (only those pages are touched)."""
        w = self.written
        for keys in self.keys:
            keys[:, :w, :] = 0
        for values in self.values:
            if self.values_transposed:
                for block, low, high, _ in _block_spans(0, w, self.layout.value_block):
                    values[block, :, :, low:high] = 0
            else:
                values[:, :w, :] = 0
        self.written = 0

    def trim(self, n_positions: int) -> None:
        """Forget positions >= n_positions."""
        if n_positions < 0 or n_positions > self.length:
            raise SessionError(
                f"session {self.session_id}: cannot trim to {n_positions} positions; "
                f"expected 0..{self.length} (the session holds {self.length})"
            )
        self.length = n_positions


class SlotPool:
    """Session caches side by side in one anonymous mapping, `slot_bytes` apart: graphs can then
    read every session's cache of a layer through one strided view (compute/graphs.py).
    Pages are backed only once written. A freed slot keeps its pages, zeroed where its session
    wrote (`KVCacheSet.close`), so the next session in it starts without page faults: with values
    transposed, a session's first position touches one page per value row of every layer (about
    7 ms a session for Gemma 3 270M's 18 layers, docs/BENCHMARKS.md at commit f9d1290, "Warm slots and an earlier
    start"). The pool so holds at most the pages its busiest moment needed; `release` gives the
    free slots' pages back."""

    _serials: ClassVar[Iterator[int]] = itertools.count(1)

    @attrs.frozen(eq=False)
    class Slot:
        """One session's place in the pool."""

        pool: SlotPool
        index: int
        memory: memoryview

    def __init__(self, slots: int, session_bytes: int) -> None:
        """Reserve `slots` slots of `session_bytes` each, rounded up to whole pages (address space
        only); OSError when the system refuses the mapping."""
        self.slots, self.session_bytes = slots, session_bytes
        self.serial = next(SlotPool._serials)  # from 1: (0, n) names a cache outside any pool
        self.slot_bytes = -(-session_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # madvise takes whole pages
        # Private, so that MADV_DONTNEED drops a freed slot's pages (a shared mapping keeps them).
        self.memory = mmap.mmap(-1, slots * self.slot_bytes, flags=mmap.MAP_PRIVATE)
        self._free = list(range(slots))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (every slot)."""
        return self.slots * self.slot_bytes

    def array(self, row: CacheType) -> npt.NDArray[np.floating]:
        """The whole pool as values of one cache type, for one ggml tensor over it."""
        return np.frombuffer(self.memory, dtype=row.dtype)

    def take(self) -> SlotPool.Slot | None:
        """A free slot (the lowest), or None when every slot is taken."""
        if not self._free:
            return None
        index = self._free.pop(0)
        view = memoryview(self.memory)[index * self.slot_bytes:index * self.slot_bytes + self.session_bytes]
        return SlotPool.Slot(self, index, view)

    def give_back(self, slot: SlotPool.Slot) -> None:
        """Free a slot, which must read as zeros (the caller cleared what its session wrote); its
        pages stay, for the next session to write without faulting them in."""
        self._free.append(slot.index)
        self._free.sort()

    def release(self) -> int:
        """Return the free slots' pages to the system (they read as zeros again); how many slots."""
        for index in self._free:
            self.memory.madvise(mmap.MADV_DONTNEED, index * self.slot_bytes, self.slot_bytes)
        return len(self._free)


class KVCacheSet:
    """The open sessions of one stage and their caches."""

    def __init__(self, n_layers: int, n_head_kv: int, head_dim: int, ctx_size: int, *,
                 values_transposed: bool = False, pool_slots: int = 0, type_k: str = "f32",
                 type_v: str = "f32") -> None:
        """Hold no sessions yet; every session gets caches of these dimensions, layout and cache
        types, the first `pool_slots` open at a time in one `SlotPool` (none if the system refuses it)."""
        self.layout = KVLayout.of(n_layers, n_head_kv, head_dim, ctx_size, type_k, type_v)
        self._dims = (n_layers, n_head_kv, head_dim, ctx_size)
        self._values_transposed = values_transposed
        self._sessions: dict[int, SessionKV] = {}
        self.pool: SlotPool | None = None
        if pool_slots > 0:
            with contextlib.suppress(OSError):  # address space refused: every session maps its own
                self.pool = SlotPool(pool_slots, self.layout.nbytes)

    def open(self, session_id: int) -> SessionKV:
        """Create the cache of a new session; SessionError if it is already open."""
        if session_id in self._sessions:
            raise SessionError(f"session {session_id} is already open on this stage")
        slot = self.pool.take() if self.pool is not None else None
        kv = SessionKV(session_id, *self._dims, values_transposed=self._values_transposed, slot=slot,
                       type_k=self.layout.type_k.name, type_v=self.layout.type_v.name)
        self._sessions[session_id] = kv
        return kv

    def fork(self, source_id: int, target_id: int, n_positions: int) -> SessionKV:
        """Open session `target_id` holding a copy of positions [0, n_positions) of `source_id`'s
        keys and values (docs/PROTOCOL.md §7, "Session forks and embeddings"); SessionError naming
        the ids when the source is not open, the target already is, or n_positions is outside
        0..source length."""
        source = self._sessions.get(source_id)
        if source is None:
            raise SessionError(f"cannot fork session {source_id} into {target_id}: session {source_id} "
                               "is not open on this stage")
        if target_id in self._sessions:
            raise SessionError(f"cannot fork session {source_id} into {target_id}: session {target_id} "
                               "is already open on this stage")
        if not 0 <= n_positions <= source.length:
            raise SessionError(f"cannot fork session {source_id} into {target_id} at {n_positions} positions; "
                               f"expected 0..{source.length} (session {source_id} holds {source.length})")
        target = self.open(target_id)
        target.copy_prefix(source, n_positions)
        return target

    def close(self, session_id: int) -> None:
        """Drop a session's cache (its slot back to the pool); unknown ids are ignored."""
        kv = self._sessions.pop(session_id, None)
        if kv is not None and kv.slot is not None:
            kv.clear()  # the slot's next session must read zeros where this one wrote
            kv.keys, kv.values = [], []
            kv.slot.pool.give_back(kv.slot)
            kv.slot = None

    def get(self, session_id: int) -> SessionKV:
        """The cache of an open session; SessionError if it is not open."""
        kv = self._sessions.get(session_id)
        if kv is None:
            raise SessionError(f"session {session_id} is not open on this stage")
        return kv

    def __contains__(self, session_id: object) -> bool:
        """Whether a session is open."""
        return session_id in self._sessions

    def ids(self) -> list[int]:
        """Open session ids in opening order."""
        return list(self._sessions)

    def get_many(self, session_ids: Sequence[int]) -> list[SessionKV]:
        """Caches of several open sessions, each id at most once."""
        if len(set(session_ids)) != len(session_ids):
            raise SessionError(f"session ids {list(session_ids)} repeat within one batch")
        return [self.get(s) for s in session_ids]


@attrs.frozen
class Segment:
    """Rows [row_start, row_start + n_rows) of a batch belong to one session at pos_start.."""

    kv: SessionKV
    row_start: int
    n_rows: int
    pos_start: int
