"""Tests of skippy_zmq.codecs: golden bytes, exhaustive half sweeps, RNE edges, s8, policies."""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, TypeVar

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from skippy_zmq.errors import CodecError
from skippy_zmq.wire import codecs
from skippy_zmq.wire.codecs import (
    CODECS,
    LOSSLESS_CANDIDATES,
    ActivationCodec,
    CodecPolicy,
    CodecSpec,
    decode_array,
    decode_values,
    encode_array,
    encode_values,
    encoded_nbytes,
    select_lossless,
)

GenericT = TypeVar("GenericT", bound=np.generic)
RAW = ActivationCodec.RAW_F32_V1
F16 = ActivationCodec.F16_RNE_V1
BF16 = ActivationCodec.BF16_RNE_V1
S8 = ActivationCodec.S8_ROW_F32_RNE_V1
ALL_CODECS = tuple(ActivationCodec)


def f32(*values: float) -> npt.NDArray[np.float32]:
    """A 1-D float32 array."""
    return np.array(values, dtype=np.float32)


def from_bits(*bits: int) -> npt.NDArray[np.float32]:
    """A 1-D float32 array from f32 bit patterns."""
    return np.array(bits, dtype=np.uint32).view(np.float32)


def bits_of(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint32]:
    """The f32 bit patterns of ``values``."""
    return np.ascontiguousarray(values).view(np.uint32)


def halves(payload: bytes) -> list[int]:
    """Little-endian 16-bit words of a payload."""
    words: list[int] = np.frombuffer(payload, dtype="<u2").tolist()
    return words


