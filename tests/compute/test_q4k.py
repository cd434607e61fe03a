"""Tests of skippy_zmq.compute.q4k and the Q4_K route of ggml.mul_mat: the package's product over repacked
blocks gives ggml's products bit for bit at every row count it takes, in every variant this CPU runs
(random matrices and rows, hypothesis; rows whose largest magnitude comes with both signs, all-zero
blocks), the variant the CPU's instructions pick, the routing rules (repacked Q4_K only, 2 rows or more),
and a product that is refused or missing falling back to ggml's by name."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.gguf_model import BlockMatrix

ggml = pytest.importorskip("skippy_zmq.compute.ggml")
if ggml.unavailable() is not None:  # the model extra is not installed
    pytest.skip(f"ggml kernel unavailable: {ggml.unavailable()}", allow_module_level=True)
from skippy_zmq.compute import q4k  # noqa: E402 - after the skip

FOUND = q4k.PRODUCT.load("auto")
REPACKS = ggml.Library.get().repacks("Q4_K", 64)
needs_product = pytest.mark.skipif(not isinstance(FOUND, q4k.Native) or not REPACKS,
                                   reason=f"the package's Q4_K product cannot run here: {FOUND}, repacks {REPACKS}")
RUNNABLE = [name for name in q4k.VARIANTS if isinstance(q4k.PRODUCT.load(name), q4k.Native)]
"""The variants this CPU runs (every one from its best down)."""


@pytest.fixture(autouse=True)
def _fresh_routes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test picks its route from the environment and checks it anew."""
    monkeypatch.delenv(q4k.Q4K_ENV, raising=False)
    monkeypatch.setattr(ggml, "_native", {})
    yield


def products(data: npt.NDArray[np.uint8], n: int, k: int, x: npt.NDArray[np.float32], route: str,
             monkeypatch: pytest.MonkeyPatch) -> npt.NDArray[np.float32]:
    """x (rows, k) times the repacked matrix by `ggml.mul_mat` with $SKIPPY_ZMQ_Q4K = route."""
    monkeypatch.setenv(q4k.Q4K_ENV, route)
    graphs = ggml.MatmulGraphs([BlockMatrix("w", "Q4_K", k, n, data)], 2, "test", repack=True)
    assert graphs.weights.repacked_bytes == data.nbytes
    return graphs(x)


@needs_product
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups=st.integers(1, 6), blocks=st.integers(1, 3), rows=st.integers(2, 70), seed=st.integers(0, 2**32 - 1))
def test_the_product_is_ggmls_bit_for_bit(groups: int, blocks: int, rows: int, seed: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # ggml sums rows in whole groups of 4 with its GEMM and the rest with its GEMV, in two orders: the op
    # follows both, in tiles of 32 rows, so every row count from 2 on gives ggml's bits.
    rng = np.random.default_rng(seed)
    n, k = 8 * groups, 256 * blocks
    data = ggml.quantize("Q4_K", rng.standard_normal((n, k)).astype(np.float32))
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 100)).astype(np.float32)
    assert np.array_equal(products(data, n, k, x, "auto", monkeypatch), products(data, n, k, x, "ggml", monkeypatch))


@needs_product
@pytest.mark.parametrize("variant", RUNNABLE)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups=st.integers(1, 4), blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_each_variant_gives_ggmls_bits_at_every_row_count_to_40(variant: str, groups: int, blocks: int, seed: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Every split of the rows: ggml's GEMM groups of 4 and its GEMV rows after them, across the variants'
    # tiles (8 rows in AVX2, 32 in AVX-512); rows of very different scales, and an all-zero block in some.
    rng = np.random.default_rng(seed)
    n, k = 8 * groups, 256 * blocks
    data = ggml.quantize("Q4_K", rng.standard_normal((n, k)).astype(np.float32))
    matrix = [BlockMatrix("w", "Q4_K", k, n, data)]
    theirs, ours = (ggml.MatmulGraphs(matrix, 2, "test", repack=True) for _ in range(2))
    for rows in range(1, 41):
        x = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 100, (rows, 1))).astype(np.float32)
        x[rng.random(rows) < 0.2, :256] = 0.0
        monkeypatch.setenv(q4k.Q4K_ENV, "ggml")
        expected = theirs(x)
        monkeypatch.setenv(q4k.Q4K_ENV, variant)
        assert np.array_equal(ours(x), expected), rows


