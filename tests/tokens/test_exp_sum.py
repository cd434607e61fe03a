"""Tests of skippy_zmq.tokens.exp_sum: the logprobs normalizer's kernels against float64."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from skippy_zmq.errors import StageError
from skippy_zmq.tokens import exp_sum

KERNELS = exp_sum.available()


def test_numpy_is_always_available_and_onnxruntime_preferred_when_installed() -> None:
    assert KERNELS[-1] == "numpy"
    assert exp_sum.best().name == KERNELS[0]
    pytest.importorskip("onnxruntime")
    assert KERNELS == ["onnxruntime", "numpy"]


@pytest.mark.parametrize("name", KERNELS)
@settings(max_examples=60, deadline=None)
@given(row=hnp.arrays(np.float32, st.integers(1, 5000), elements=st.floats(-60, 60, width=32)))
def test_the_sum_and_the_column_sums_are_float64_to_float32_rounding(name: str, row: np.ndarray) -> None:
    kernel = exp_sum.EXP_SUMS[name](1)
    total = kernel(row)
    exact = np.exp(row.astype(np.float64))
    assert total == pytest.approx(exact.sum(), rel=2e-6)
    width = row.size // exp_sum.GROUPS
    columns = exact[:exp_sum.GROUPS * width].reshape(exp_sum.GROUPS, width).sum(axis=0)
    assert kernel.columns.shape == (width,)
    np.testing.assert_allclose(kernel.columns, columns, rtol=2e-6)


@pytest.mark.parametrize("name", KERNELS)
def test_a_kernel_is_reused_across_row_sizes_and_passes_overflow_and_nan_through(name: str) -> None:
    kernel = exp_sum.EXP_SUMS[name](2)
    for size in (262_144, 37, 3, 262_144):
        row = np.linspace(-5, 5, size, dtype=np.float32)
        assert kernel(row) == pytest.approx(np.exp(row.astype(np.float64)).sum(), rel=2e-6)
    assert kernel(np.array([0.0] * 31 + [100.0], np.float32)) == np.inf
    assert np.isnan(kernel(np.array([0.0] * 31 + [np.nan], np.float32)))


def test_the_onnxruntime_kernel_refuses_a_row_it_cannot_bind_in_place() -> None:
    pytest.importorskip("onnxruntime")
    kernel = exp_sum.OnnxExpSum()
    with pytest.raises(StageError, match="contiguous float32"):
        kernel(np.zeros(64, np.float32)[::2])
    with pytest.raises(StageError, match="float64"):
        kernel(np.zeros(32, np.float64))  # type: ignore[arg-type]


def test_a_kernel_whose_session_will_not_build_gives_way_to_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(threads: int) -> exp_sum.ExpSum:
        raise RuntimeError("no session today")

    monkeypatch.setitem(exp_sum.EXP_SUMS, "onnxruntime", refuse)
    assert exp_sum.best(2).name == "numpy"


@pytest.mark.parametrize("name", KERNELS)
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), width=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_a_block_of_rows_sums_to_the_bits_of_one_call_a_row(name: str, rows: int, width: int, seed: int) -> None:
    # What the final stage's one run a pass relies on: the same totals and column sums, bit for bit.
    block = (np.random.default_rng(seed).standard_normal((rows, exp_sum.GROUPS * width)) * 8).astype(np.float32)
    kernel = exp_sum.EXP_SUMS[name](2)
    sums = kernel.rows(block)
    assert len(sums) == rows
    for row, summed in zip(block, sums, strict=True):
        assert kernel(row) == summed.total
        np.testing.assert_array_equal(kernel.columns, summed.columns)
    assert len({id(s.columns) for s in sums}) == rows  # each result's own, not a view a later call changes


@pytest.mark.parametrize("name", KERNELS)
def test_a_block_the_kernel_cannot_take_is_refused_by_shape(name: str) -> None:
    kernel = exp_sum.EXP_SUMS[name](1)
    assert kernel.rows(np.zeros((0, 32), np.float32)) == []
    for bad, why in ((np.zeros((2, 40), np.float32), r"\(2, 40\)"),
                     (np.zeros((2, 64), np.float32)[:, ::2], "C-contiguous"),
                     (np.zeros(64, np.float32), r"\(64,\)"),
                     (np.zeros((2, 32), np.float64), "float64")):
        with pytest.raises(StageError, match=why):
            kernel.rows(bad)
