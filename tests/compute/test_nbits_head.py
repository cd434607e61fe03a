"""Tests of skippy_zmq.compute.nbits_head: the codes and scales handed to MatMulNBits are the blocks'
exact values (gguf-py's dequantize, hypothesis over random blocks), its products agree with theirs
within the activations' int8 rounding, a row's logits do not depend on the rows beside it, the
arrays ONNX Runtime copied are freed only when it reads none of them, and bad input is refused by
name."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy_zmq.compute import nbits_head
from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.gguf_model import BlockMatrix
from skippy_zmq.runtime.kernels import HEAD_ENV, Kernel

ggml = pytest.importorskip("skippy_zmq.compute.ggml")
if ggml.unavailable() is not None or nbits_head.unavailable() is not None:
    pytest.skip("the model extra (ggml, ONNX Runtime) is not installed", allow_module_level=True)

import gguf  # noqa: E402 - after the skip: the model extra brings it

from tests.compute.test_ggml import check_product, dequantized, random_blocks  # noqa: E402

TYPES = sorted(nbits_head.NBITS_TYPES)


def codes_values(type_name: str, data: npt.NDArray[np.uint8], n: int, k: int) -> npt.NDArray[np.float64]:
    """What MatMulNBits computes with: scale x (code - zero point), (n, k) float64."""
    kind = nbits_head.NBITS_TYPES[type_name]
    codes, scales = kind.decode(data, k, n)
    if kind.bits == 4:  # value 2i in byte i's low nibble, 2i + 1 in its high one
        codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(n, k // nbits_head.BLOCK, nbits_head.BLOCK)
    zero = 1 << (kind.bits - 1)
    values = (codes.astype(np.float64) - zero) * scales.astype(np.float64)[..., None]
    return values.reshape(n, k)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(type_name=st.sampled_from(TYPES), n=st.integers(1, 40), blocks=st.integers(1, 6),
       seed=st.integers(0, 2**32 - 1))
def test_codes_and_scales_are_the_blocks_values_exactly(type_name: str, n: int, blocks: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = blocks * nbits_head.BLOCK
    data = random_blocks(type_name, n, k, rng)
    assert np.array_equal(codes_values(type_name, data, n, k), dequantized(type_name, data, n, k))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(type_name=st.sampled_from(TYPES), n=st.integers(1, 70), blocks=st.integers(1, 8),
       rows=st.integers(1, 20), seed=st.integers(0, 2**32 - 1), threads=st.sampled_from([1, 2]))
def test_products_agree_with_the_dequantized_blocks(type_name: str, n: int, blocks: int, rows: int, seed: int,
                                                    threads: int) -> None:
    rng = np.random.default_rng(seed)
    k = blocks * nbits_head.BLOCK
    data = random_blocks(type_name, n, k, rng)
    head = nbits_head.NbitsHead(BlockMatrix("w", type_name, k, n, data), threads, "test")
    x = rng.standard_normal((rows, k)).astype(np.float32)
    check_product(type_name, dequantized(type_name, data, n, k), x, head(x))


@pytest.mark.parametrize("type_name", TYPES)
def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(type_name: str) -> None:
    # Split equals whole and a replayed session need a row's logits to be the same bits in a batch
    # of any size: each row's activations are quantized on their own and summed in one order.
    rng = np.random.default_rng(3)
    n, k = 300, 256
    data = ggml.quantize(type_name, rng.standard_normal((n, k)).astype(np.float32))
    head = nbits_head.NbitsHead(BlockMatrix("w", type_name, k, n, data), 2, "test")
    x = rng.standard_normal((33, k)).astype(np.float32)
    whole = head(x)
    for rows in (1, 5, 16):
        assert np.array_equal(head(x[:rows]), whole[:rows])
    assert np.array_equal(head(x[20:21]), whole[20:21])



@pytest.mark.parametrize("type_name", TYPES)
def test_a_single_row_run_as_two_gives_the_batched_rows_bits(type_name: str) -> None:
    # Where the load-time probe finds a one-row kernel with other bits (an AVX2-only AMD EPYC, 4 bits),
    # one row runs as two copies; forced here, so the padded path is checked on every CPU.
    rng = np.random.default_rng(4)
    n, k = 300, 256
    data = ggml.quantize(type_name, rng.standard_normal((n, k)).astype(np.float32))
    head = nbits_head.NbitsHead(BlockMatrix("w", type_name, k, n, data), 2, "test")
    x = rng.standard_normal((9, k)).astype(np.float32)
    whole = head(x)
    head._pad_single = True
    for i in (0, 4, 8):
        one = head(x[i:i + 1], reuse=True)
        assert one.shape == (1, n)
        assert np.array_equal(one, whole[i:i + 1])
    assert np.array_equal(head(x), whole)

def test_reuse_returns_the_heads_buffer_and_a_copy_otherwise() -> None:
    rng = np.random.default_rng(5)
    data = ggml.quantize("Q8_0", rng.standard_normal((64, 64)).astype(np.float32))
    head = nbits_head.NbitsHead(BlockMatrix("w", "Q8_0", 64, 64, data), 1, "test")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    first = head(x, reuse=True)
    assert head(x, reuse=True) is first
    copy = head(x)
    assert copy is not first and np.array_equal(copy, first)
    head(2 * x, reuse=True)
    assert not np.array_equal(first, copy)  # overwritten by the next call of as many rows
    assert np.array_equal(head(x), copy)


def test_the_decoded_arrays_are_freed_only_when_onnx_runtime_reads_none_of_them() -> None:
    rng = np.random.default_rng(9)
    n, k = 128, 128
    data = ggml.quantize("Q8_0", rng.standard_normal((n, k)).astype(np.float32))
    kept = data.copy()
    head = nbits_head.NbitsHead(BlockMatrix("w", "Q8_0", k, n, data), 1, "test")
    assert np.array_equal(data, kept)  # the file's bytes are never written
    assert (head._codes is None) == head.packed_own_copy
    x = rng.standard_normal((3, k)).astype(np.float32)
    check_product("Q8_0", dequantized("Q8_0", data, n, k), x, head(x))  # right after the probe flipped them back


def test_a_type_without_a_row_and_a_short_matrix_are_refused_by_name() -> None:
    rng = np.random.default_rng(1)
    q6 = random_blocks("Q6_K", 4, 256, rng)
    with pytest.raises(ModelLoadError, match=r"'output.weight' is Q6_K; MatMulNBits takes \['Q4_0', 'Q8_0'\]"):
        nbits_head.NbitsHead(BlockMatrix("output.weight", "Q6_K", 256, 4, q6), 1, "model.gguf")
    q8 = random_blocks("Q8_0", 4, 64, rng)
    with pytest.raises(ModelLoadError, match=r"'head' holds 204 bytes for 4 x 64 Q8_0; expected 272"):
        nbits_head.NbitsHead(BlockMatrix("head", "Q8_0", 64, 4, q8[:204]), 1, "model.gguf")


def test_the_kernel_chooses_the_heads_product_by_type_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKIPPY_ZMQ_Q80", "ggml")  # no package Q8_0 product: auto takes MatMulNBits (test_q80.py)
    monkeypatch.setattr("skippy_zmq.compute.ggml._native", {})
    assert Kernel("ggml").head_by_nbits("Q8_0", "f")
    assert Kernel("ggml").head_by_nbits("Q4_0", "f")
    assert not Kernel("ggml").head_by_nbits("Q6_K", "f")  # auto: ggml's product where MatMulNBits has no row
    assert not Kernel("ggml", head="ggml").head_by_nbits("Q8_0", "f")
    assert not Kernel("onnxruntime").head_by_nbits("Q8_0", "f")  # the float32 kernels keep their head
    with pytest.raises(ModelLoadError, match=r"f: \$SKIPPY_ZMQ_HEAD = nbits, .*MatMulNBits takes .*not Q6_K"):
        Kernel("ggml", head="nbits").head_by_nbits("Q6_K", "f")
    monkeypatch.setenv(HEAD_ENV, "ggml")
    assert Kernel.from_environment().head == "ggml"
    monkeypatch.setenv(HEAD_ENV, "fast")
    with pytest.raises(ModelLoadError, match=r"\$SKIPPY_ZMQ_HEAD = 'fast'; expected one of \['auto', 'ggml', 'nbits'\]"):
        Kernel.from_environment()


def test_gguf_names_the_types_of_the_table() -> None:
    # A row is a ggml type name the file's header spells: a typo would never be chosen.
    assert all(hasattr(gguf.GGMLQuantizationType, name) for name in nbits_head.NBITS_TYPES)
