"""Tests of skippy_zmq.compute.ggml: products from a matrix's own blocks agree with gguf-py's
dequantize for every supported type (random blocks, hypothesis), fused products equal separate
ones, the same input gives the same bits, and bad input is refused by name."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy_zmq.compute import huge_pages
from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.gguf_model import BlockMatrix, GGUFModel

ggml = pytest.importorskip("skippy_zmq.compute.ggml")
if ggml.unavailable() is not None:  # the model extra is not installed: the float32 kernels still are
    pytest.skip(f"ggml kernel unavailable: {ggml.unavailable()}", allow_module_level=True)

import gguf  # noqa: E402 - after the skip: the model extra brings both

# Block layouts (ggml-common.h): bytes per block of `block` values, and where its float16 scale
# and minimum fields sit. Random bytes make every other field (codes, packed sub-scales) arbitrary.
LAYOUTS: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "Q4_0": (32, 18, (0,)),
    "Q4_1": (32, 20, (0, 2)),
    "Q5_0": (32, 22, (0,)),
    "Q5_1": (32, 24, (0, 2)),
    "Q8_0": (32, 34, (0,)),
    "Q2_K": (256, 84, (80, 82)),
    "Q3_K": (256, 110, (108,)),
    "Q4_K": (256, 144, (0, 2)),
    "Q5_K": (256, 176, (0, 2)),
    "Q6_K": (256, 210, (208,)),
    "IQ2_XXS": (256, 66, (0,)),
    "IQ2_XS": (256, 74, (0,)),
    "IQ3_XXS": (256, 98, (0,)),
    "IQ1_S": (256, 50, (0,)),
    "IQ4_NL": (32, 18, (0,)),
    "IQ3_S": (256, 110, (0,)),
    "IQ2_S": (256, 82, (0,)),
    "IQ4_XS": (256, 136, (0,)),
    "IQ1_M": (256, 56, ()),  # its float16 scale is the top nibbles of its four 16-bit scales (random_blocks)
    "TQ1_0": (256, 54, (52,)),
    "TQ2_0": (256, 66, (64,)),
    "MXFP4": (32, 17, ()),  # an E8M0 exponent byte first, no float16 (random_blocks)
}
NEEDS_IMATRIX = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
"""Types ggml quantizes only with an importance matrix: tested on random blocks alone."""
FLOATS = ("F32", "F16", "BF16")
# ggml quantizes the activations to 8 bits per block for the quantized types (error about
# |x|max/254 per value), and rounds them to the weight's float type for F16 and BF16.
TOLERANCE = {"F32": 1e-6, "F16": 2e-3, "BF16": 1.6e-2, **dict.fromkeys(LAYOUTS, 1.2e-2)}


def random_blocks(type_name: str, n: int, k: int, rng: np.random.Generator) -> npt.NDArray[np.uint8]:
    """n rows of k values of `type_name`: random bytes with finite, moderate scales."""
    if type_name == "F32":
        return rng.standard_normal((n, k)).astype(np.float32).view(np.uint8).reshape(-1)
    if type_name == "F16":
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8).reshape(-1)
    if type_name == "BF16":
        bits = rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8).reshape(-1)
    block, size, halves = LAYOUTS[type_name]
    data = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for offset in halves:
        scale = rng.uniform(0.001, 0.05, size=data.shape[0]).astype(np.float16)
        data[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    if type_name == "MXFP4":  # the block's scale is 2^(e - 127): keep it at most 1
        data[:, 0] = rng.integers(117, 128, size=data.shape[0], dtype=np.uint8)
    if type_name == "IQ1_M":  # the f16 scale's nibbles, low first, are the top nibbles of the 16-bit scales
        bits = rng.uniform(0.001, 0.05, size=data.shape[0]).astype(np.float16).view(np.uint16)
        scales = data[:, 48:56].copy().view(np.uint16)  # (blocks, 4), little-endian
        for i in range(4):
            scales[:, i] = (scales[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12).astype(np.uint16)
        data[:, 48:56] = scales.view(np.uint8)
    return data.reshape(-1)


def dequantized(type_name: str, data: npt.NDArray[np.uint8], n: int, k: int) -> npt.NDArray[np.float64]:
    """gguf-py's values of the blocks, (n, k) float64: the reference."""
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        raw: np.ndarray = data.view(np.float32).reshape(n, k)
    elif type_name == "F16":
        raw = data.view(np.float16).reshape(n, k)
    else:
        raw = data.reshape(n, -1)
    return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float64).reshape(n, k)


