"""Random but valid quantized blocks of a ggml type, values N(0, sigma²)-like once dequantized.

Q4_K and Q6_K (which gguf.quants cannot quantize) are composed from random fields in ggml's
block layouts (docs/PROTOCOL.md §7, "Products"); the 32-value types (Q5_0, Q8_0, ...) are
gguf.quants' quantization of normal values, and the types gguf.quants cannot quantize (Q5_K)
ggml's. A tensor of millions of blocks is drawn at random from a pool of a few thousand per
(type, sigma), so writing gigabytes costs a gather, not a quantization. gguf.quants.dequantize is
the reference of what the bytes mean.
"""

from __future__ import annotations

import zlib
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.compute import ggml
from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.gguf_model import require_gguf

QK_K = 256  # values per K-quant super-block
POOL_BLOCKS = 1 << 11  # blocks per pool; mixed parts make 2048**3 (Q6_K) or 2048**5 (Q4_K) blocks of it

U8 = npt.NDArray[np.uint8]

# Q4_K: 4-bit codes q in 0..15 around the middle, value d*sc*q - dmin*m per 32-value sub-block.
_Q4_CODE_STD = 3.5  # before clipping to 0..15 (about 3.3 after), as a normal sub-block's min-max fit gives
_Q4_SCALES = (32, 63)  # 6-bit sub-block scales, drawn uniformly
# Q6_K: 6-bit codes q - 32 in -31..31, value d*sc*(q - 32) per 16-value sub-block.
_Q6_CODE_STD = 12.0
_Q6_SCALES = (64, 127)  # int8 sub-block scales
_D_JITTER = 0.1  # log-normal spread of a block's d, as blocks of different ranges have


def pack_q4_k(q: U8, sc: U8, m: U8, d: npt.NDArray[np.float16], dmin: npt.NDArray[np.float16]) -> U8:
    """Q4_K blocks (n, 144) from codes q (n, 256) in value order, 6-bit sc and m (n, 8), d and dmin (n,).

    Layout (ggml's block_q4_K): d, dmin (f16), 12 bytes of packed scales and mins, 128 bytes of
    codes: each 64 values are 32 bytes, the first 32 values in the low nibbles, the next in the high.
    """
    n = q.shape[0]
    out = np.empty((n, 144), dtype=np.uint8)
    out[:, 0:2] = d.astype("<f2").reshape(n, 1).view(np.uint8)
    out[:, 2:4] = dmin.astype("<f2").reshape(n, 1).view(np.uint8)
    scales = out[:, 4:16]
    # Sub-blocks 0-3 keep 6 bits in bytes 0-7; 4-7 keep their low nibbles in bytes 8-11 and
    # their top 2 bits in the top bits of bytes 0-7.
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    codes = q.reshape(n, 4, 2, 32)  # (n, 64-value chunk, half, 32)
    out[:, 16:144] = (codes[:, :, 0, :] | (codes[:, :, 1, :] << 4)).reshape(n, 128)
    return out


def pack_q6_k(q: U8, sc: npt.NDArray[np.int8], d: npt.NDArray[np.float16]) -> U8:
    """Q6_K blocks (n, 210) from codes q (n, 256) in 0..63, value order, int8 sc (n, 16) and d (n,).

    Layout (ggml's block_q6_K): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
    scales, d (f16). Each 128 values: quarter k of 32 takes nibble (k // 2) of low byte
    32 * (k % 2) + l and bits 2k..2k+1 of high byte l.
    """
    n = q.shape[0]
    codes = q.reshape(n, 2, 4, 32)  # (n, 128-value half, quarter, 32)
    low, high = codes & 15, codes >> 4
    out = np.empty((n, 210), dtype=np.uint8)
    ql = out[:, 0:128].reshape(n, 2, 2, 32)
    ql[:, :, 0, :] = low[:, :, 0, :] | (low[:, :, 2, :] << 4)
    ql[:, :, 1, :] = low[:, :, 1, :] | (low[:, :, 3, :] << 4)
    out[:, 128:192] = (high[:, :, 0, :] | (high[:, :, 1, :] << 2) | (high[:, :, 2, :] << 4)
                       | (high[:, :, 3, :] << 6)).reshape(n, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.astype("<f2").reshape(n, 1).view(np.uint8)
    return out


def _block_d(rng: np.random.Generator, n: int, sigma: float, code_std: float, scales: tuple[int, int]
             ) -> npt.NDArray[np.float16]:
    """Each block's d, so that d * mean scale * code std is sigma, with a block-to-block spread."""
    mean_scale = (scales[0] + scales[1]) / 2
    d = sigma / (code_std * mean_scale) * np.exp(_D_JITTER * rng.standard_normal(n))
    return d.astype(np.float16)


def random_q4_k(rng: np.random.Generator, n: int, sigma: float) -> U8:
    """n random Q4_K blocks whose values have mean 0 and standard deviation about sigma."""
    q = np.clip(np.rint(7.5 + _Q4_CODE_STD * rng.standard_normal((n, QK_K), dtype=np.float32)), 0, 15).astype(np.uint8)
    sc = rng.integers(_Q4_SCALES[0], _Q4_SCALES[1] + 1, (n, 8), dtype=np.uint8)
    d = _block_d(rng, n, sigma, _Q4_CODE_STD, _Q4_SCALES)
    dmin = (d.astype(np.float32) * 7.5).astype(np.float16)
    # The min m*dmin cancels the codes' mean 7.5*d*sc: a sub-block is centred on 0.
    ratio = 7.5 * d.astype(np.float64) / dmin.astype(np.float64)
    m = np.clip(np.rint(sc * ratio[:, None]), 0, 63).astype(np.uint8)
    return pack_q4_k(q, sc, m, d, dmin)


def random_q6_k(rng: np.random.Generator, n: int, sigma: float) -> U8:
    """n random Q6_K blocks whose values have mean 0 and standard deviation about sigma."""
    codes = np.clip(np.rint(_Q6_CODE_STD * rng.standard_normal((n, QK_K), dtype=np.float32)), -31, 31)
    q = (32 + codes).astype(np.uint8)
    sc = rng.integers(_Q6_SCALES[0], _Q6_SCALES[1] + 1, (n, 16), dtype=np.int8)
    return pack_q6_k(q, sc, _block_d(rng, n, sigma, _Q6_CODE_STD, _Q6_SCALES))


def random_blocks_of(type_name: str, rng: np.random.Generator, n: int, sigma: float) -> U8:
    """n random blocks of a ggml type as (n, block bytes); a float type's "block" is one value."""
    if type_name == "Q4_K":
        return random_q4_k(rng, n, sigma)
    if type_name == "Q6_K":
        return random_q6_k(rng, n, sigma)
    gguf = require_gguf()
    try:
        qtype = gguf.GGMLQuantizationType[type_name]
    except KeyError:
        raise ModelLoadError(f"random blocks: ggml type {type_name!r} is unknown to the gguf package") from None
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    values = (sigma * rng.standard_normal((n, block_elems))).astype(np.float32)
    if type_name in ("F32", "F16"):
        return values.astype("<f4" if type_name == "F32" else "<f2").view(np.uint8).reshape(n, block_bytes)
    try:
        blocks = gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        # Q5_K (Mixtral's attn_output), for one: ggml's own quantizer, where the model extra is installed
        try:
            blocks = ggml.quantize(type_name, values)
        except ModelLoadError as exc:
            raise ModelLoadError(
                f"random blocks: ggml type {type_name} can be neither composed here (Q4_K, Q6_K) nor "
                f"quantized by gguf.quants, and ggml cannot quantize it here: {exc}"
            ) from None
    return np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, block_bytes)


