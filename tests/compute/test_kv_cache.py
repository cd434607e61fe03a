"""Per-session key/value caches: storage, views, trim, and memory only where positions reach."""

from __future__ import annotations

import ctypes
import glob
import mmap

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.compute.kv_cache import (
    CACHE_TYPES,
    VALUE_BLOCK,
    KVCacheSet,
    SessionKV,
    SlotPool,
    cache_type,
    kv_bytes_per_position,
)
from skippy_zmq.errors import ConfigError, SessionError


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def test_the_cache_type_table_has_llama_cpps_names_widths_and_ggml_ids() -> None:
    assert {name: (row.dtype, row.value_bytes, row.ggml_type) for name, row in CACHE_TYPES.items()} == {
        "f32": (np.dtype(np.float32), 4, 0), "f16": (np.dtype(np.float16), 2, 1)}
    with pytest.raises(ConfigError, match=r"stage-1: cache type 'q8_0' is unknown; expected one of f32, f16"):
        cache_type("q8_0", "stage-1")


def test_bytes_per_position_count_keys_and_values_in_their_types() -> None:
    # a 12B-shaped session: 48 layers, 8 KV heads of 256
    assert kv_bytes_per_position(48, 8, 256, "f32", "f32") == 3 * 2**18  # 0.75 MiB
    assert kv_bytes_per_position(48, 8, 256, "f16", "f16") == 3 * 2**17
    assert kv_bytes_per_position(2, 1, 4, "f32", "f16") == 2 * 4 * (4 + 2)
    with pytest.raises(ConfigError, match="type_v: cache type 'f8'"):
        kv_bytes_per_position(2, 1, 4, "f32", "f8")


def test_stored_keys_and_values_come_back_per_layer() -> None:
    kv = SessionKV(7, n_layers=3, n_head_kv=2, head_dim=4, ctx_size=16)
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 5, 2, 4)).astype(np.float32)  # (T, Hkv, D) each
    kv.store(1, 3, k, v)
    keys, values = kv.view(1, 3, 8)
    assert keys.shape == (2, 5, 4) and np.array_equal(keys, k.transpose(1, 0, 2))
    assert np.array_equal(values, v.transpose(1, 0, 2))
    assert not kv.view(0, 3, 8)[0].any() and not kv.view(2, 3, 8)[1].any()  # other layers untouched
    assert not kv.view(1, 0, 3)[0].any()  # positions never written read as zeros


def test_transposed_values_hold_the_same_numbers_in_llama_cpps_layout() -> None:
    table = KVCacheSet(n_layers=2, n_head_kv=2, head_dim=4, ctx_size=16, values_transposed=True)
    kv = table.open(3)
    rng = np.random.default_rng(1)
    k, v = rng.standard_normal((2, 5, 2, 4)).astype(np.float32)  # (T, Hkv, D) each
    kv.store(1, 3, k, v)
    # (blocks, Hkv, D, block): one block of the whole context, at most VALUE_BLOCK positions
    assert kv.values[1].shape == (1, 2, 4, 16) and kv.values[1].flags.c_contiguous
    assert np.array_equal(kv.values[1][0, :, :, 3:8], v.transpose(1, 2, 0))
    keys, values = kv.view(1, 3, 8)
    assert np.array_equal(keys, k.transpose(1, 0, 2)) and np.array_equal(values, v.transpose(1, 0, 2))
    assert kv.serial != table.open(4).serial  # a cache's serial names it even when an id comes back


def test_opening_sessions_takes_no_memory_until_positions_are_written() -> None:
    # 20 sessions at this size would hold 1.4 GiB if their caches were backed at once. Freeing
    # large buffers first (as loading a stage does) makes glibc serve np.zeros-sized requests
    # from its heap, zeroed at once: the caches must not depend on the allocator for this.
    scratch = np.ones(16 << 20, dtype=np.uint8)
    del scratch
    dirty = [np.ones(2 << 20, dtype=np.uint8) for _ in range(60)]
    del dirty[:-1]  # freed heap chunks, written: what a reused calloc must clear
    before = _resident_mib()
    caches = [SessionKV(i, n_layers=18, n_head_kv=1, head_dim=256, ctx_size=2048) for i in range(20)]
    assert _resident_mib() - before < 64
    caches[0].store(0, 0, np.ones((1, 1, 256), np.float32), np.ones((1, 1, 256), np.float32))
    assert caches[0].view(0, 0, 1)[0].sum() == 256


