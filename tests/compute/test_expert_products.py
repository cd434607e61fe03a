"""The package's grouped expert ops against ggml_mul_mat_id: its bits for any choice of experts, routed only
where they give them, and ggml's own op wherever they cannot run."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.compute import expert_products, ggml, products
from skippy_zmq.model.gguf_model import BlockMatrix

pytestmark = pytest.mark.skipif(ggml.unavailable() is not None, reason=f"ggml unavailable: {ggml.unavailable()}")

GGML_MUL_MAT_ID = 30  # the op field of a tensor ggml_mul_mat_id made (ggml.h's enum ggml_op, this ggml)
GGML_CUSTOM = 95  # ggml_custom_4d's


def _runs(op: expert_products.GroupedOp) -> bool:
    return isinstance(expert_products._grouped_function(op), int)


class _Experts:
    """Random experts of one type as a stage holds them, and a graph computing both ops on the same inputs."""

    def __init__(self, type_name: str, n_experts: int, n: int, k: int, seed: int) -> None:
        self.lib = ggml.Library.get()
        op = expert_products.GROUPED[type_name]
        rng = np.random.default_rng(seed)
        data = ggml.quantize(type_name, rng.standard_normal((n_experts * n, k)).astype(np.float32))
        matrix = BlockMatrix(name="<experts>", type_name=type_name, k=k, n=n, data=data, experts=n_experts)
        self.weights = ggml.Weights(self.lib, [matrix], "test", repack=op.repacked)
        self.n_experts, self.n, self.k = n_experts, n, k
        self.backend = ggml.Backend(self.lib, 2)

    def both(self, x_values: np.ndarray, chosen: np.ndarray) -> Iterator[np.ndarray]:
        """ggml_mul_mat_id's output and `mul_mat_id`'s, (R, used, n) each, for x (R, inputs, k), chosen (R, used)."""
        lib, tensor = self.lib, self.weights.tensors[0]
        rows, inputs, _ = x_values.shape
        used = chosen.shape[1]
        host = ggml.HostArrays(lib)
        size = lib.ggml_tensor_overhead() * 8 + lib.ggml_graph_overhead_custom(8, False)
        ctx = lib.ggml_init(ggml.InitParams(size, None, True))
        try:
            graph = lib.ggml_new_graph_custom(ctx, 8, False)
            x = lib.ggml_new_tensor_3d(ctx, ggml.GGML_TYPES["F32"], self.k, inputs, rows)
            ids = lib.ggml_new_tensor_2d(ctx, ggml.GGML_I32, used, rows)
            host.place(x, host.empty(x_values.shape))
            host.place(ids, host.empty(chosen.shape, np.int32))
            ctypes.memmove(lib.ggml_get_data(x), np.ascontiguousarray(x_values, np.float32).ctypes.data, x_values.nbytes)
            ctypes.memmove(lib.ggml_get_data(ids), np.ascontiguousarray(chosen, np.int32).ctypes.data, chosen.size * 4)
            outputs = [lib.ggml_mul_mat_id(ctx, tensor, x, ids), expert_products.mul_mat_id(lib, ctx, tensor, x, ids)]
            arrays = []
            for out in outputs:
                array = host.empty((rows, used, self.n))
                array[:] = np.nan
                host.place(out, array)
                lib.ggml_build_forward_expand(graph, out)
                arrays.append(array)
            self.ops = [int(ctypes.c_int.from_address(out + _OP_OFFSET).value) for out in outputs]
            with self.backend.lock:
                self.backend.compute(graph)
            yield from (a.copy() for a in arrays)
        finally:
            lib.ggml_free(ctx)


# struct ggml_tensor: type, buffer, ne[4], nb[4], then op (ggml.h)
_OP_OFFSET = ctypes.sizeof(ggml.TensorHead)


@pytest.fixture(scope="module")
def q6k_experts() -> _Experts:
    return _Experts("Q6_K", 12, 32, 512, seed=1)


@pytest.fixture(scope="module")
def q4k_experts() -> _Experts:
    return _Experts("Q4_K", 12, 32, 512, seed=2)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 7), used=st.sampled_from([1, 3, 4]), own_inputs=st.booleans(), seed=st.integers(0, 2**31))
def test_the_grouped_q6k_op_gives_ggmls_bits_for_any_choice_of_experts(q6k_experts: _Experts, rows: int, used: int,
                                                                       own_inputs: bool, seed: int) -> None:
    if not _runs(expert_products.GROUPED["Q6_K"]):
        pytest.skip(str(expert_products._grouped_function(expert_products.GROUPED["Q6_K"])))
    rng = np.random.default_rng(seed)
    inputs = 1 if own_inputs else used
    x = rng.standard_normal((rows, inputs, q6k_experts.k)).astype(np.float32)
    # argsort of random keys: each row's experts distinct, as the router's top-k picks them; some rows alike
    chosen = np.argsort(rng.random((rows, q6k_experts.n_experts)), axis=1)[:, :used].astype(np.int32)
    chosen[rng.random(rows) < 0.3] = chosen[0]
    theirs, ours = q6k_experts.both(x, chosen)
    assert q6k_experts.ops == [GGML_MUL_MAT_ID, GGML_CUSTOM]
    assert np.array_equal(theirs, ours)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(8, 80), used=st.sampled_from([2, 4]), own_inputs=st.booleans(), seed=st.integers(0, 2**31))
def test_the_grouped_q4k_op_gives_ggmls_bits_over_repacked_experts(q4k_experts: _Experts, rows: int, used: int,
                                                                   own_inputs: bool, seed: int) -> None:
    # from 8 rows, where an expert's pairs fill the op's tiles (32 on AVX-512, 8 on AVX2)
    if not _runs(expert_products.GROUPED["Q4_K"]):
        pytest.skip(str(expert_products._grouped_function(expert_products.GROUPED["Q4_K"])))
    rng = np.random.default_rng(seed)
    inputs = 1 if own_inputs else used
    x = rng.standard_normal((rows, inputs, q4k_experts.k)).astype(np.float32)
    x[rng.random(rows) < 0.1] = 0.0  # a zero row: a zero scale in q8_K
    chosen = np.argsort(rng.random((rows, q4k_experts.n_experts)), axis=1)[:, :used].astype(np.int32)
    theirs, ours = q4k_experts.both(x, chosen)
    assert q4k_experts.ops == [GGML_MUL_MAT_ID, GGML_CUSTOM]
    assert np.array_equal(theirs, ours)


@pytest.mark.parametrize(("type_name", "rows", "own"), [
    ("Q6_K", 1, True), ("Q6_K", products.GGML_SWITCH_ROWS - 1, True),
    ("Q6_K", products.GGML_SWITCH_ROWS, False),  # ggml's tiled kernel from 8 pairs of an expert: another order
    ("Q4_K", 1, False), ("Q4_K", 7, False),  # ggml's one-row GEMV is as fast at about one pair an expert
    ("Q4_K", 8, True), ("Q4_K", 64, True)])
def test_the_op_is_chosen_by_the_pass_rows(request: pytest.FixtureRequest, type_name: str, rows: int,
                                           own: bool) -> None:
    op = expert_products.GROUPED[type_name]
    if not _runs(op):
        pytest.skip(str(expert_products._grouped_function(op)))
    experts: _Experts = request.getfixturevalue(f"{type_name.lower().replace('_', '')}_experts")
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 1, experts.k)).astype(np.float32)
    chosen = np.argsort(rng.random((rows, experts.n_experts)), axis=1)[:, :2].astype(np.int32)
    theirs, ours = experts.both(x, chosen)
    assert experts.ops[1] == (GGML_CUSTOM if own else GGML_MUL_MAT_ID)
    assert np.array_equal(theirs, ours)


def test_unrepacked_q4k_experts_stay_ggmls() -> None:
    # the Q4_K op reads only ggml's repacked layout: experts as the file stores them (repack off) are ggml's
    lib = ggml.Library.get()
    rng = np.random.default_rng(0)
    data = ggml.quantize("Q4_K", rng.standard_normal((4 * 16, 256)).astype(np.float32))
    weights = ggml.Weights(lib, [BlockMatrix(name="e", type_name="Q4_K", k=256, n=16, data=data, experts=4)], "t")
    assert expert_products._op_for(lib, weights.tensors[0]) is None


def test_an_op_that_disagrees_leaves_ggmls_in_place_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    op = expert_products.GROUPED["Q6_K"]
    product = op.product()
    if isinstance(product, str) or product.min_rows > 1:
        pytest.skip(f"no Q6_K product from one row here: {product}")
    monkeypatch.setattr(expert_products, "_checked", {})
    monkeypatch.setattr(expert_products, "_check", lambda *_: "differs in 3 of 96 outputs")
    with caplog.at_level(logging.WARNING, logger=expert_products.__name__):
        assert expert_products._grouped_function(op) == "differs in 3 of 96 outputs"
    assert "Q6_K experts multiply by ggml_mul_mat_id: differs in 3 of 96 outputs" in caplog.text
    assert "Q6_K experts by ggml_mul_mat_id (differs in 3 of 96 outputs)" in expert_products.described()


def test_the_load_line_names_who_multiplies_each_expert_type() -> None:
    said = expert_products.described()
    assert said.startswith("Q6_K experts ") and "; Q4_K experts " in said
    for op in expert_products.GROUPED.values():
        if _runs(op):
            assert f"{op.type_name} experts at {op.min_rows} " in said


@pytest.mark.parametrize("variant", ["avx512vnni", "avx2"])
def test_each_q4k_variant_the_cpu_runs_gives_ggmls_bits(q4k_experts: _Experts, variant: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # the AVX2 variant's activations lie in another layout (codes widened, pair sums): its copies into a tile
    from skippy_zmq.compute import q4k

    native = q4k.PRODUCT.load(variant)
    if isinstance(native, str):
        pytest.skip(native)
    monkeypatch.setenv(q4k.Q4K_ENV, variant)
    assert _runs(expert_products.GROUPED["Q4_K"])
    rng = np.random.default_rng(5)
    for rows, inputs in ((9, 1), (40, 4), (67, 4)):
        x = rng.standard_normal((rows, inputs, q4k_experts.k)).astype(np.float32)
        chosen = np.argsort(rng.random((rows, q4k_experts.n_experts)), axis=1)[:, :4].astype(np.int32)
        theirs, ours = q4k_experts.both(x, chosen)
        assert q4k_experts.ops == [GGML_MUL_MAT_ID, GGML_CUSTOM]
        assert np.array_equal(theirs, ours), (variant, rows, inputs)


def test_long_q6k_experts_take_one_pair_at_a_time_with_the_same_bits() -> None:
    # Mixtral's down matrices (14,336 inputs): the variant's long_k rule, as the dense product keeps it
    op = expert_products.GROUPED["Q6_K"]
    product = op.product()
    if not _runs(op) or isinstance(product, str):
        pytest.skip(str(expert_products._grouped_function(op)))
    long_k = product.variants[product.variant].long_k
    if long_k is None:
        pytest.skip(f"the {product.variant} Q6_K product has no long-matrix rule")
    assert op.flags(product, long_k) == expert_products.SINGLE_ROWS and op.flags(product, long_k - 256) == 0
    experts = _Experts("Q6_K", 4, 16, long_k, seed=9)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((7, 2, long_k)).astype(np.float32)
    chosen = np.argsort(rng.random((7, 4)), axis=1)[:, :2].astype(np.int32)
    theirs, ours = experts.both(x, chosen)
    assert experts.ops == [GGML_MUL_MAT_ID, GGML_CUSTOM]
    assert np.array_equal(theirs, ours)