def check_product(type_name: str, w: npt.NDArray[np.float64], x: npt.NDArray[np.float32],
                  y: npt.NDArray[np.float32]) -> None:
    """|y - x W^T| within the type's tolerance of sum |x| |W| (ggml's activation rounding)."""
    reference = x.astype(np.float64) @ w.T
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T * TOLERANCE[type_name] + 1e-6
    assert y.shape == reference.shape
    excess = np.abs(y - reference) - bound
    assert np.all(np.isfinite(y))
    assert excess.max() <= 0, f"{type_name}: worst error over its bound by {excess.max():.3g}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(type_name=st.sampled_from(sorted([*LAYOUTS, *FLOATS])), n=st.integers(1, 24), blocks=st.integers(1, 3),
       rows=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), threads=st.sampled_from([1, 2]))
def test_random_blocks_of_every_type_agree_with_gguf_dequantize(
    type_name: str, n: int, blocks: int, rows: int, seed: int, threads: int
) -> None:
    rng = np.random.default_rng(seed)
    k = blocks * (LAYOUTS[type_name][0] if type_name in LAYOUTS else 32)
    data = random_blocks(type_name, n, k, rng)
    graphs = ggml.MatmulGraphs([BlockMatrix("w", type_name, k, n, data)], threads)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    check_product(type_name, dequantized(type_name, data, n, k), x, graphs(x))


@pytest.mark.parametrize("type_name", sorted({*LAYOUTS, *FLOATS} - set(NEEDS_IMATRIX)))
def test_ggml_quantized_weights_of_every_type_agree_too(type_name: str) -> None:
    # Blocks as ggml's own quantizer writes them (what real files hold), at the shapes' edges.
    rng = np.random.default_rng(7)
    n, k = 33, 512
    data = ggml.quantize(type_name, rng.standard_normal((n, k)).astype(np.float32))
    graphs = ggml.MatmulGraphs([BlockMatrix("w", type_name, k, n, data)], 1)
    for rows in (1, 7, 8, 16, 33):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        check_product(type_name, dequantized(type_name, data, n, k), x, graphs(x))


def test_repacking_follows_the_cpu_backends_rule() -> None:
    lib = ggml.Library.get()
    if lib.repack_buffer_type is None:
        assert not lib.repacks("Q4_K", 64)  # no AVX2 or no repacking build: nothing is repacked
        return
    assert lib.repacks("Q4_K", 64) and lib.repacks("Q4_0", 8)
    assert not lib.repacks("Q4_K", 12)  # rows not a multiple of 8
    assert not any(lib.repacks(t, 64) for t in ("Q6_K", "Q5_0", "Q8_0", "F32"))  # no x86 kernel in this build


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K"])
def test_repacked_weights_compute_the_same_products_and_leave_the_source_bytes_alone(type_name: str) -> None:
    # The interleaved kernels sum in another order than the row-by-row ones: equal within the
    # activation rounding's bound, not bit for bit; bytes made in memory are never dropped.
    lib = ggml.Library.get()
    if lib.repack_buffer_type is None:
        pytest.skip("this CPU or ggml build repacks nothing")
    rng = np.random.default_rng(11)
    n, k = 64, 512
    data = ggml.quantize(type_name, rng.standard_normal((n, k)).astype(np.float32))
    kept = data.copy()
    plain = ggml.MatmulGraphs([BlockMatrix("w", type_name, k, n, data)], 1)
    repacked = ggml.MatmulGraphs([BlockMatrix("w", type_name, k, n, data)], 1, repack=True)
    assert repacked.weights.repacked_bytes == data.nbytes and plain.weights.repacked_bytes == 0
    for rows in (1, 4, 16):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        check_product(type_name, dequantized(type_name, data, n, k), x, repacked(x))
        np.testing.assert_allclose(repacked(x), plain(x), rtol=0, atol=1e-3 * float(np.abs(plain(x)).max()))
    assert np.array_equal(data, kept)


