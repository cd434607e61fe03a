"""Random quantized blocks: the packing is ggml's (gguf.quants.dequantize is the reference), the
values have the scale asked for, pools are reproducible and their draws do not repeat rows."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.testing import random_blocks
from skippy_zmq.testing.random_blocks import POOL_BLOCKS, BlockPool, PoolSet, pack_q4_k, pack_q6_k, random_blocks_of

Q = gguf.GGMLQuantizationType


def _dequantize(blocks: np.ndarray, type_name: str) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(blocks, Q[type_name]), dtype=np.float64).reshape(blocks.shape[0], -1)


def test_q4_k_packing_is_the_layout_gguf_dequantizes() -> None:
    rng = np.random.default_rng(0)
    n = 40
    q = rng.integers(0, 16, (n, 256), dtype=np.uint8)
    sc, m = rng.integers(0, 64, (n, 8), dtype=np.uint8), rng.integers(0, 64, (n, 8), dtype=np.uint8)
    d, dmin = rng.random(n).astype(np.float16), rng.random(n).astype(np.float16)
    sub = np.repeat(np.arange(8), 32)  # value v is in sub-block v // 32
    expected = d.astype(np.float64)[:, None] * sc[:, sub] * q - dmin.astype(np.float64)[:, None] * m[:, sub]
    got = _dequantize(pack_q4_k(q, sc, m, d, dmin), "Q4_K")
    assert np.allclose(got, expected, rtol=1e-6, atol=0)


def test_q6_k_packing_is_the_layout_gguf_dequantizes() -> None:
    rng = np.random.default_rng(1)
    n = 40
    q = rng.integers(0, 64, (n, 256), dtype=np.uint8)
    sc = rng.integers(-128, 128, (n, 16), dtype=np.int8)
    d = rng.random(n).astype(np.float16)
    sub = np.repeat(np.arange(16), 16)  # value v is in sub-block v // 16
    expected = d.astype(np.float64)[:, None] * sc[:, sub] * (q.astype(np.float64) - 32)
    assert np.allclose(_dequantize(pack_q6_k(q, sc, d), "Q6_K"), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "F16", "F32"])
def test_blocks_have_mean_zero_and_the_scale_asked_for(type_name: str) -> None:
    sigma = 0.02
    n = 2048 if type_name.startswith("Q") else 2048 * 256  # a float type's "block" is one value
    blocks = random_blocks_of(type_name, np.random.default_rng(2), n, sigma)
    if type_name in ("F16", "F32"):
        values = blocks.reshape(-1).view("<f2" if type_name == "F16" else "<f4").astype(np.float64)
    else:
        values = _dequantize(blocks, type_name).reshape(-1)
    assert np.isfinite(values).all()
    assert abs(values.mean()) < 4 * sigma / np.sqrt(values.size)  # four standard errors
    assert 0.95 * sigma < values.std() < 1.05 * sigma
    # N(0, sigma²)-like: a few values beyond 3 sigma, none beyond 8
    assert 0.0005 < float(np.mean(np.abs(values) > 3 * sigma)) < 0.01 and np.abs(values).max() < 8 * sigma


def test_a_pool_is_a_function_of_seed_type_and_scale() -> None:
    a, b = BlockPool.build("Q4_K", 0.1, seed=3), BlockPool.build("Q4_K", 0.1, seed=3)
    assert a.blocks.shape == (POOL_BLOCKS, 144) and np.array_equal(a.blocks, b.blocks)
    assert not np.array_equal(a.blocks, BlockPool.build("Q4_K", 0.1, seed=4).blocks)
    assert not np.array_equal(a.blocks, BlockPool.build("Q4_K", 0.2, seed=3).blocks)
    pools = PoolSet(seed=3)
    assert pools.get("Q4_K", 0.1) is pools.get("Q4_K", 0.1)
    assert np.array_equal(pools.get("Q4_K", 0.1).blocks, a.blocks)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_drawn_blocks_mix_parts_into_blocks_no_pool_holds(type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pool of 64 blocks: 4096 single-block rows drawn whole would be 64 rows at most; with parts
    # mixed (64**3 Q6_K blocks, 64**5 Q4_K) only birthday collisions repeat.
    monkeypatch.setattr(random_blocks, "POOL_BLOCKS", 64)
    pool = BlockPool.build(type_name, 0.05, seed=5)
    drawn = pool.draw(np.random.default_rng(6), 4096)
    assert drawn.shape == (4096, pool.blocks.shape[1])
    assert len({row.tobytes() for row in drawn}) > 4000
    values = _dequantize(drawn, type_name)
    assert np.isfinite(values).all() and 0.9 * 0.05 < values.std() < 1.1 * 0.05


def test_whole_blocks_are_drawn_for_the_32_value_types() -> None:
    pool = BlockPool.build("Q8_0", 0.05, seed=7)
    drawn = pool.draw(np.random.default_rng(8), 100)
    pooled = {row.tobytes() for row in pool.blocks}
    assert all(row.tobytes() in pooled for row in drawn)


def test_a_type_that_cannot_be_made_is_refused_by_name() -> None:
    with pytest.raises(ModelLoadError, match="ggml type 'Q9_X' is unknown to the gguf package"):
        random_blocks_of("Q9_X", np.random.default_rng(0), 4, 1.0)
    with pytest.raises(ModelLoadError, match="ggml type IQ2_XXS can be neither composed here"):
        random_blocks_of("IQ2_XXS", np.random.default_rng(0), 4, 1.0)
