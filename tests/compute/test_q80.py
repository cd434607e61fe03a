"""Tests of skippy_zmq.compute.q80 and the Q8_0 route of ggml.mul_mat: the package's product gives ggml's
products at every row count (every variant this CPU runs, random blocks and rows, hypothesis), a row's
result does not depend on the rows beside it, a golden block, the routing rules and the head's route
(test_products.py has what the products share: the route variable, and a product that is missing, refused or
wrong falling back to ggml's by name)."""

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
from skippy_zmq.compute import nbits_head, q80  # noqa: E402 - after the skip
from skippy_zmq.runtime.kernels import Kernel  # noqa: E402

BUILT = isinstance(q80.PRODUCT.load("scalar"), q80.Native)
if not BUILT:
    pytest.skip(f"the package's Q8_0 product is not built: {q80.PRODUCT.load('scalar')}", allow_module_level=True)
RUNNABLE = [name for name in q80.VARIANTS if isinstance(q80.PRODUCT.load(name), q80.Native)]


@pytest.fixture(autouse=True)
def _fresh_routes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test picks its route from the environment and checks it anew."""
    monkeypatch.delenv(q80.Q80_ENV, raising=False)
    monkeypatch.setattr(ggml, "_native", {})
    yield


def random_q80(n: int, k: int, rng: np.random.Generator) -> npt.NDArray[np.uint8]:
    """n rows of k values in random Q8_0 blocks: any codes (-128 included), a finite d of either sign."""
    blocks = rng.integers(0, 256, (n * k // 32, 34), dtype=np.uint8)
    d = (rng.uniform(0.0005, 0.05, blocks.shape[0]) * rng.choice([-1.0, 1.0], blocks.shape[0])).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def products(data: npt.NDArray[np.uint8], n: int, k: int, x: npt.NDArray[np.float32],
             route: str, monkeypatch: pytest.MonkeyPatch) -> npt.NDArray[np.float32]:
    """x (rows, k) times the matrix by `ggml.mul_mat` with $SKIPPY_ZMQ_Q80 = route."""
    monkeypatch.setenv(q80.Q80_ENV, route)
    monkeypatch.setattr(ggml, "_native", {})
    graphs = ggml.MatmulGraphs([BlockMatrix("w", "Q8_0", k, n, data)], 2, "test")
    return graphs(x)


@pytest.mark.parametrize("route", RUNNABLE)
def test_a_golden_block_gives_its_values_sum(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # codes 1 and d = 1: every weight is 1.0; rows of ones sum to k (their codes 127, their scale 1/127)
    block = np.ones(34, np.uint8)
    block[0:2] = np.array([1.0], np.float16).view(np.uint8)
    data = np.tile(block, 5 * 4)  # 5 rows of 4 blocks
    out = products(data, 5, 128, np.ones((3, 128), np.float32), route, monkeypatch)
    np.testing.assert_allclose(out, np.full((3, 5), 128.0), rtol=1e-3)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(RUNNABLE), n=st.integers(1, 40), blocks=st.integers(1, 9), rows=st.integers(1, 40),
       zero_row=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_every_variant_gives_ggmls_bits_at_every_row_count(route: str, n: int, blocks: int, rows: int,
                                                            zero_row: bool, seed: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # ggml sums every pair one way at any row count (its dot product, or llamafile's tiles): so does each
    # variant, over ranges that end in partial groups of weight rows and partial tiles of activation rows
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    data = random_q80(n, k, rng)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 10)).astype(np.float32)
    if zero_row:
        x[rows // 2] = 0.0  # a row of zeros: scale 0, codes 0
    theirs = products(data, n, k, x, "ggml", monkeypatch)
    ours = products(data, n, k, x, route, monkeypatch)
    assert np.array_equal(ours, theirs)
    if zero_row:
        assert not ours[rows // 2].any()


@pytest.mark.parametrize("route", RUNNABLE)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    n, k, rows = 42, 640, 9
    data = random_q80(n, k, rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    together = products(data, n, k, x, route, monkeypatch)
    for r in range(rows):
        alone = products(data, n, k, x[r:r + 1], route, monkeypatch)
        assert np.array_equal(alone[0], together[r])


def _tensors(n: int, k: int, rows: int, x_type: str = "F32") -> tuple[int, int, int]:
    """A Q8_0 weight tensor and an input tensor of `rows` rows in a no-alloc context (and the context)."""
    lib = ggml.Library.get()
    ctx = lib.ggml_init(ggml.InitParams(lib.ggml_tensor_overhead() * 8, None, True))  # room for 8
    weight = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES["Q8_0"], k, n)
    x = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES[x_type], k, rows)
    return ctx, weight, x


def test_the_route_takes_q80_weights_and_float_rows_at_any_count() -> None:
    lib = ggml.Library.get()
    product = ggml.q80_product()
    assert isinstance(product, q80.Native) and product.variant == RUNNABLE[0]  # the best this CPU runs
    for rows in (1, 2, 7, 64, 512):
        ctx, weight, x = _tensors(16, 512, rows)
        assert ggml.native_product(lib, weight, x) is product, rows
        lib.ggml_free(ctx)
    ctx, weight, x = _tensors(16, 512, 4, x_type="F16")  # not float32 rows: ggml's
    assert ggml.native_product(lib, weight, x) is None
    lib.ggml_free(ctx)
    long_k = product.variants[product.variant].single_k_below
    if long_k is not None:  # a single row of a long matrix: ggml's, the faster there, with the same bits
        for rows, expected in ((1, None), (2, product)):
            ctx, weight, x = _tensors(16, long_k, rows)
            assert ggml.native_product(lib, weight, x) is expected, rows
            lib.ggml_free(ctx)
    assert ggml.q80_described() == f"the package's Q8_0 product ({product.variant})"


def test_a_q80_head_is_the_packages_by_default_and_matmulnbits_only_when_asked() -> None:
    assert not Kernel("ggml").head_by_nbits("Q8_0", "test")  # auto: llama.cpp's logits bit for bit
    if nbits_head.unavailable() is None:
        assert Kernel("ggml", head="nbits").head_by_nbits("Q8_0", "test")
        assert Kernel("ggml").head_by_nbits("Q4_0", "test")  # no package product for Q4_0
