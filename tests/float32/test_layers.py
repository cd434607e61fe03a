"""The float32 engine's block math: each step against its definition, and one block for every row of the
architecture table."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.compute.kv_cache import Segment, SessionKV
from skippy_zmq.float32 import layers
from skippy_zmq.float32.layers import RopeTable, apply_rope, block, rms_norm
from skippy_zmq.model.arch import ARCHITECTURES
from skippy_zmq.model.gguf_model import GGUFModel
from skippy_zmq.runtime.kernels import Kernel


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 64), seed=st.integers(0, 2**32 - 1))
def test_rms_norm_is_its_definition_in_float32(rows: int, width: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width)).astype(np.float32) * np.float32(rng.uniform(0.01, 100))
    w = rng.standard_normal(width).astype(np.float32)
    exact = x.astype(np.float64) / np.sqrt(np.mean(np.square(x.astype(np.float64)), axis=-1, keepdims=True) + 1e-6) * w
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, exact, rtol=2e-5, atol=1e-6 * float(np.abs(exact).max() + 1))


@pytest.mark.parametrize("neox", [True, False])
def test_rope_turns_each_pair_by_its_angle_and_keeps_its_length(neox: bool) -> None:
    rng = np.random.default_rng(3)
    rope = RopeTable.build(16, 8, 10000.0)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)  # (R, heads, D)
    positions = np.array([0, 5, 15], dtype=np.int64)
    out = apply_rope(x, positions, rope, neox)
    assert np.array_equal(out[0], x[0])  # position 0: no turn
    pairs = (lambda a: (a[..., :4], a[..., 4:])) if neox else (lambda a: (a[..., 0::2], a[..., 1::2]))
    (x1, x2), (o1, o2) = pairs(x), pairs(out)
    np.testing.assert_allclose(o1**2 + o2**2, x1**2 + x2**2, rtol=1e-5)
    angle = np.arctan2(o2, o1) - np.arctan2(x2, x1)  # (R, heads, D/2)
    turned = np.angle(np.exp(1j * (angle - positions[:, None, None] * (10000.0 ** (-np.arange(4) / 4)))))
    np.testing.assert_allclose(turned, 0, atol=1e-4)


@pytest.mark.parametrize(("n_keys", "window"), [(1, 0), (7, 0), (40, 0), (8, 8), (5, 8), (12, 8)])
def test_a_decode_query_takes_the_unmasked_path_with_the_same_bits(n_keys: int, window: int) -> None:
    rng = np.random.default_rng(n_keys * 100 + window)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    keys = rng.standard_normal((2, n_keys, 16)).astype(np.float32)
    values = rng.standard_normal((2, n_keys, 16)).astype(np.float32)
    key_start = 30
    last = np.array([key_start + n_keys - 1], dtype=np.int64)
    masked = layers._attend_masked(q, keys, values, last, key_start, window)
    got = layers.attend(q, keys, values, last, key_start, window)
    assert np.array_equal(got, masked)
    if window == 0 or n_keys <= window:
        assert np.array_equal(layers._attend_last(q, keys, values), masked)
    else:  # keys beyond the window must stay masked: the fast path would have read them
        assert not np.allclose(layers._attend_last(q, keys, values), masked)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_one_block_follows_its_row_post_norms_and_activation(request: pytest.FixtureRequest, arch: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path: Path = request.getfixturevalue(f"tiny_{arch}_path")
    model = GGUFModel(path)
    hp = model.hparams
    rope = RopeTable.build(16, hp.head_dim, hp.layer_rope_base(0), hp.layer_rope_scale(0))
    lw = layers.Block.bind(layers.load_layer(model, 0, rope), Kernel("numpy").bind)
    x = np.random.default_rng(1).standard_normal((3, hp.n_embd)).astype(np.float32)
    positions = np.arange(3, dtype=np.int64)

    def run() -> np.ndarray:
        kv = SessionKV(1, 1, hp.n_head_kv, hp.head_dim, 16)
        return block(x, lw, 0, hp, [Segment(kv, 0, 3, 0)], positions)

    # The sub-blocks by hand, as the row says: post norms (gemma3) around each output, the row's activation.
    kv = SessionKV(1, 1, hp.n_head_kv, hp.head_dim, 16)
    attn = layers.attention_block(rms_norm(x, lw.attn_norm, hp.rms_eps), lw, 0, hp, [Segment(kv, 0, 3, 0)], positions)
    if hp.spec.post_norms:
        assert lw.post_attn_norm is not None
        attn = rms_norm(attn, lw.post_attn_norm, hp.rms_eps)
    mid = x + attn
    ffn = layers.feed_forward(rms_norm(mid, lw.ffn_norm, hp.rms_eps), lw, hp.spec.ffn_glu)
    if hp.spec.post_norms:
        assert lw.post_ffw_norm is not None
        ffn = rms_norm(ffn, lw.post_ffw_norm, hp.rms_eps)
    assert np.array_equal(run(), mid + ffn)
    # The row's activation is what the block reads: the other one gives other numbers.
    other = attrs.evolve(hp.spec, ffn_glu="silu" if hp.spec.ffn_glu == "gelu" else "gelu")
    monkeypatch.setitem(ARCHITECTURES, arch, other)  # type: ignore[index]
    assert not np.allclose(run(), mid + ffn)