def test_trim_and_the_session_table() -> None:
    table = KVCacheSet(n_layers=2, n_head_kv=1, head_dim=4, ctx_size=8)
    kv = table.open(3)
    kv.length = 5
    kv.trim(2)
    assert kv.length == 2
    with pytest.raises(SessionError, match=r"cannot trim to 4 positions; expected 0\.\.2"):
        kv.trim(4)
    with pytest.raises(SessionError, match="session 3 is already open"):
        table.open(3)
    with pytest.raises(SessionError, match="repeat within one batch"):
        table.get_many([3, 3])
    table.close(3)
    table.close(3)  # unknown ids are a no-op
    assert 3 not in table and table.ids() == []


def test_a_pool_gives_sessions_slots_side_by_side_and_takes_them_back_zeroed() -> None:
    table = KVCacheSet(n_layers=2, n_head_kv=1, head_dim=4, ctx_size=8, values_transposed=True, pool_slots=2)
    assert table.pool is not None and table.pool.session_bytes == 2 * 4 * 2 * 1 * 4 * 8
    assert table.pool.slot_bytes == mmap.PAGESIZE  # whole pages, so a freed slot's pages can be dropped
    first, second, third = table.open(1), table.open(2), table.open(3)
    assert [kv.slot.index if kv.slot else None for kv in (first, second, third)] == [0, 1, None]  # the third maps its own
    ones = np.ones((1, 1, 4), np.float32)
    second.store(1, 0, ones, ones)
    offset = table.pool.slot_bytes // 4  # slot 1's first float in the pool's one array
    assert table.pool.array(CACHE_TYPES["f32"])[offset + 8 * 4:offset + 8 * 4 + 4].tolist() == [1.0] * 4  # layer 1's keys, position 0
    table.close(2)
    again = table.open(4)
    assert again.slot is not None and again.slot.index == 1 and not again.keys[1].any() and not again.values[1].any()


def test_a_slots_memory_key_names_the_slot_and_an_own_cache_its_serial() -> None:
    table = KVCacheSet(n_layers=1, n_head_kv=1, head_dim=4, ctx_size=8, values_transposed=True, pool_slots=1)
    other = KVCacheSet(n_layers=1, n_head_kv=1, head_dim=4, ctx_size=8, values_transposed=True, pool_slots=1)
    slotted, own = table.open(1).memory_key, table.open(2)
    assert own.slot is None and own.memory_key == (0, own.serial)
    table.close(1)
    assert table.open(3).memory_key == slotted  # the next session in the same memory
    assert other.open(1).memory_key != slotted  # another pool's slot 0
    owned = own.memory_key
    table.close(2)
    assert table.open(4).memory_key != owned  # an own cache is never named again