def test_a_file_backed_matrix_is_copied_onto_huge_pages_and_multiplies_to_the_same_bits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 160 rows of 128 Q6_K blocks: 4.3 MB, a whole huge page at least wherever ggml puts them.
    rng = np.random.default_rng(13)
    n, k = 160, 128 * 256
    path = tmp_path / "w.bin"
    ggml.quantize("Q6_K", rng.standard_normal((n, k)).astype(np.float32)).tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")

    def graphs(mode: str, file_backed: bool = True, rows: int = n) -> ggml.MatmulGraphs:
        monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, mode)
        data = mapped[:ggml.Library.get().ggml_row_size(ggml.GGML_TYPES["Q6_K"], k) * rows]
        return ggml.MatmulGraphs([BlockMatrix("w", "Q6_K", k, rows, data, file_backed=file_backed)], 1)

    on, off = graphs("on"), graphs("off")
    assert off.weights.copied_bytes == 0 and off.weights.huge_bytes == 0
    if huge_pages.kernel_mode() == "never":
        assert on.weights.copied_bytes == 0  # a copy would buy nothing
    else:
        assert on.weights.copied_bytes == mapped.nbytes and on.weights.huge_bytes >= huge_pages.HUGE_PAGE
    assert graphs("on", file_backed=False).weights.copied_bytes == 0  # bytes made in memory stay
    assert graphs("on", rows=80).weights.copied_bytes == 0  # 2.15 MB may hold no whole huge page
    for rows in (1, 4, 33):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        assert np.array_equal(on(x), off(x))
    assert np.array_equal(mapped, np.fromfile(path, dtype=np.uint8))  # the file's pages read the same


def test_a_fused_product_is_its_parts_side_by_side_and_repeats_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    k = 256
    parts = [BlockMatrix(f"w{i}", t, k, n, ggml.quantize(t, rng.standard_normal((n, k)).astype(np.float32)))
             for i, (t, n) in enumerate([("Q5_0", 64), ("Q8_0", 16), ("Q4_K", 40)])]
    fused = ggml.MatmulGraphs(parts, 1)
    alone = [ggml.MatmulGraphs([part], 1) for part in parts]
    for rows in (1, 5, 12):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        y = fused(x)
        assert y.shape == (rows, 120)
        assert np.array_equal(y, np.concatenate([a(x) for a in alone], axis=1))
        assert np.array_equal(y, fused(x.copy()))


def test_more_row_counts_than_graphs_kept_still_compute_right() -> None:
    rng = np.random.default_rng(4)
    data = ggml.quantize("Q8_0", rng.standard_normal((8, 64)).astype(np.float32))
    graphs = ggml.MatmulGraphs([BlockMatrix("w", "Q8_0", 64, 8, data)], 1)
    w = dequantized("Q8_0", data, 8, 64)
    for rows in [*range(1, ggml.GRAPHS_PER_MATRIX + 5), 1, 2]:
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        check_product("Q8_0", w, x, graphs(x))
    assert len(graphs._graphs) == ggml.GRAPHS_PER_MATRIX
    assert graphs(np.zeros((0, 64), np.float32)).shape == (0, 8)


def test_unaligned_bytes_are_used_through_an_aligned_copy() -> None:
    rng = np.random.default_rng(5)
    data = ggml.quantize("Q4_0", rng.standard_normal((4, 64)).astype(np.float32))
    store = np.empty(data.nbytes + ggml.TENSOR_ALIGNMENT, np.uint8)
    start = (1 - store.ctypes.data) % ggml.TENSOR_ALIGNMENT  # one byte past an aligned address
    shifted = store[start:start + data.nbytes]
    shifted[:] = data
    assert shifted.ctypes.data % ggml.TENSOR_ALIGNMENT != 0
    graphs = ggml.MatmulGraphs([BlockMatrix("w", "Q4_0", 64, 4, shifted)], 1)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    check_product("Q4_0", dequantized("Q4_0", data, 4, 64), x, graphs(x))


