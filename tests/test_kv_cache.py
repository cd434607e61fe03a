"""Per-session key/value caches: storage, views, trim, and memory only where positions reach."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from skippy_zmq.errors import ConfigError, SessionError
from skippy_zmq.runtime.kv_cache import CACHE_TYPES, KVCacheSet, SessionKV, cache_type, kv_bytes_per_position


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
    assert kv.values[1].shape == (2, 4, 16) and kv.values[1].flags.c_contiguous  # (Hkv, D, ctx)
    assert np.array_equal(kv.values[1][:, :, 3:8], v.transpose(1, 2, 0))
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
    assert table.pool.array[offset + 8 * 4:offset + 8 * 4 + 4].tolist() == [1.0] * 4  # layer 1's keys, position 0
    table.close(2)
    again = table.open(4)
    assert again.slot is not None and again.slot.index == 1 and not again.keys[1].any() and not again.values[1].any()