@pytest.mark.parametrize("transposed", [False, True])
def test_a_freed_slot_is_zeroed_where_its_session_wrote_and_keeps_its_pages(transposed: bool) -> None:
    table = KVCacheSet(n_layers=2, n_head_kv=2, head_dim=4, ctx_size=4096, values_transposed=transposed,
                       pool_slots=1, type_k="f16", type_v="f32")
    assert table.pool is not None
    first = table.open(1)
    nan = np.full((3, 2, 4), np.nan, np.float32)  # (T, Hkv, D): what a hostile upstream may send
    first.store(0, 0, nan, nan)
    first.store(1, 5, nan, nan)  # positions 5..7 of layer 1: written, so cleared, though length is 0
    first.will_write(12)  # a pass about to write positions up to 12 (and failing before its length grows)
    first.values[1][(0, 0, 0, 11) if transposed else (0, 11, 0)] = np.nan  # position 11
    assert first.written == 12
    table.close(1)
    floats = table.pool.array(CACHE_TYPES["f32"])
    assert floats[:table.pool.slot_bytes // 4].tobytes() == bytes(table.pool.slot_bytes)  # every byte zero again
    assert _resident_pages(table.pool) > 0  # kept for the next session (release gives them back)
    second = table.open(2)
    assert second.slot is not None and second.slot.index == 0 and second.written == 0
    assert table.pool.release() == 0  # slot 0 is taken: nothing free to release
    table.close(2)
    assert table.pool.release() == 1 and _resident_pages(table.pool) == 0


def test_a_forked_session_counts_its_copied_positions_as_written() -> None:
    table = KVCacheSet(n_layers=1, n_head_kv=1, head_dim=4, ctx_size=16, values_transposed=True, pool_slots=2)
    source = table.open(1)
    ones = np.ones((6, 1, 4), np.float32)
    source.store(0, 0, ones, ones)
    source.length = 6
    target = table.fork(1, 2, 4)
    assert target.written == 4 and target.length == 4
    table.close(2)
    assert not table.open(3).values[0].any()


def _resident_pages(pool: SlotPool) -> int:
    """How many of the pool's pages are backed (mincore through ctypes; Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = pool.nbytes // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    address = ctypes.addressof(ctypes.c_char.from_buffer(pool.memory))
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(pool.nbytes), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(byte & 1 for byte in vector)


@pytest.mark.parametrize(("type_k", "type_v"), [("f16", "f16"), ("f32", "f16"), ("f16", "f32")])
@pytest.mark.parametrize("transposed", [False, True])
def test_keys_and_values_are_stored_in_their_types_and_viewed_in_float32(type_k: str, type_v: str,
                                                                         transposed: bool) -> None:
    kv = SessionKV(5, n_layers=3, n_head_kv=2, head_dim=4, ctx_size=16, values_transposed=transposed,
                   type_k=type_k, type_v=type_v)
    assert kv.keys[2].dtype == CACHE_TYPES[type_k].dtype and kv.values[2].dtype == CACHE_TYPES[type_v].dtype
    rng = np.random.default_rng(2)
    k, v = rng.standard_normal((2, 5, 2, 4)).astype(np.float32)  # (T, Hkv, D) each
    kv.store(2, 3, k, v)
    keys, values = kv.view(2, 3, 8)
    assert keys.dtype == np.float32 and values.dtype == np.float32  # the float kernels attend in float32
    kept_k = k.astype(CACHE_TYPES[type_k].dtype).astype(np.float32)
    kept_v = v.astype(CACHE_TYPES[type_v].dtype).astype(np.float32)
    assert np.array_equal(keys, kept_k.transpose(1, 0, 2)) and np.array_equal(values, kept_v.transpose(1, 0, 2))
    if type_k == "f16":
        assert not np.array_equal(keys, k.transpose(1, 0, 2))  # rounded, not kept in float32 after all
    assert not kv.view(1, 3, 8)[0].any() and not kv.view(2, 0, 3)[1].any()  # other layers and positions untouched
    kv.length = 8
    kv.trim(4)
    assert kv.length == 4 and np.array_equal(kv.view(2, 3, 4)[0], kept_k[:1].transpose(1, 0, 2))


def test_an_f16_session_takes_half_the_bytes_and_each_layer_starts_aligned() -> None:
    f32 = KVCacheSet(n_layers=2, n_head_kv=1, head_dim=4, ctx_size=8, pool_slots=1).layout
    f16 = KVCacheSet(n_layers=2, n_head_kv=1, head_dim=4, ctx_size=8, type_k="f16", type_v="f16").layout
    assert (f32.nbytes, f16.nbytes) == (2 * 2 * 4 * 8 * 4, 2 * 2 * 4 * 8 * 2)
    odd = SessionKV(1, n_layers=3, n_head_kv=1, head_dim=3, ctx_size=5, type_k="f16", type_v="f32")
    # 30 bytes of f16 keys a layer, padded so that every layer's keys and values can hold a ggml tensor
    assert odd.layout.key_layer_bytes == 64 and odd.layout.values_offset == 3 * 64
    assert all(a.ctypes.data % 32 == 0 for a in (*odd.keys, *odd.values))
    with pytest.raises(ConfigError, match="type_v: cache type 'q4_0' is unknown"):
        KVCacheSet(n_layers=1, n_head_kv=1, head_dim=4, ctx_size=8, type_v="q4_0")


def test_a_pool_of_f16_sessions_keeps_each_slots_keys_and_values_where_its_layout_says() -> None:
    table = KVCacheSet(n_layers=2, n_head_kv=1, head_dim=4, ctx_size=8, values_transposed=True, pool_slots=2,
                       type_k="f16", type_v="f32")
    assert table.pool is not None and table.pool.session_bytes == table.layout.nbytes == 2 * 4 * 8 * (2 + 4)
    first, second = table.open(1), table.open(2)
    assert second.slot is not None and second.slot.index == 1
    k = np.full((1, 1, 4), 0.1, np.float32)
    v = np.full((1, 1, 4), 0.2, np.float32)
    second.store(1, 2, k, v)
    layout, base = table.layout, table.pool.slot_bytes
    keys = table.pool.array(CACHE_TYPES["f16"])
    at = (base + layout.key_layer_bytes) // 2 + 2 * 4  # slot 1, layer 1's keys, position 2
    assert keys[at:at + 4].tolist() == [np.float16(0.1)] * 4
    values = table.pool.array(CACHE_TYPES["f32"])
    at = (base + layout.values_offset + layout.value_layer_bytes) // 4 + 2  # (1, 1, D, 8): position 2 of each row
    assert values[at:at + 4 * 8:8].tolist() == [np.float32(0.2)] * 4
    assert not first.keys[1].any() and not first.values[1].any()
    table.close(2)
    again = table.open(3)
    assert again.slot is not None and again.slot.index == 1 and not again.keys[1].any()


def _ggml_fp32_to_fp16(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """ggml's CPU conversion, the one its copies into an F16 cache use (from_float of GGML_TYPE_F16)."""
    from skippy_zmq.compute import ggml

    if ggml.unavailable() is not None:
        pytest.skip(f"ggml unavailable: {ggml.unavailable()}")
    library = ctypes.CDLL(sorted(glob.glob(str(ggml.Library.get().directory / "libggml-cpu*.so")))[0])
    out = np.empty(values.shape, np.uint16)
    library.ggml_cpu_fp32_to_fp16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    library.ggml_cpu_fp32_to_fp16(values.ctypes.data, out.ctypes.data, values.size)
    return out


def test_numpys_rounding_to_f16_is_ggmls() -> None:
    # Every f16 value, the float32 midpoints between neighbours (the ties) and one float32 step to
    # either side, over and underflow included, then a million random float32 bit patterns.
    halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)  # 0 .. 65504
    upper = np.append(halves[1:], np.float32(65536.0))  # the next f16 step (65536: the first that overflows)
    mid = (halves + upper) / 2  # exact in float32
    around = np.concatenate([halves, mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    randoms = np.random.default_rng(3).integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = np.concatenate([around, -around, randoms[np.isfinite(randoms)]]).astype(np.float32)
    with np.errstate(over="ignore"):  # beyond 65504 both give infinity
        rounded = values.astype(np.float16).view(np.uint16)
    assert np.array_equal(rounded, _ggml_fp32_to_fp16(values))


def _filled(table: KVCacheSet, session_id: int, n_positions: int, seed: int) -> SessionKV:
    """A session of `table` holding n_positions random keys and values in every layer."""
    kv = table.open(session_id)
    layout = table.layout
    rng = np.random.default_rng(seed)
    for layer in range(layout.n_layers):
        k, v = rng.standard_normal((2, n_positions, layout.n_head_kv, layout.head_dim)).astype(np.float32)
        kv.store(layer, 0, k, v)
    kv.length = n_positions
    return kv


def _views(kv: SessionKV, end: int) -> list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]]:
    """Every layer's keys and values of positions [0, end), copied."""
    copies = []
    for layer in range(len(kv.keys)):
        keys, values = kv.view(layer, 0, end)
        copies.append((keys.copy(), values.copy()))
    return copies