def test_bad_matrices_are_refused_by_name() -> None:
    data = np.zeros(18 * 2, np.uint8)
    with pytest.raises(ModelLoadError) as caught:
        ggml.MatmulGraphs([BlockMatrix("blk.3.ffn_up.weight", "Q8_K", 64, 1, data)], 1, where="m.gguf")
    assert str(caught.value).startswith("m.gguf: tensor 'blk.3.ffn_up.weight' has type Q8_K, which the ggml "
                                        "kernel does not support; supported: F32, F16, Q4_0,")
    with pytest.raises(ModelLoadError, match="quantize: IQ2_XS needs an importance matrix"):
        ggml.quantize("IQ2_XS", np.zeros((1, 256), np.float32))
    with pytest.raises(ModelLoadError, match=r"tensor 'w' \(Q4_0, 3 x 64\) has 36 bytes of data; its shape needs 108"):
        ggml.MatmulGraphs([BlockMatrix("w", "Q4_0", 64, 3, data)], 1)
    with pytest.raises(ModelLoadError, match="rows of 48 values are not whole Q4_0 blocks of 32"):
        ggml.MatmulGraphs([BlockMatrix("w", "Q4_0", 48, 1, data[:27])], 1)
    with pytest.raises(ModelLoadError, match="a fused product needs matrices of one input width"):
        ggml.MatmulGraphs([BlockMatrix("a", "Q4_0", 32, 1, data[:18]),
                           BlockMatrix("b", "Q4_0", 64, 1, data)], 1)
    with pytest.raises(ModelLoadError, match="block bytes must be a 1-D uint8 view"):
        BlockMatrix("w", "F32", 4, 1, np.zeros(4, np.float32))  # type: ignore[arg-type]


def test_a_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ggml.Library, "_instance", None)
    monkeypatch.setenv(ggml.LIB_ENV, str(tmp_path))
    why = ggml.unavailable()
    assert why is not None
    assert f"the ggml kernel needs libggml-base.so in {tmp_path}, which has none" in why
    assert "pip install -e '.[model]'" in why
    from skippy_zmq.runtime.kernels import Kernel

    with pytest.raises(ModelLoadError, match="kernel 'ggml' cannot run here: the ggml kernel needs"):
        Kernel("ggml")
    assert Kernel("numpy").name == "numpy"  # the float32 path does not need it


def test_a_tensor_is_placed_only_on_an_array_of_its_bytes() -> None:
    lib = ggml.Library.get()
    host = ggml.HostArrays(lib)
    ctx = lib.ggml_init(ggml.InitParams(lib.ggml_tensor_overhead() * 2, None, True))
    try:
        tensor = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES["F32"], 8, 3)  # (3, 8) float32: 96 bytes
        array = host.empty((3, 8))
        assert array.ctypes.data % ggml.TENSOR_ALIGNMENT == 0 and not array.any()
        with pytest.raises(ModelLoadError, match="96 bytes cannot be placed on an array of 64 bytes"):
            host.place(tensor, host.empty((2, 8)))
        with pytest.raises(ModelLoadError, match="on a strided array of 96 bytes"):
            host.place(tensor, host.empty((3, 16))[:, ::2])
        host.place(tensor, array)
        assert lib.ggml_get_data(tensor) == array.ctypes.data
    finally:
        lib.ggml_free(ctx)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3", "llama_scaled", "gemma3_scaled", "llama_freqs", "llama_yarn",
                                  "qwen2_yarn"])