def bf16_reference(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """The bf16 rounding formula (docs/PROTOCOL.md §4) in uint64 (no wrap), not the kernel."""
    wide = bits_of(values).astype(np.uint64)
    one, sixteen = np.uint64(1), np.uint64(16)
    rounded = (wide + np.uint64(0x7FFF) + ((wide >> sixteen) & one)) >> sixteen
    return rounded.astype(np.uint16)


def f16_reference(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """numpy's own float32 -> float16 conversion (IEEE RNE), for finite in-range values."""
    return values.astype(np.float16).view(np.uint16)


def s8_reference_row(row: list[float]) -> bytes:
    """s8 encoding of one row (docs/PROTOCOL.md §4) with exact rational arithmetic."""
    max_abs = max(abs(v) for v in row)
    floored = max(np.float32(np.float64(max_abs) / 127.0), np.float32(2.0**-149))
    scale = np.float32(1.0) if max_abs == 0 else floored
    exact_scale = Fraction(float(scale))
    quantised = [max(-127, min(127, round(Fraction(v) / exact_scale))) for v in row]
    return scale.tobytes() + np.array(quantised, dtype=np.int8).tobytes()


# --------------------------------------------------------------------------- strategies

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
small_shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6)


@st.composite
def bit_pattern_arrays(draw: st.DrawFn) -> npt.NDArray[np.float32]:
    """float32 arrays of arbitrary bit patterns, NaN payloads and Inf included."""
    shape = draw(small_shapes)
    bits = draw(hnp.arrays(np.uint32, shape, elements=st.integers(0, 2**32 - 1)))
    return bits.view(np.float32)


@st.composite
def finite_arrays(draw: st.DrawFn, *, max_abs: float | None = None) -> npt.NDArray[np.float32]:
    """C-contiguous finite float32 arrays (subnormals included)."""
    shape = draw(small_shapes)
    elements = finite_f32 if max_abs is None else st.floats(-max_abs, max_abs, width=32)
    return draw(hnp.arrays(np.float32, shape, elements=elements))


def exact_half_arrays(codec: ActivationCodec) -> st.SearchStrategy[npt.NDArray[np.float32]]:
    """float32 arrays whose values are exactly representable in the f16 / bf16 ``codec``."""
    exponent = 0x7C00 if codec is F16 else 0x7F80
    words = st.integers(0, 0xFFFF).filter(lambda h: h & exponent != exponent)

    def widen(words: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
        if codec is F16:
            return words.view(np.float16).astype(np.float32)
        return (words.astype(np.uint32) << 16).view(np.float32)

    return small_shapes.flatmap(lambda shape: hnp.arrays(np.uint16, shape, elements=words)).map(
        widen
    )


# --------------------------------------------------------------------------- golden bytes

GOLDEN = [
    (F16, f32(1.0, 1.0004883, 1.0014648, -0.0), "00 3c 00 3c 02 3c 00 80"),
    (BF16, f32(1.0, 1.0039063, 1.0117188, -0.0), "80 3f 80 3f 82 3f 00 80"),
    (
        S8,
        np.array([[0, 0, 0, 0], [-1, -0.5, 0.5, 1]], dtype=np.float32),
        "00 00 80 3f 00 00 00 00 04 02 01 3c 81 c0 40 7f",
    ),
]


@pytest.mark.parametrize(("codec", "values", "golden"), GOLDEN, ids=lambda v: str(v)[:12])
def test_golden_bytes_encode(
    codec: ActivationCodec, values: npt.NDArray[np.float32], golden: str
) -> None:
    assert encode_values(codec.wire_name, values).hex(" ") == golden
    assert encode_values(codec, values).hex(" ") == golden
    assert encode_array(codec, values).tobytes().hex(" ") == golden


def test_golden_bytes_decode() -> None:
    f16 = decode_values("f16-rne-v1", bytes.fromhex(GOLDEN[0][2]), (4,))
    assert f16.tolist() == [1.0, 1.0, 1.001953125, -0.0]
    assert np.signbit(f16[3])
    bf16 = decode_values("bf16-rne-v1", bytes.fromhex(GOLDEN[1][2]), (4,))
    assert bf16.tolist() == [1.0, 1.0, 1.015625, -0.0]
    assert np.signbit(bf16[3])
    s8 = decode_values("s8-row-f32-rne-v1", bytes.fromhex(GOLDEN[2][2]), (2, 4))
    scale = np.float32(1.0) / np.float32(127.0)  # f32(1/127) == the f32 of the f64 quotient
    expected = np.array([[0, 0, 0, 0], [-127, -64, 64, 127]], dtype=np.float32)
    expected[1] *= scale
    assert s8.dtype == np.float32
    assert np.array_equal(bits_of(s8), bits_of(expected))


def test_raw_is_little_endian_f32() -> None:
    values = f32(1.0, -2.5)
    assert encode_values("raw-f32-v1", values) == bytes.fromhex("0000803f000020c0")


# --------------------------------------------------------------------------- exhaustive sweeps

ALL_WORDS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
# f16 arrays up to codecs._NUMPY_CAST_MAX values take numpy's cast, larger ones the kernel.
SMALL = codecs._NUMPY_CAST_MAX
LARGE = codecs._NUMPY_CAST_MAX + 1


def chunked(array: npt.NDArray[GenericT], size: int) -> list[npt.NDArray[GenericT]]:
    """``array`` split into consecutive pieces of at most ``size`` elements."""
    return [array[start : start + size] for start in range(0, array.size, size)]


def _sweep_sample(words: npt.NDArray[np.uint16], exponent: int) -> npt.NDArray[np.uint16]:
    """Every subnormal, the lowest and highest normal binade, and every 61st other pattern."""
    lowest = exponent & -exponent  # biased exponent 1
    exp = words & exponent
    edge = (exp == 0) | (exp == lowest) | (exp == exponent - lowest)
    sample: npt.NDArray[np.uint16] = words[edge | (np.arange(words.size) % 61 == 0)]
    return sample


def test_f16_exhaustive_sweep() -> None:
    finite_words = ALL_WORDS[(ALL_WORDS & 0x7C00) != 0x7C00]
    assert finite_words.size == 65536 - 2048
    oracle = finite_words.view(np.float16).astype(np.float32)

    decoded = decode_values(F16, finite_words.tobytes(), (finite_words.size,))
    assert np.array_equal(bits_of(decoded), bits_of(oracle))  # -0.0 and subnormals included
    assert encode_values(F16, decoded) == finite_words.tobytes()
    # Small arrays (numpy's cast) agree with the kernel.
    small = [decode_values(F16, w.tobytes(), (w.size,)) for w in chunked(finite_words, SMALL)]
    assert np.array_equal(bits_of(np.concatenate(small)), bits_of(oracle))
    assert b"".join(encode_values(F16, v) for v in small) == finite_words.tobytes()

    # auto-lossless-v1 per pattern: bf16 when the f32 also has 16 zero low bits, else f16.
    bf16_exact = (bits_of(decoded) & 0xFFFF) == 0
    assert select_lossless([decoded[bf16_exact]])[0] is BF16
    assert select_lossless([decoded[~bf16_exact]])[0] is F16
    for word in _sweep_sample(finite_words, 0x7C00):
        value = np.array([word], dtype=np.uint16).view(np.float16).astype(np.float32)
        expected = BF16 if (int(bits_of(value)[0]) & 0xFFFF) == 0 else F16
        codec, (encoding,) = select_lossless([value])
        assert codec is expected, hex(word)
        assert encoding.tobytes() == encode_array(codec, value).tobytes()


@pytest.mark.parametrize("size", [11, LARGE])
def test_f16_non_finite_patterns_rejected_by_decode(size: int) -> None:
    non_finite = ALL_WORDS[(ALL_WORDS & 0x7C00) == 0x7C00]
    assert non_finite.size == 2048
    payload = np.full(size, 0x3C00, dtype=np.uint16)
    for word in non_finite:
        payload[5] = word
        with pytest.raises(CodecError, match=rf"f16-rne-v1 payload .*0x{word:04x}.* flat index 5"):
            decode_values(F16, payload, (size,))


def test_bf16_exhaustive_sweep() -> None:
    finite_words = ALL_WORDS[(ALL_WORDS & 0x7F80) != 0x7F80]
    assert finite_words.size == 65536 - 256
    oracle = (finite_words.astype(np.uint32) << 16).view(np.float32)

    decoded = decode_values(BF16, finite_words.tobytes(), (finite_words.size,))
    assert np.array_equal(bits_of(decoded), bits_of(oracle))
    assert encode_values(BF16, decoded) == finite_words.tobytes()

    # Every finite bf16 value is bf16-exact, so bf16 (winning ties with f16) is chosen.
    codec, (encoding,) = select_lossless([decoded])
    assert codec is BF16
    assert encoding.tobytes() == finite_words.tobytes()
    for word in _sweep_sample(finite_words, 0x7F80):
        value = (np.array([word], dtype=np.uint32) << 16).view(np.float32)
        assert select_lossless([value])[0] is BF16, hex(word)


def test_bf16_non_finite_patterns_rejected_by_decode() -> None:
    non_finite = ALL_WORDS[(ALL_WORDS & 0x7F80) == 0x7F80]
    assert non_finite.size == 256
    for word in non_finite:
        payload = np.array([0x3F80, 0x3F80, word], dtype=np.uint16)
        with pytest.raises(CodecError, match=rf"bf16-rne-v1 payload .*0x{word:04x}.* flat index 2"):
            decode_values(BF16, payload.tobytes(), (3,))


# --------------------------------------------------------------------------- f16 rounding


@pytest.mark.parametrize(
    ("value", "word"),
    [
        (1.0 + 2.0**-11, 0x3C00),  # tie, down to even
        (1.0 + 3 * 2.0**-11, 0x3C02),  # tie, up to even
        (1.0 + 2.0**-11 + 2.0**-23, 0x3C01),  # just above a tie
        (-(1.0 + 3 * 2.0**-11), 0xBC02),
        (2048.0 + 1.0, 0x6800),  # tie at spacing 2
        (2048.0 + 3.0, 0x6802),
        (65504.0, 0x7BFF),  # largest finite
        (65519.99609375, 0x7BFF),  # largest f32 below the overflow tie
        (2.0**-14, 0x0400),  # smallest normal
        (2.0**-24, 0x0001),  # smallest subnormal
        (2.0**-25, 0x0000),  # tie between 0 and 2^-24: even is 0
        (2.0**-25 + 2.0**-40, 0x0001),
        (3 * 2.0**-25, 0x0002),  # tie between 1 and 2 ulps: up to even
        (5 * 2.0**-25, 0x0002),  # tie between 2 and 3 ulps: down to even
        (1023.5 * 2.0**-24, 0x0400),  # tie between the largest subnormal and 2^-14
        (1023 * 2.0**-24, 0x03FF),
        (-(2.0**-26), 0x8000),  # rounds to -0.0
        (-0.0, 0x8000),
        (0.0, 0x0000),
        (float(np.float32(1.4e-45)), 0x0000),  # f32 subnormal
    ],
)
def test_f16_round_to_nearest_even(value: float, word: int) -> None:
    values = f32(value)
    assert halves(encode_values(F16, values)) == [word]
    assert halves(encode_values(F16, values)) == f16_reference(values).tolist()
    # The same through the block kernel (small arrays use numpy's cast).
    many = np.full(LARGE, value, dtype=np.float32)
    assert set(halves(encode_values(F16, many))) == {word}


@pytest.mark.parametrize(
    ("bits", "word"),
    [
        (0x3F808000, 0x3F80),  # tie, down to even
        (0x3F818000, 0x3F82),  # tie, up to even
        (0x3F808001, 0x3F81),
        (0xBF818000, 0xBF82),
        (0x00008000, 0x0000),  # f32 subnormal tie
        (0x00018000, 0x0002),
        (0x007FFFFF, 0x0080),  # largest f32 subnormal rounds up to the smallest normal
        (0x7F7F7FFF, 0x7F7F),  # largest value below overflow
        (0x80000000, 0x8000),
    ],
)
def test_bf16_round_to_nearest_even(bits: int, word: int) -> None:
    values = from_bits(bits)
    assert halves(encode_values(BF16, values)) == [word]
    assert bf16_reference(values).tolist() == [word]


def test_f16_matches_numpy_on_random_bit_patterns() -> None:
    rng = np.random.default_rng(7)
    values = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # Uniform bit patterns are mostly tiny or huge; add a dense sample of the f16 range.
    values = np.concatenate([values, (rng.standard_normal(300_000) * 300).astype(np.float32)])
    values = values[np.abs(values) < 65520]
    assert np.array_equal(encode_array(F16, values), f16_reference(values))
    small = [encode_array(F16, v) for v in chunked(values, SMALL)]
    assert np.array_equal(np.concatenate(small), f16_reference(values))


def test_bf16_matches_formula_on_random_bit_patterns() -> None:
    rng = np.random.default_rng(8)
    values = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = values[np.abs(values) < from_bits(0x7F7F8000)[0]]
    assert np.array_equal(encode_array(BF16, values), bf16_reference(values))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            f32(1.0, 2.0, 3.0, 70000.0),
            "F16 activation value is out of range: 70000.0 at flat index 3",
        ),
        (f32(65520.0), "F16 activation value is out of range: 65520.0 at flat index 0"),
        (f32(0.0, -65520.0), "F16 activation value is out of range: -65520.0 at flat index 1"),
        (f32(1.0, np.inf), "F16 activation value is out of range: non-finite inf at flat index 1"),
        (f32(np.nan), "F16 activation value is out of range: non-finite nan at flat index 0"),
    ],
)
def test_f16_out_of_range(values: npt.NDArray[np.float32], message: str) -> None:
    with pytest.raises(CodecError, match=re.escape(message)):
        encode_values(F16, values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            from_bits(0x3F800000, 0x7F7F8000),
            "BF16 activation value is out of range: 3.3961775e+38 at flat index 1",
        ),
        (
            from_bits(0xFF7FFFFF),
            "BF16 activation value is out of range: -3.4028235e+38 at flat index 0",
        ),
        (f32(-np.inf), "BF16 activation value is out of range: non-finite -inf at flat index 0"),
        (
            from_bits(0x7FFFFFFF),
            "BF16 activation value is out of range: non-finite nan at flat index 0",
        ),
        (
            from_bits(0xFFFF8001),
            "BF16 activation value is out of range: non-finite nan at flat index 0",
        ),
    ],
)
def test_bf16_out_of_range(values: npt.NDArray[np.float32], message: str) -> None:
    with pytest.raises(CodecError, match=re.escape(message)):
        encode_values(BF16, values)