@needs_product
@pytest.mark.parametrize("rows", [2, 4, 5, 37])
def test_rows_whose_largest_magnitude_has_both_signs_are_quantized_as_ggml_does(
        rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # ggml's 4-row quantizer takes +a where +a and -a tie, its one-row quantizer the first of them: the
    # scale's sign, and with it the rounding of every code, differs between the two.
    rng = np.random.default_rng(5)
    n, k = 16, 512
    data = ggml.quantize("Q4_K", rng.standard_normal((n, k)).astype(np.float32))
    x = rng.uniform(-1, 1, (rows, k)).astype(np.float32)
    x[:, 3], x[:, 7] = -2.0, 2.0  # the negative first
    x[:, 256 + 1], x[:, 256 + 9] = 3.0, -3.0  # the positive first
    assert np.array_equal(products(data, n, k, x, "auto", monkeypatch), products(data, n, k, x, "ggml", monkeypatch))


def test_the_best_route_is_the_variant_the_cpus_instructions_allow() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not isinstance(FOUND, q4k.Native) or not cpuinfo.exists():
        pytest.skip(f"the package's Q4_K product cannot run here, or no /proc/cpuinfo: {FOUND}")
    flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
    # the product runs, so the CPU has at least AVX2, FMA and F16C
    best = "avx512vnni" if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags else "avx2"
    assert FOUND.variant == best
    names = list(q4k.VARIANTS)
    assert names[names.index(best):] == RUNNABLE


def _tensors(lib: object, ctx: int, type_name: str, n: int, k: int, rows: int) -> tuple[int, int]:
    weight = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES[type_name], k, n)  # type: ignore[attr-defined]
    x = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES["F32"], k, rows)  # type: ignore[attr-defined]
    return weight, x


@needs_product
def test_the_route_takes_repacked_q4k_weights_from_2_rows_on() -> None:
    lib = ggml.Library.get()
    rng = np.random.default_rng(1)
    n, k = 64, 512
    data = ggml.quantize("Q4_K", rng.standard_normal((n, k)).astype(np.float32))
    repacked = ggml.Weights(lib, [BlockMatrix("w", "Q4_K", k, n, data)], "test", repack=True)
    plain = ggml.Weights(lib, [BlockMatrix("w", "Q4_K", k, n, data)], "test")
    ctx = lib.ggml_init(ggml.InitParams(lib.ggml_tensor_overhead() * 8, None, True))
    try:
        product = ggml.q4k_product()
        assert isinstance(product, q4k.Native)
        for rows, expected in ((1, False), (2, True), (33, True), (512, True)):
            x = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES["F32"], k, rows)
            assert (ggml.native_product(lib, repacked.tensors[0], x) is not None) is expected, rows
            assert ggml.native_product(lib, plain.tensors[0], x) is None  # the file's layout: ggml's kernels
        unplaced, x = _tensors(lib, ctx, "Q4_K", n, k, 4)  # no buffer at all
        assert ggml.native_product(lib, unplaced, x) is None
    finally:
        lib.ggml_free(ctx)


def test_ggml_named_keeps_ggmls_product_and_a_bad_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(q4k.Q4K_ENV, "ggml")
    assert ggml.q4k_product() == "$SKIPPY_ZMQ_Q4K = ggml"
    assert "ggml's" in ggml.q4k_described()
    monkeypatch.setenv(q4k.Q4K_ENV, "fast")
    with pytest.raises(ModelLoadError, match=r"\$SKIPPY_ZMQ_Q4K = 'fast'; expected one of"):
        ggml.q4k_product()


def test_a_product_that_was_not_built_falls_back_to_ggmls_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(q4k.PRODUCT, "_loaded", {})
    monkeypatch.setattr("skippy_zmq.compute.products.importlib.util.find_spec", lambda name: None)
    with caplog.at_level(logging.WARNING, logger=ggml.__name__):
        why = ggml.q4k_product()
    assert why == "the package's Q4_K product was not built (setup.py builds it where a C compiler is installed)"
    assert "Q4_K matrices multiply by ggml's product" in caplog.text
    monkeypatch.setenv(q4k.Q4K_ENV, "avx512vnni")  # named, it must run or be refused
    monkeypatch.setattr(ggml, "_native", {})
    with pytest.raises(ModelLoadError, match="SKIPPY_ZMQ_Q4K = avx512vnni, but that product cannot run here"):
        ggml.q4k_product()


def test_a_product_that_writes_nothing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    if not isinstance(FOUND, q4k.Native) or not REPACKS:
        pytest.skip(f"the package's Q4_K product cannot run here: {FOUND}")
    # A variant number the C code does not know: the op returns at once, leaving its output as it was.
    broken = q4k.Native(FOUND.library, FOUND.function, "broken", {"broken": q4k.Variant(7, "nothing", max_rows=64)})
    why = ggml._check_q4k(broken)
    assert why is not None and why.startswith("the broken product differs from ggml's in 128 of 128 outputs at 2 rows")