def test_the_ggml_kernel_gives_llama_cpps_logits_on_tiny_models(request: pytest.FixtureRequest, arch: str) -> None:
    # llama.cpp (llama-cpp-python, CPU buffers only: its AMX ones die on some Intel machines) is the
    # oracle for both architectures: on the tiny files' Q8_0 and F32 tensors the ggml kernel's
    # graphs (compute/graphs.py) are llama.cpp's computation, and 13 positions take the tiny
    # Gemma 3's sliding window (8) into play. Measured: equal to the last bit on both files, where
    # the float32 path differs by 0.085 (llama) and 0.099 (gemma3), logits of order 4. The float32
    # oracle tests keep f32: llama.cpp runs with an F32 cache here. The
    # "_scaled" files carry linear RoPE scaling (factor 8): every llama layer and the gemma3 global
    # layer scale their positions, as llama.cpp reads the keys; "llama_freqs" divides the angles by a
    # rope_freqs.weight; "_yarn" files blend scaled and unscaled angles by YaRN's ramp, with the
    # attention factor llama.cpp derives (and a file's own on the llama one).
    _agree_with_llama_cpp(request.getfixturevalue(f"tiny_{arch}_path"), "f32")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_with_an_f16_cache_the_ggml_kernel_gives_llama_cpps_logits_too(request: pytest.FixtureRequest,
                                                                       arch: str) -> None:
    # llama.cpp with its default F16 cache (GGML_TYPE_F16 = 1): keys and values rounded to f16
    # when stored, q and the softmaxed scores to f16 in the two products, float32 sums. The same
    # bound as the F32 oracle's. Measured: equal to the last bit on both files, where the f32
    # cache's logits differ from these by 0.079 (llama) and 0.081 (gemma3), logits of order 4.
    _agree_with_llama_cpp(request.getfixturevalue(f"tiny_{arch}_path"), "f16")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_decode_steps_give_llama_cpps_decode_logits_bit_for_bit(request: pytest.FixtureRequest, arch: str) -> None:
    # A prompt, then one token a step, on both sides with llama.cpp's default f16 cache: each step's
    # logits equal llama.cpp's step's to the last bit (one thread, ggml's head, no repacking on either side).
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime
    from tests.pipeline_helpers import plain_llama

    path: Path = request.getfixturevalue(f"tiny_{arch}_path")
    prompt = [2, 300, 301, 460, 302, 310, 311, 512, 300, 301, 302, 303, 304]
    llm = plain_llama(path, n_ctx=64, n_threads=1, logits_all=True, type_k=1, type_v=1)  # 1: GGML_TYPE_F16
    llm.eval(prompt[:5])
    runtime = StageRuntime.load(path, 0, GGUFModel(path).hparams.n_layer, ctx_size=64,
                                kernel=Kernel("ggml", 1, head="ggml", repack=False), weight_cache=None)
    runtime.open_session(1)
    runtime.forward(1, 0, np.array(prompt[:5], np.int32))
    for pos in range(5, len(prompt)):
        llm.eval([prompt[pos]])
        ours = runtime.logits(runtime.forward(1, pos, np.array(prompt[pos:pos + 1], np.int32)))[0]
        assert np.array_equal(ours, np.asarray(llm.scores[llm.n_tokens - 1], np.float32)), f"step at {pos}"


# Every weight type a file of llama.cpp's may hold that ggml's quantizer writes without an importance matrix:
# 32-value blocks on the 64-wide tiny models, 256-value blocks on 256-wide ones.
FILE_TYPES = [("Q4_0", 64), ("Q4_1", 64), ("Q5_0", 64), ("Q5_1", 64), ("IQ4_NL", 64), ("MXFP4", 64),
              ("Q2_K", 256), ("Q3_K", 256), ("Q4_K", 256), ("Q5_K", 256), ("Q6_K", 256), ("IQ3_XXS", 256),
              ("IQ3_S", 256), ("IQ4_XS", 256), ("TQ1_0", 256), ("TQ2_0", 256), ("BF16", 64), ("F16", 64)]