@pytest.mark.parametrize("codec", [F16, BF16])
def test_non_finite_payload_found_in_a_later_block(codec: ActivationCodec) -> None:
    payload = np.full(3 * codecs._BLOCK, 0x3C00, dtype=np.uint16)
    index = 2 * codecs._BLOCK + 5
    payload[index] = 0xFFFF
    with pytest.raises(CodecError, match=f"0xffff\\) at flat index {index}"):
        decode_array(codec, payload, (3, codecs._BLOCK))


def test_out_of_range_found_in_a_later_block() -> None:
    values = np.ones((5, codecs._BLOCK), dtype=np.float32)
    values[3, 17] = 123456.0
    index = 3 * codecs._BLOCK + 17
    with pytest.raises(CodecError, match=f"123456.0 at flat index {index}"):
        encode_array(F16, values)
    values[3, 17] = np.nan
    with pytest.raises(CodecError, match=f"non-finite nan at flat index {index}"):
        encode_array(BF16, values)


# --------------------------------------------------------------------------- s8


def s8_rows(payload: bytes, row_len: int) -> list[tuple[float, list[int]]]:
    """(scale, int8 values) per row of an s8 payload."""
    table = np.frombuffer(payload, dtype=np.uint8).reshape(-1, 4 + row_len)
    return [
        (float(np.frombuffer(row[:4].tobytes(), "<f4")[0]), row[4:].view(np.int8).tolist())
        for row in table
    ]