# Parts of a block drawn independently of each other (byte ranges), so that even a row of one
# block is one of POOL_BLOCKS**k and a 262,144-row table of 256-wide rows repeats (almost) none: each
# part's fields are independent of the others' in the composed blocks, so any mix is a block
# of the same law. Q4_K: the scales, then four 64-value chunks of codes; Q6_K: the scales and
# d, then the codes (low nibbles and high bits) of each 128-value half.
_PARTS: dict[str, tuple[tuple[tuple[int, int], ...], ...]] = {
    "Q4_K": (((0, 16),), ((16, 48),), ((48, 80),), ((80, 112),), ((112, 144),)),
    "Q6_K": (((192, 210),), ((0, 64), (128, 160)), ((64, 128), (160, 192))),
}


@attrs.frozen(eq=False)
class BlockPool:
    """Random blocks of one type and scale; a tensor's blocks are drawn from it at random."""

    type_name: str
    sigma: float
    blocks: U8  # (POOL_BLOCKS, block bytes)

    @classmethod
    def build(cls, type_name: str, sigma: float, seed: int) -> BlockPool:
        """A pool of POOL_BLOCKS blocks; the same seed, type and sigma give the same bytes."""
        key = zlib.crc32(f"{type_name}:{sigma!r}".encode())
        rng = np.random.default_rng([seed, key])
        return cls(type_name=type_name, sigma=sigma, blocks=random_blocks_of(type_name, rng, POOL_BLOCKS, sigma))

    def draw(self, rng: np.random.Generator, n: int) -> U8:
        """n blocks, (n, block bytes), each part of each block picked at random from the pool's."""
        parts = _PARTS.get(self.type_name)
        if parts is None:
            whole: U8 = self.blocks[rng.integers(0, self.blocks.shape[0], n)]
            return whole
        out = np.empty((n, self.blocks.shape[1]), dtype=np.uint8)
        for ranges in parts:
            rows = rng.integers(0, self.blocks.shape[0], n)
            for start, stop in ranges:
                out[:, start:stop] = self.blocks[rows, start:stop]
        return out


class PoolSet:
    """One BlockPool per (type, sigma), built on first use from one seed."""

    def __init__(self, seed: int) -> None:
        """Pools are made lazily: a file uses a few (type, sigma) pairs."""
        self.seed = seed
        self._pools: dict[tuple[str, float], BlockPool] = {}

    def get(self, type_name: str, sigma: float) -> BlockPool:
        """The pool of `type_name` blocks of scale `sigma`."""
        pool = self._pools.get((type_name, sigma))
        if pool is None:
            pool = BlockPool.build(type_name, sigma, self.seed)
            self._pools[(type_name, sigma)] = pool
        return pool


def block_size(type_name: str) -> tuple[int, int]:
    """(values, bytes) of one block of a ggml type, as gguf knows it."""
    gguf = require_gguf()
    qtype: Any = gguf.GGMLQuantizationType[type_name]
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return int(elems), int(nbytes)
