"""Float32 products: numpy and ONNX Runtime compute the same products, keep what they should, and an
ONNX row's bits do not depend on the rows beside it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.float32 import projections
from skippy_zmq.float32.projections import NumpyProjection, OnnxProjection
from skippy_zmq.runtime.kernels import Kernel

ONNX = Kernel("onnxruntime")
NUMPY = Kernel("numpy")


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), k=st.integers(1, 96), n=st.integers(1, 130), seed=st.integers(0, 2**32 - 1))
def test_onnx_and_numpy_products_agree_to_float32_rounding(rows: int, k: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    w_t = rng.standard_normal((k, n), dtype=np.float32)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    exact = x.astype(np.float64) @ w_t.astype(np.float64)
    got = ONNX.bind(w_t)(x)
    assert got.dtype == np.float32 and got.shape == (rows, n)
    # float32 sums of k products, in any order, stay within k ulps of the scale of the terms
    bound = 4 * k * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w_t).astype(np.float64))
    assert np.all(np.abs(got - exact) <= bound + 1e-30)
    assert np.all(np.abs(NUMPY.bind(w_t)(x) - exact) <= bound + 1e-30)


def test_an_onnx_projection_keeps_its_own_copy_and_takes_strided_rows() -> None:
    rng = np.random.default_rng(7)
    w_t = rng.standard_normal((64, 48), dtype=np.float32)
    projection = ONNX.bind(w_t)
    assert isinstance(projection, OnnxProjection)
    assert (projection.in_features, projection.out_features) == (64, 48)
    x = rng.standard_normal((6, 128), dtype=np.float32)[:, ::2]  # not C-contiguous
    before = projection(x)
    w_t[:] = 0.0  # the stage drops (or unmaps) the array it bound: the session must not need it
    after = projection(x)
    assert np.array_equal(before, after) and np.abs(after).max() > 0


def test_the_numpy_kernel_keeps_the_array_it_was_given() -> None:
    w_t = np.arange(12, dtype=np.float32).reshape(3, 4)
    projection = NUMPY.bind(w_t)
    assert isinstance(projection, NumpyProjection) and projection.w_t is w_t
    assert np.array_equal(projection(np.ones((2, 3), np.float32)), np.ones((2, 3), np.float32) @ w_t)


def test_a_large_matrix_is_bound_in_column_slices_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    w_t = rng.standard_normal((48, 1000), dtype=np.float32)
    x = rng.standard_normal((5, 48), dtype=np.float32)
    whole = ONNX.bind(w_t)
    monkeypatch.setattr(projections, "SLICE_BYTES", 48 * 4 * 300)  # 300 columns a slice
    split = ONNX.bind(w_t)
    assert isinstance(split, projections.ColumnSplit)
    assert [p.out_features for p in split.parts] == [300, 300, 300, 100]
    assert (split.in_features, split.out_features) == (48, 1000)
    assert np.array_equal(split(x), whole(x))


@pytest.mark.parametrize(("k", "n"), [(640, 1536), (1024, 640), (640, 4096), (2048, 640)])
def test_an_onnx_row_is_the_same_bits_alone_or_among_others(k: int, n: int) -> None:
    # The shapes of a Gemma 3 270M block; docs/ARCHITECTURE.md ("Kernels") relies on this.
    rng = np.random.default_rng(k + n)
    projection = ONNX.bind(rng.standard_normal((k, n), dtype=np.float32))
    x = rng.standard_normal((32, k), dtype=np.float32)
    together = projection(x)
    for rows in (1, 2, 3, 8, 16, 31):
        assert np.array_equal(projection(x[:rows]), together[:rows])
    assert np.array_equal(projection(x[17:18]), together[17:18])