def test_s8_all_zero_rows_use_scale_one() -> None:
    values = np.array([[0.0, -0.0, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    payload = encode_values(S8, values)
    assert s8_rows(payload, 3) == [(1.0, [0, 0, 0]), (1.0, [0, 0, 0])]
    assert decode_values(S8, payload, (2, 3)).tolist() == [[0.0] * 3] * 2


def test_s8_tiny_rows_floor_the_scale_at_the_smallest_subnormal() -> None:
    tiny = float(np.float32(2.0**-149))
    values = np.array([[tiny, 0.0, -tiny], [190 * tiny, 95 * tiny, -tiny]], dtype=np.float32)
    payload = encode_values(S8, values)
    # 1/127 and 190/127 smallest-subnormals round to 0 and 1 of them: scale floored at 2^-149,
    # and 190 is clamped to 127.
    assert s8_rows(payload, 3) == [(tiny, [1, 0, -1]), (tiny, [127, 95, -1])]
    decoded = decode_values(S8, payload, (2, 3))
    assert decoded.tolist() == [[tiny, 0.0, -tiny], [127 * tiny, 95 * tiny, -tiny]]


def test_s8_rounds_half_to_even() -> None:
    # max_abs 127 gives scale exactly 1.0 and max_abs 254 exactly 2.0, so x/scale is k + 0.5.
    values = np.array(
        [
            [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5],
            [254.0, 5.0, 7.0, -5.0, -7.0, 1.0, 3.0, 253.0],
        ],
        dtype=np.float32,
    )
    payload = encode_values(S8, values)
    assert s8_rows(payload, 8) == [
        (1.0, [127, 0, 2, 2, 0, -2, -2, 126]),
        (2.0, [127, 2, 4, -2, -4, 0, 2, 126]),
    ]


def test_s8_rounds_the_exact_quotient_not_a_float32_one() -> None:
    # x/scale is within float32 rounding of k + 0.5 but not a tie: a float32 division would
    # round it onto the tie and then to the wrong even neighbour.
    values = np.array([[1072106070, 1024559497], [1069676080, 1067123776]], dtype=np.uint32).view(
        np.float32
    )
    assert [q for _, q in s8_rows(encode_values(S8, values), 2)] == [[127, 3], [127, 101]]
    assert encode_values(S8, values) == b"".join(
        s8_reference_row([float(v) for v in row]) for row in values
    )


def test_s8_decode_rejects_reserved_minus_128() -> None:
    payload = bytearray(encode_values(S8, np.ones((2, 4), dtype=np.float32)))
    payload[8 + 4 + 2] = 0x80
    with pytest.raises(CodecError, match="reserved int8 value -128 in row 1 column 2"):
        decode_values(S8, bytes(payload), (2, 4))


@pytest.mark.parametrize("scale", [0.0, -0.0, -1.0, float("nan"), float("inf")])
def test_s8_decode_rejects_bad_scales(scale: float) -> None:
    payload = bytearray(encode_values(S8, np.ones((2, 4), dtype=np.float32)))
    payload[8:12] = np.float32(scale).tobytes()
    with pytest.raises(CodecError, match=r"invalid scale .* in row 1; expected a finite positive"):
        decode_values(S8, bytes(payload), (2, 4))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_s8_rejects_non_finite_input(bad: float) -> None:
    values = np.ones((3, 4), dtype=np.float32)
    values[2, 1] = bad
    with pytest.raises(
        CodecError, match=f"S8 activation value is non-finite: {bad} at flat index 9"
    ):
        encode_values(S8, values)


@settings(max_examples=60, deadline=None)
@given(finite_arrays())
def test_s8_matches_exact_reference_and_rows_are_self_contained(
    values: npt.NDArray[np.float32],
) -> None:
    rows = values.reshape(-1, values.shape[-1])
    together = encode_values(S8, values)
    one_by_one = b"".join(encode_values(S8, row) for row in rows)
    assert together == one_by_one
    assert together == b"".join(s8_reference_row([float(v) for v in row]) for row in rows)


@pytest.mark.parametrize("row_len", [codecs._BLOCK // 3 + 1, codecs._BLOCK + 7])
def test_s8_blocks_equal_rows_one_by_one(row_len: int) -> None:
    # 3 rows per kernel block (the last block partial), and rows longer than a block.
    rng = np.random.default_rng(3)
    values = rng.standard_normal((7, row_len)).astype(np.float32)
    values[::3] *= np.float32(1e-30)
    together = encode_array(S8, values).tobytes()
    assert together == b"".join(encode_array(S8, row).tobytes() for row in values)
    decoded = decode_array(S8, together, values.shape)
    assert np.array_equal(
        decoded,
        np.concatenate(
            [decode_array(S8, encode_array(S8, row), (row_len,)) for row in values]
        ).reshape(values.shape),
    )


@settings(max_examples=60, deadline=None)
@given(finite_arrays(max_abs=2.0**100))
def test_s8_error_is_at_most_half_a_step(values: npt.NDArray[np.float32]) -> None:
    decoded = decode_values(S8, encode_values(S8, values), values.shape)
    rows = values.reshape(-1, values.shape[-1]).astype(np.float64)
    for row, back in zip(rows, decoded.reshape(rows.shape).astype(np.float64), strict=True):
        scale = max(np.float32(np.abs(row).max() / 127.0), np.float32(2.0**-149))
        if np.abs(row).max() > 2.0**-100:  # no clamping: the scale is a normal float
            ulp = np.spacing(np.abs(back).astype(np.float32)).astype(np.float64)
            assert np.all(np.abs(row - back) <= float(scale) / 2 + ulp)


# --------------------------------------------------------------------------- round trips


@settings(max_examples=80, deadline=None)
@given(bit_pattern_arrays())
def test_raw_round_trip_is_bit_exact(values: npt.NDArray[np.float32]) -> None:
    payload = encode_values("raw-f32-v1", values)
    assert payload == values.tobytes()
    decoded = decode_values(RAW, payload, values.shape)
    assert decoded.dtype == np.float32 and decoded.shape == values.shape
    assert np.array_equal(bits_of(decoded), bits_of(values))  # NaN payloads too


@pytest.mark.parametrize("codec", [F16, BF16])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_half_round_trip_of_exact_values(codec: ActivationCodec, data: st.DataObject) -> None:
    values = data.draw(exact_half_arrays(codec))
    payload = encode_values(codec, values)
    assert len(payload) == 2 * values.size
    decoded = decode_values(codec, payload, values.shape)
    assert decoded.shape == values.shape
    assert np.array_equal(bits_of(decoded), bits_of(values))


@pytest.mark.parametrize("codec", ALL_CODECS)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_decode_returns_float32_of_the_shape(codec: ActivationCodec, data: st.DataObject) -> None:
    values = data.draw(finite_arrays(max_abs=65504.0))
    payload = encode_array(codec, values)
    assert payload.flags.c_contiguous
    assert payload.nbytes == encoded_nbytes(codec, values.shape)
    decoded = decode_array(codec, payload, values.shape)
    assert decoded.dtype == np.float32
    assert decoded.shape == values.shape


@pytest.mark.parametrize("codec", ALL_CODECS)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_wrong_payload_length_is_rejected(codec: ActivationCodec, data: st.DataObject) -> None:
    shape = data.draw(small_shapes)
    expected = encoded_nbytes(codec, shape)
    got = data.draw(st.integers(0, expected + 8).filter(lambda n: n != expected))
    message = f"{codec.wire_name} payload has {got} bytes; expected {expected} for shape {shape}"
    with pytest.raises(CodecError, match=re.escape(message)):
        decode_array(codec, bytes(got), shape)


@pytest.mark.parametrize("codec", ALL_CODECS)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_encode_does_not_mutate_input(codec: ActivationCodec, data: st.DataObject) -> None:
    values = data.draw(finite_arrays(max_abs=65504.0))
    before = values.copy()
    encode_array(codec, values)
    assert np.array_equal(bits_of(values), bits_of(before))


def test_raw_encode_and_decode_are_zero_copy() -> None:
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert encode_array(RAW, values) is values
    payload = bytearray(values.tobytes())
    decoded = decode_array(RAW, payload, (3, 4))
    assert np.shares_memory(decoded, np.frombuffer(payload, dtype=np.uint8))
    assert not decoded.flags.writeable
    copied = decode_values(RAW, payload, (3, 4))
    assert copied.flags.writeable and not np.shares_memory(copied, decoded)


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_empty_arrays_encode_to_nothing(codec: ActivationCodec) -> None:
    for shape in [(0,), (3, 0), (0, 4)]:
        values = np.zeros(shape, dtype=np.float32)
        assert encoded_nbytes(codec, shape) == 0
        assert encode_values(codec, values) == b""
        assert decode_values(codec, b"", shape).shape == shape


@pytest.mark.parametrize(
    ("codec", "shape", "nbytes"),
    [(RAW, (2, 3), 24), (F16, (2, 3), 12), (BF16, (5,), 10), (S8, (2, 3), 14), (S8, (4, 1, 8), 48)],
)
def test_encoded_nbytes(codec: ActivationCodec, shape: tuple[int, ...], nbytes: int) -> None:
    assert encoded_nbytes(codec, shape) == nbytes
    assert encoded_nbytes(codec.wire_name, shape) == nbytes
    assert len(encode_values(codec, np.ones(shape, dtype=np.float32))) == nbytes


def test_decode_accepts_any_contiguous_buffer() -> None:
    values = f32(1.0, -2.0, 0.5, 3.0)
    payload = encode_values(F16, values)
    for buffer in (
        payload,
        bytearray(payload),
        memoryview(payload),
        np.frombuffer(payload, np.uint16),
    ):
        assert decode_array(F16, buffer, (2, 2)).tolist() == [[1.0, -2.0], [0.5, 3.0]]


# --------------------------------------------------------------------------- input validation


def _error_cases() -> list[tuple[str, Callable[[], object], str]]:
    strided = np.ones((4, 4), dtype=np.float32)[:, ::2]
    # Arguments of the wrong type, on purpose.
    float64: Any = np.ones(3)
    big_endian: Any = np.ones(3, ">f4")
    int32: Any = np.ones(3, np.int32)
    a_list: Any = [1.0, 2.0]
    a_scalar: Any = np.float32(1.0)
    float_dims: Any = (1.5,)
    not_a_buffer: Any = [0, 0]
    return [
        ("float64", lambda: encode_array(F16, float64), "expects float32 values, got dtype <f8"),
        ("float64 values", lambda: encode_values("raw-f32-v1", float64), "got dtype <f8"),
        ("big-endian", lambda: encode_values(BF16, big_endian), "got dtype >f4"),
        ("int32", lambda: encode_values(S8, int32), "got dtype <i4"),
        ("strided", lambda: encode_array(BF16, strided), "expects a C-contiguous array"),
        ("list", lambda: encode_values(F16, a_list), "expects a float32 numpy array, got list"),
        ("scalar", lambda: encode_array(RAW, a_scalar), "expects a float32 numpy array"),
        ("rank 0", lambda: encode_array(RAW, np.array(1.0, np.float32)), "rank >= 1"),
        ("rank 0 shape", lambda: decode_array(RAW, b"", ()), "invalid shape ()"),
        ("negative dim", lambda: encoded_nbytes(F16, (2, -1)), "invalid shape (2, -1)"),
        (
            "float dim",
            lambda: decode_values(F16, b"", float_dims),
            "shape must be a sequence of integers",
        ),
        (
            "not a buffer",
            lambda: decode_array(F16, not_a_buffer, (1,)),
            "must support the buffer protocol",
        ),
        (
            "strided buffer",
            lambda: decode_array(RAW, memoryview(bytes(16))[::2], (2,)),
            "contiguous",
        ),
        (
            "unknown name",
            lambda: encode_values("f8-v1", f32(1.0)),
            "unknown activation codec 'f8-v1'",
        ),
        ("unknown id", lambda: decode_values(9, b"", (1,)), "unknown activation codec id 9"),
        (
            "select float64",
            lambda: select_lossless([float64]),
            "auto-lossless-v1 selection expects float32 values, got dtype <f8",
        ),
    ]


@pytest.mark.parametrize(
    ("name", "call", "message"), _error_cases(), ids=[c[0] for c in _error_cases()]
)
def test_invalid_input_raises_codec_error(
    name: str, call: Callable[[], object], message: str
) -> None:
    with pytest.raises(CodecError, match=re.escape(message)) as info:
        call()
    assert isinstance(info.value, ValueError)


def test_encode_values_makes_float32_views_contiguous() -> None:
    values = np.arange(16, dtype=np.float32).reshape(4, 4)[:, ::2]
    assert encode_values(BF16, values) == encode_values(BF16, np.ascontiguousarray(values))


# --------------------------------------------------------------------------- codecs and policies


def test_wire_ids_and_names() -> None:
    assert [(c.value, c.wire_name) for c in ActivationCodec] == [
        (1, "raw-f32-v1"),
        (2, "f16-rne-v1"),
        (3, "bf16-rne-v1"),
        (4, "s8-row-f32-rne-v1"),
    ]
    assert LOSSLESS_CANDIDATES == (RAW, BF16, F16)


# --------------------------------------------------------------------------- the codec table


def test_the_table_is_the_single_source() -> None:
    # One row per enum member in wire-id order, and no codec known anywhere else.
    assert [row.codec for row in CODECS] == list(ActivationCodec)
    assert [row.wire_name for row in CODECS] == list(codecs._BY_WIRE_NAME)
    assert list(codecs._BY_WIRE_NAME.values()) == list(ActivationCodec)
    assert all(codecs._BY_CODEC[row.codec] is row for row in CODECS)
    assert len(codecs._BY_CODEC) == len(CODECS) == len(ActivationCodec)


@pytest.mark.parametrize("row", CODECS, ids=lambda row: row.wire_name)
def test_rows_round_trip_names_and_ids(row: CodecSpec) -> None:
    assert row.codec.spec is row
    assert row.codec.wire_name == row.wire_name
    assert ActivationCodec.parse(row.wire_name) is row.codec
    assert ActivationCodec.parse(row.codec.value) is row.codec
    assert ActivationCodec.parse(row.codec.value).wire_name == row.wire_name


@pytest.mark.parametrize("row", CODECS, ids=lambda row: row.wire_name)
def test_row_sizes_give_the_payload_size(row: CodecSpec) -> None:
    assert encoded_nbytes(row.codec, (3, 5)) == 3 * (row.row_header_bytes + 5 * row.value_bytes)
    assert len(encode_values(row.codec, np.ones((3, 5), np.float32))) == encoded_nbytes(
        row.codec, (3, 5)
    )


def test_lossless_candidates_and_policies_come_from_the_table() -> None:
    ranked = sorted(
        (row for row in CODECS if row.lossless_order is not None),
        key=lambda row: row.lossless_order or 0,
    )
    assert tuple(row.codec for row in ranked) == LOSSLESS_CANDIDATES
    assert [row.lossless_order for row in ranked] == list(range(len(ranked)))
    assert ranked[0].exact is None and all(row.exact is not None for row in ranked[1:])
    assert CodecPolicy.AUTO_LOSSLESS_V1.admitted(RAW) == LOSSLESS_CANDIDATES
    CodecPolicy.AUTO_LOSSLESS_V1.check_compatible(ranked[0].codec)


def _incoherent_tables() -> list[tuple[str, tuple[CodecSpec, ...], str]]:
    raw, f16, bf16, s8 = CODECS
    return [
        ("extra row", (*CODECS, s8), "one row per ActivationCodec member"),
        ("missing row", (raw, f16, bf16), "one row per ActivationCodec member"),
        ("out of order", (raw, bf16, f16, s8), "in wire-id order"),
        (
            "repeated name",
            (raw, f16, bf16, attrs.evolve(s8, wire_name="f16-rne-v1")),
            "repeated wire name",
        ),
        (
            "two fallbacks",
            (raw, attrs.evolve(f16, lossless_order=0), bf16, s8),
            "must number the candidates 0, 1, ...",
        ),
        (
            "gap in the order",
            (raw, attrs.evolve(f16, lossless_order=3), bf16, s8),
            "must number the candidates 0, 1, ...",
        ),
        (
            "no candidates",
            tuple(attrs.evolve(row, lossless_order=None) for row in CODECS),
            "must number the candidates 0, 1, ...",
        ),
        (
            "candidate without a check",
            (raw, f16, bf16, attrs.evolve(s8, lossless_order=3)),
            "only the lossless fallback (order 0) has no exact check",
        ),
        (
            "fallback with a check",
            (attrs.evolve(raw, exact=f16.exact), f16, bf16, s8),
            "only the lossless fallback (order 0) has no exact check",
        ),
    ]


@pytest.mark.parametrize(
    ("name", "rows", "message"), _incoherent_tables(), ids=[c[0] for c in _incoherent_tables()]
)
def test_an_incoherent_table_is_refused(
    name: str, rows: tuple[CodecSpec, ...], message: str
) -> None:
    with pytest.raises(CodecError, match=re.escape(message)):
        codecs._index(rows)


def test_the_shipped_table_is_coherent() -> None:
    assert codecs._index(CODECS) == {row.codec: row for row in CODECS}


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_codec_parse(codec: ActivationCodec) -> None:
    assert ActivationCodec.parse(codec.wire_name) is codec
    assert ActivationCodec.parse(int(codec)) is codec
    assert ActivationCodec.parse(np.uint8(codec)) is codec  # type: ignore[arg-type]
    assert ActivationCodec.parse(codec) is codec


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "x",
            "unknown activation codec 'x'; expected one of "
            "raw-f32-v1, f16-rne-v1, bf16-rne-v1, s8-row-f32-rne-v1",
        ),
        ("RAW_F32_V1", "unknown activation codec 'RAW_F32_V1'"),
        (9, "unknown activation codec id 9"),
        (0, "unknown activation codec id 0"),
        (True, "must be a wire name or wire id, got bool True"),
        (np.bool_(True), "must be a wire name or wire id, got bool"),
        (1.0, "must be a wire name or wire id, got float 1.0"),
    ],
)
def test_codec_parse_errors(value: object, message: str) -> None:
    with pytest.raises(CodecError, match=re.escape(message)):
        ActivationCodec.parse(value)  # type: ignore[arg-type]


def test_policy_parse() -> None:
    assert CodecPolicy.parse("fixed") is CodecPolicy.FIXED
    assert CodecPolicy.parse("auto-lossless-v1") is CodecPolicy.AUTO_LOSSLESS_V1
    assert CodecPolicy.parse(CodecPolicy.FIXED) is CodecPolicy.FIXED
    for bad in ("auto", "FIXED", 1):
        with pytest.raises(
            CodecError,
            match=re.escape(
                f"unknown activation codec policy {bad!r}; expected one of fixed, auto-lossless-v1"
            ),
        ):
            CodecPolicy.parse(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("configured", [F16, BF16, S8])
def test_auto_lossless_needs_raw(configured: ActivationCodec) -> None:
    message = (
        "activation codec policy auto-lossless-v1 is incompatible with configured codec "
        f"{configured.wire_name}"
    )
    with pytest.raises(CodecError, match=f"^{re.escape(message)}$"):
        CodecPolicy.AUTO_LOSSLESS_V1.check_compatible(configured)
    CodecPolicy.FIXED.check_compatible(configured)


def test_compatible_policies() -> None:
    CodecPolicy.AUTO_LOSSLESS_V1.check_compatible(RAW)
    CodecPolicy.FIXED.check_compatible(RAW)


@pytest.mark.parametrize("configured", ALL_CODECS)
@pytest.mark.parametrize("codec", ALL_CODECS)
def test_admits_matrix(configured: ActivationCodec, codec: ActivationCodec) -> None:
    assert CodecPolicy.FIXED.admits(configured, codec) == (codec is configured)
    assert CodecPolicy.AUTO_LOSSLESS_V1.admits(RAW, codec) == (codec in {RAW, BF16, F16})
    assert CodecPolicy.FIXED.admitted(configured) == (configured,)
    assert CodecPolicy.AUTO_LOSSLESS_V1.admitted(RAW) == (RAW, BF16, F16)


# --------------------------------------------------------------------------- lossless selection


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        ([f32(1.0, 2.0)], BF16),
        ([f32(1.0009766, 2.0)], F16),
        ([f32(1.0009766, 2.0), f32(65536.0, 4.0)], RAW),  # f16-only + bf16-only: raw
        ([f32(65536.0, 4.0), f32(1.0009766, 2.0)], RAW),
        ([f32(1.0, np.nan)], RAW),
        ([f32(np.inf, 1.0)], RAW),
        ([f32(1.0009766), f32(2.0, np.nan)], RAW),
        ([f32(1.0), f32(-np.inf)], RAW),
        ([from_bits(0x7FC00000)], RAW),  # a NaN whose low 16 bits are zero
        ([f32(1.1, 2.0)], RAW),  # neither
        ([f32(-0.0, 0.0)], BF16),
        ([f32(2.0**-14 + 2.0**-24)], F16),  # subnormal-grid value, not bf16-exact
        ([f32(1.0), f32(1.0009766)], F16),  # bf16-exact parts are f16-exact too
        ([f32(65504.0, 1.0009766)], F16),
        ([f32(65520.0, 1.0009766)], RAW),  # f16 overflow is not exact
        ([np.zeros((2, 3), np.float32), f32(3.0)], BF16),
    ],
)
def test_select_lossless(parts: list[npt.NDArray[np.float32]], expected: ActivationCodec) -> None:
    codec, encodings = select_lossless(parts)
    assert codec is expected
    assert len(encodings) == len(parts)
    for part, encoding in zip(parts, encodings, strict=True):
        assert encoding.flags.c_contiguous
        assert encoding.tobytes() == encode_array(codec, part).tobytes()
        if codec is RAW:
            assert encoding is part  # raw is zero copy
        else:
            decoded = decode_array(codec, encoding, part.shape)
            assert np.array_equal(bits_of(decoded), bits_of(part))  # lossless


def test_select_lossless_empty_frames_are_raw() -> None:
    assert select_lossless([]) == (RAW, [])
    empty = np.zeros((0, 4), np.float32)
    codec, encodings = select_lossless([empty])
    assert codec is RAW and encodings[0] is empty


@pytest.mark.parametrize(
    ("poison", "expected"),
    [(np.float32(1.0009766), F16), (np.float32(np.nan), RAW), (np.float32(1.1), RAW)],
)
def test_select_lossless_looks_at_every_block(
    poison: np.float32, expected: ActivationCodec
) -> None:
    values = np.full((4, codecs._BLOCK), 2.0, dtype=np.float32)
    values[-1, -1] = poison
    codec, (encoding,) = select_lossless([values])
    assert codec is expected
    assert encoding.tobytes() == encode_array(codec, values).tobytes()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        bit_pattern_arrays() | exact_half_arrays(F16) | exact_half_arrays(BF16),
        min_size=1,
        max_size=3,
    )
)
def test_select_lossless_agrees_with_the_rule(parts: list[npt.NDArray[np.float32]]) -> None:
    flat = np.concatenate([bits_of(p).reshape(-1) for p in parts]).view(np.float32)
    finite = bool(np.isfinite(flat).all())
    bf16_exact = finite and bool(((bits_of(flat) & 0xFFFF) == 0).all())
    in_range = finite and bool((np.abs(flat) < 65520).all())
    f16_exact = in_range and np.array_equal(
        bits_of(flat.astype(np.float16).astype(np.float32)), bits_of(flat)
    )
    expected = BF16 if bf16_exact else F16 if f16_exact else RAW
    codec, encodings = select_lossless(parts)
    assert codec is expected
    assert [e.tobytes() for e in encodings] == [encode_array(codec, p).tobytes() for p in parts]


def test_f16_refuses_to_run_when_subnormals_are_flushed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stands in for FTZ/DAZ: the probe product comes out zero.
    monkeypatch.setattr(codecs, "_SUBNORMAL_PROBE", np.float32(0.0))
    with pytest.raises(CodecError, match="needs IEEE subnormal arithmetic"):
        encode_array(F16, f32(1.0))
    with pytest.raises(CodecError, match="needs IEEE subnormal arithmetic"):
        decode_array(F16, bytes(2), (1,))
