"""Tests of skippy_zmq.compute.q6k and the Q6_K route of ggml.mul_mat: the package's product gives ggml's
products (every variant this CPU runs, random blocks and rows, hypothesis), a row's result does not depend
on the rows beside it, a golden block, and the routing rules (test_products.py has what the products share:
the route variable, and a product that is missing, refused or wrong falling back to ggml's by name)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy_zmq.model.gguf_model import BlockMatrix

ggml = pytest.importorskip("skippy_zmq.compute.ggml")
if ggml.unavailable() is not None:  # the model extra is not installed
    pytest.skip(f"ggml kernel unavailable: {ggml.unavailable()}", allow_module_level=True)
from skippy_zmq.compute import q6k  # noqa: E402 - after the skip

BUILT = isinstance(q6k.PRODUCT.load("auto"), q6k.Native) or isinstance(q6k.PRODUCT.load("scalar"), q6k.Native)
if not BUILT:
    pytest.skip(f"the package's Q6_K product is not built: {q6k.PRODUCT.load('scalar')}", allow_module_level=True)
RUNNABLE = [name for name in q6k.VARIANTS if isinstance(q6k.PRODUCT.load(name), q6k.Native)]


@pytest.fixture(autouse=True)
def _fresh_routes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test picks its route from the environment and checks it anew."""
    monkeypatch.delenv(q6k.Q6K_ENV, raising=False)
    monkeypatch.setattr(ggml, "_native", {})
    yield