def _same(a: list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]],
          b: list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]]) -> bool:
    return all(np.array_equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


@settings(max_examples=40, deadline=None)
@given(n_positions=st.integers(0, 12), length=st.integers(0, 12), type_k=st.sampled_from(list(CACHE_TYPES)),
       type_v=st.sampled_from(list(CACHE_TYPES)), transposed=st.booleans(), pool_slots=st.sampled_from([0, 1, 3]))
def test_a_fork_copies_the_prefix_of_every_layer_and_nothing_after_it(
        n_positions: int, length: int, type_k: str, type_v: str, transposed: bool, pool_slots: int) -> None:
    # pool_slots 1: the source takes the only slot and the target maps its own; 3: both in the pool.
    n_positions = min(n_positions, length)
    table = KVCacheSet(n_layers=3, n_head_kv=2, head_dim=4, ctx_size=12, values_transposed=transposed,
                       pool_slots=pool_slots, type_k=type_k, type_v=type_v)
    source = _filled(table, 1, length, seed=length)
    before = _views(source, length)
    target = table.fork(1, 2, n_positions)
    assert table.ids() == [1, 2] and table.get(2) is target and target.length == n_positions
    assert target.serial != source.serial and (target.slot is None or target.slot is not source.slot)
    for (keys, values), (src_keys, src_values) in zip(_views(target, n_positions), before, strict=True):
        assert np.array_equal(keys, src_keys[:, :n_positions]) and np.array_equal(values, src_values[:, :n_positions])
    for layer in range(3):  # positions past the fork read as never written
        keys, values = target.view(layer, n_positions, 12)
        assert not keys.any() and not values.any()
    ones = np.ones((12 - n_positions, 2, 4), np.float32)
    for layer in range(3):
        target.store(layer, n_positions, ones, ones)
    target.length = 12
    assert _same(_views(source, length), before)


def test_trimming_or_closing_a_fork_leaves_its_source_and_the_other_way_round() -> None:
    table = KVCacheSet(n_layers=2, n_head_kv=1, head_dim=4, ctx_size=8, values_transposed=True, pool_slots=4,
                       type_k="f16", type_v="f16")
    source = _filled(table, 1, 6, seed=3)
    kept = _views(source, 6)
    fork = table.fork(1, 2, 6)
    fork.trim(2)
    assert source.length == 6 and fork.length == 2
    table.close(2)  # its slot's pages are dropped: the source's must stay
    assert 1 in table and 2 not in table
    assert _same(_views(source, 6), kept)
    second = table.fork(1, 3, 4)
    table.close(1)
    assert second.length == 4
    assert _same(_views(second, 4), [(keys[:, :4], values[:, :4]) for keys, values in kept])


def test_a_fork_names_the_ids_when_it_cannot_be_made() -> None:
    table = KVCacheSet(n_layers=1, n_head_kv=1, head_dim=4, ctx_size=8)
    _filled(table, 1, 3, seed=0)
    table.open(2)
    with pytest.raises(SessionError, match=r"cannot fork session 9 into 3: session 9 is not open"):
        table.fork(9, 3, 0)
    with pytest.raises(SessionError, match=r"cannot fork session 1 into 2: session 2 is already open"):
        table.fork(1, 2, 0)
    for bad in (-1, 4):
        with pytest.raises(SessionError, match=rf"into 3 at {bad} positions; expected 0\.\.3 \(session 1 holds 3\)"):
            table.fork(1, 3, bad)
    assert table.ids() == [1, 2]  # a refused fork opens nothing
    assert table.fork(1, 3, 0).length == 0


def test_transposed_values_lie_in_blocks_of_positions_and_come_back_across_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("skippy_zmq.compute.kv_cache.VALUE_BLOCK", 4)
    table = KVCacheSet(n_layers=2, n_head_kv=2, head_dim=3, ctx_size=10, values_transposed=True, pool_slots=2)
    kv = table.open(1)
    assert kv.layout.value_block == 4 and kv.values[1].shape == (3, 2, 3, 4)  # 10 positions in 3 blocks of 4
    assert kv.layout.value_layer_bytes == 320  # whole blocks: 2 x 12 x 3 floats (288 bytes), aligned to 64
    rng = np.random.default_rng(5)
    k, v = rng.standard_normal((2, 7, 2, 3)).astype(np.float32)  # positions 2..8: blocks 0, 1 and 2
    kv.store(1, 2, k, v)
    kv.length = 9
    for position in range(2, 9):
        block, at = divmod(position, 4)
        assert np.array_equal(kv.values[1][block, :, :, at], v[position - 2])  # (Hkv, D) of that position
    keys, values = kv.view(1, 1, 9)
    assert np.array_equal(keys[:, 1:], k.transpose(1, 0, 2)) and not keys[:, 0].any()
    assert np.array_equal(values[:, 1:], v.transpose(1, 0, 2)) and not values[:, 0].any()
    assert kv.view(1, 5, 5)[1].shape == (2, 0, 3)
    fork = table.fork(1, 2, 6)  # two blocks: one whole, one in part
    assert np.array_equal(fork.view(1, 0, 6)[1], kv.view(1, 0, 6)[1]) and not fork.values[1][1, :, :, 2:].any()
    table.close(1)  # zeroed where it wrote, across the blocks
    assert not table.open(3).values[1].any()


def test_a_short_session_touches_one_block_of_values_not_a_page_per_value_row() -> None:
    # Gemma 3 270M's shape at 2,048 positions: 256 value rows a layer. Transposed over the whole
    # context, one position would touch a 4 KiB page per row (1 MiB a layer); in blocks of
    # VALUE_BLOCK positions, the first block's 256 x VALUE_BLOCK values (128 KiB in f16).
    table = KVCacheSet(n_layers=2, n_head_kv=1, head_dim=256, ctx_size=2048, values_transposed=True, pool_slots=1,
                       type_k="f16", type_v="f16")
    assert table.pool is not None and VALUE_BLOCK == 256
    one = np.ones((1, 1, 256), np.float32)
    table.open(1).store(1, 0, one, one)
    block_pages = 256 * VALUE_BLOCK * 2 // mmap.PAGESIZE
    assert _resident_pages(table.pool) <= block_pages + 1  # the block's pages and the keys' one