@pytest.mark.slow
@pytest.mark.parametrize(("weight_type", "width"), FILE_TYPES, ids=[t for t, _ in FILE_TYPES])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_files_of_every_weight_type_give_llama_cpps_logits(tmp_path: Path, arch: str, weight_type: str,
                                                           width: int) -> None:
    # The matrices (and the embedding table) in `weight_type`, quantized by ggml as llama.cpp's tools
    # do; both sides multiply without repacking, by ggml's products, so the logits are llama.cpp's.
    from skippy_zmq.testing.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / f"{arch}-{weight_type}.gguf", arch=arch, n_layer=2, n_embd=width,
                            n_ff=2 * width, weight_type=weight_type)
    _agree_with_llama_cpp(path, "f32", repack=False)


@pytest.mark.slow
def test_with_the_matmulnbits_head_the_logits_stay_within_its_rounding_of_llama_cpps(
        tiny_gemma3_path: Path) -> None:
    # The default head product (compute/nbits_head.py; the tiny Gemma 3's tied Q8_0 table, the tiny
    # llama's head is F32) quantizes the normed rows to int8 per block of 32 with a float32 scale where
    # ggml rounds that scale to float16: the same tokens, logits within 1e-3 of their largest
    # (measured: 1.4e-3 of logits up to 4.4).
    _agree_with_llama_cpp(tiny_gemma3_path, "f32", head="nbits", bound=1e-3)


def _agree_with_llama_cpp(path: Path, cache: str, head: str = "ggml", bound: float = 1e-5,
                          repack: bool = True) -> None:
    from skippy_zmq.compute.kv_cache import CACHE_TYPES
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime
    from tests.pipeline_helpers import plain_llama

    ggml_type = CACHE_TYPES[cache].ggml_type
    llm = plain_llama(path, n_ctx=128, n_threads=1, logits_all=True, type_k=ggml_type, type_v=ggml_type)
    prompt = [2, 300, 301, 460, 302, 310, 311, 512, 300, 301, 302, 303, 304]
    llm.eval(prompt)
    reference = np.array(llm.scores[: len(prompt)], dtype=np.float32)
    n_layer = GGUFModel(path).hparams.n_layer
    runtime = StageRuntime.load(path, 0, n_layer, ctx_size=128, kernel=Kernel("ggml", head=head, repack=repack),
                                weight_cache=None, cache_type_k=cache, cache_type_v=cache)
    runtime.open_session(1)
    logits = runtime.logits(runtime.forward(1, 0, np.array(prompt, np.int32)))
    assert np.array_equal(logits.argmax(axis=1), reference.argmax(axis=1))
    # With ggml's head bit-equal on this machine; the bound leaves room for another CPU's summation
    # order in attention.
    assert float(np.abs(logits - reference).max()) < bound * float(np.abs(reference).max())


def test_ggml_says_warnings_through_the_logger_and_keeps_its_debug_lines_off_stderr(
        tiny_qwen3moe_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    from skippy_zmq.compute.engine import GgmlEngine
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime
    from skippy_zmq.tokens.llama_vocab import LlamaVocab

    lib = ggml.Library.get()
    LlamaVocab.load(tiny_qwen3moe_path)  # llama.cpp's library takes ggml's logger as it loads a vocabulary
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger="skippy_zmq.compute.ggml"):
        runtime = StageRuntime.load(tiny_qwen3moe_path, 0, 2, ctx_size=32, kernel=Kernel("ggml", repack=True),
                                    weight_cache=None)
        assert isinstance(runtime.engine, GgmlEngine)
        assert runtime.engine.graphs.repacked_bytes > 0  # its Q4_K experts repacked: ggml says so at DEBUG
        lib.log.callback(1, b"a debug line\n", None)
        lib.log.callback(3, b"a warning, ", None)
        lib.log.callback(5, b"continued\n", None)
        lib.log.callback(2, b"an info line, ", None)
        lib.log.callback(5, b"continued too\n", None)
        lib.log.callback(4, b"an error\n", None)
    assert "repack" not in capfd.readouterr().err
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "ggml: a warning,"), ("WARNING", "ggml: continued"), ("ERROR", "ggml: an error")]