def random_q6k(n: int, k: int, rng: np.random.Generator) -> npt.NDArray[np.uint8]:
    """n rows of k values in random Q6_K blocks: random codes and int8 scales, a finite d per block."""
    blocks = rng.integers(0, 256, (n * k // 256, 210), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, blocks.shape[0]).astype(np.float16)
    blocks[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def products(data: npt.NDArray[np.uint8], n: int, k: int, x: npt.NDArray[np.float32],
             route: str, monkeypatch: pytest.MonkeyPatch) -> npt.NDArray[np.float32]:
    """x (rows, k) times the matrix by `ggml.mul_mat` with $SKIPPY_ZMQ_Q6K = route."""
    monkeypatch.setenv(q6k.Q6K_ENV, route)
    graphs = ggml.MatmulGraphs([BlockMatrix("w", "Q6_K", k, n, data)], 2, "test")
    return graphs(x)


@pytest.mark.parametrize("route", RUNNABLE)
def test_a_golden_block_gives_its_values_sum(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # codes 33 (value d * sc * (33 - 32)), scales 1, d = 1: every weight is 1.0; rows of ones sum to k.
    block = np.zeros(210, np.uint8)
    block[0:128] = 0x11  # low nibbles 1 (both halves of each byte)
    block[128:192] = 0xAA  # high bits 2 everywhere: code 2 << 4 | 1 = 33
    block[192:208] = 1
    block[208:210] = np.array([1.0], np.float16).view(np.uint8)
    data = np.tile(block, 2 * 3)  # 3 rows of 2 blocks
    out = products(data, 3, 512, np.ones((2, 512), np.float32), route, monkeypatch)
    np.testing.assert_allclose(out, np.full((2, 3), 512.0), rtol=1e-6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(RUNNABLE), n=st.integers(1, 40), blocks=st.integers(1, 3), rows=st.integers(1, 40),
       zero_row=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_every_variant_gives_ggmls_bits(route: str, n: int, blocks: int, rows: int, zero_row: bool, seed: int,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Below 8 rows ggml multiplies row by row with its AVX2 dot product, whose order every variant
    # keeps: the same bits. From 8 rows on ggml takes its tiled kernel (another order), and each variant
    # still gives the bits of its rows one at a time, within float rounding of ggml's.
    rng = np.random.default_rng(seed)
    k = 256 * blocks
    data = random_q6k(n, k, rng)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 10)).astype(np.float32)
    if zero_row:
        x[rows // 2] = 0.0  # a row of zeros: scale 0, codes 0 (q8_K's special case)
    theirs = products(data, n, k, x, "ggml", monkeypatch)
    ours = products(data, n, k, x, route, monkeypatch)
    if rows < 8:
        assert np.array_equal(ours, theirs)
    else:
        assert np.abs(ours - theirs).max() <= 1e-5 * float(np.abs(theirs).max())
        if rows <= q6k.VARIANTS[route].max_rows:  # beyond it, ggml's own product runs
            singles = np.concatenate([products(data, n, k, x[r:r + 1], route, monkeypatch) for r in range(rows)])
            assert np.array_equal(ours, singles)
    if zero_row:
        assert not ours[rows // 2].any()


@pytest.mark.parametrize("route", RUNNABLE)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    n, k = 40, 768
    data = random_q6k(n, k, rng)
    rows = min(9, q6k.VARIANTS[route].max_rows)  # past the limit ggml's own product runs
    x = rng.standard_normal((rows, k)).astype(np.float32)
    together = products(data, n, k, x, route, monkeypatch)
    for r in range(rows):
        alone = products(data, n, k, x[r:r + 1], route, monkeypatch)
        assert np.array_equal(alone[0], together[r])


def _tensors(n: int, k: int, rows: int, x_type: str = "F32") -> tuple[int, int, int]:
    """A Q6_K weight tensor and an input tensor of `rows` rows in a no-alloc context (and the context)."""
    lib = ggml.Library.get()
    ctx = lib.ggml_init(ggml.InitParams(lib.ggml_tensor_overhead() * 8, None, True))  # room for 8
    weight = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES["Q6_K"], k, n)
    x = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES[x_type], k, rows)
    return ctx, weight, x


def test_the_route_takes_q6k_weights_and_float_rows_within_the_variants_limits() -> None:
    lib = ggml.Library.get()
    product = ggml.q6k_product()
    assert isinstance(product, q6k.Native) and product.variant == RUNNABLE[0]  # the best this CPU runs
    below = [(product.min_rows - 1, False)] if product.min_rows > 1 else []  # AVX2: one row is ggml's
    cases = (*below, (product.min_rows, True), (product.max_rows, True), (product.max_rows + 1, False))
    for rows, expected in cases:
        ctx, weight, x = _tensors(16, 512, rows)
        taken = expected and product.takes(rows, 512)  # AVX-512: a short matrix's single row is ggml's
        assert (ggml.native_product(lib, weight, x) is not None) is taken, rows
        lib.ggml_free(ctx)
    assert not product.takes(1, 512) or product.variant != "avx512"
    ctx, weight, x = _tensors(16, 512, 4, x_type="F16")  # not float32 rows: ggml's
    assert ggml.native_product(lib, weight, x) is None
    other = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES["F32"], 256, 4)  # widths that do not match: ggml's
    assert ggml.native_product(lib, weight, other) is None
    q4 = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES["Q4_K"], 512, 16)  # not Q6_K: ggml's
    f32 = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES["F32"], 512, 4)
    assert ggml.native_product(lib, q4, f32) is None
    lib.ggml_free(ctx)


def test_long_matrices_take_single_rows_and_short_ones_from_two_below_ggmls_own_switch() -> None:
    avx512 = q6k.VARIANTS["avx512"]
    assert avx512.long_k is not None
    long, short = avx512.long_k, avx512.long_k - 256
    assert [avx512.takes(rows, long) for rows in (1, 2, 7)] == [True, False, False]
    assert [avx512.takes(rows, short) for rows in (1, 2, 7)] == [False, True, True]
    assert avx512.takes(8, long) and avx512.takes(8, short)  # from ggml's switch on, the order decides, not speed
    assert all(q6k.VARIANTS["avx2"].takes(rows, k) for rows in (1, 2, 7) for k in (short, long))  # no such rule


def test_the_tensor_head_reads_ggmls_type_shape_and_strides() -> None:
    lib = ggml.Library.get()
    ctx, weight, x = _tensors(24, 768, 5)
    head = ggml.TensorHead.of(weight)
    assert (head.type, list(head.ne), head.nb[1]) == (ggml.GGML_TYPES["Q6_K"], [768, 24, 1, 1], 3 * 210)
    assert list(ggml.TensorHead.of(x).nb)[:2] == [4, 768 * 4]
    lib.ggml_free(ctx)
