"""The float32 engine's block math in numpy, one function per step (docs/PROTOCOL.md §7).

One `block` for every architecture: the row of model/arch.py says which norms and which gated
activation it has.
Shapes: R rows (tokens of one session, or one token of each of several sessions),
n_embd model width, H query heads, Hkv key/value heads, D head_dim, L attended keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.compute.kv_cache import Segment
from skippy_zmq.float32.projections import Projection
from skippy_zmq.model.gguf_model import GGUFModel, ModelHParams, RopeScaling

F32 = npt.NDArray[np.float32]

_GELU_SQRT_2_OVER_PI = np.float32(0.7978845608028654)
_GELU_COEF_A = np.float32(0.044715)


@attrs.frozen(eq=False)
class RopeTable:
    """cos/sin of position * scale * theta_i for positions [0, n_pos), one RoPE base and scale."""

    cos: F32  # (n_pos, D/2)
    sin: F32  # (n_pos, D/2)

    @classmethod
    def build(cls, n_pos: int, head_dim: int, freq_base: float, freq_scale: float = 1.0,
              freq_factors: F32 | None = None, scaling: RopeScaling | None = None,
              n_ctx_orig: int = 0) -> RopeTable:
        """Angles pos * scale * base^(-2i/D) / factor_i for i < D/2, computed in float64, stored as float32.

        `freq_scale` is the position scale (1 / rope.scaling.factor), `freq_factors` a file's rope_freqs
        (D/2,), `scaling` the file's YaRN arguments and attention factor with `n_ctx_orig` the context
        YaRN's bounds are computed for (docs/PROTOCOL.md §7)."""
        inv_freq = freq_base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.astype(np.float64)
        extrapolated = np.arange(n_pos, dtype=np.float64)[:, None] * inv_freq[None, :]  # (n_pos, D/2)
        angles, magnitude = extrapolated * freq_scale, 1.0
        if scaling is not None:
            magnitude = scaling.attn_factor
            if scaling.ext_factor != 0.0:
                low, high = _yarn_bounds(head_dim, n_ctx_orig, freq_base, scaling)
                ramp = 1.0 - np.clip((np.arange(head_dim // 2) - low) / max(0.001, high - low), 0.0, 1.0)
                mix = ramp * scaling.ext_factor  # (D/2,): 1 keeps a pair's angle, 0 scales it fully
                angles = angles * (1.0 - mix) + extrapolated * mix
                magnitude *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
        return cls(cos=(np.cos(angles) * magnitude).astype(np.float32),
                   sin=(np.sin(angles) * magnitude).astype(np.float32))


def _yarn_bounds(head_dim: int, n_ctx_orig: int, freq_base: float, scaling: RopeScaling) -> tuple[float, float]:
    """The pair indices between which YaRN blends (ggml_rope_yarn_corr_dims): pairs that turn more than
    beta_fast times over the original context keep their angle, fewer than beta_slow times are scaled."""

    def pair(turns: float) -> float:
        return head_dim * math.log(n_ctx_orig / (turns * 2 * math.pi)) / (2 * math.log(freq_base))

    return max(0.0, math.floor(pair(scaling.beta_fast))), min(head_dim - 1.0, math.ceil(pair(scaling.beta_slow)))


@attrs.frozen(eq=False)
class LayerWeights:
    """Float32 weights of one block; matrices stored transposed, (in, out), for `x @ w_t`."""

    index: int
    attn_norm: F32            # (n_embd,)
    wqkv_t: F32               # (n_embd, H*D + 2*Hkv*D): q, k, v projections side by side
    qkv_bias: F32 | None      # (H*D + 2*Hkv*D,) q, k and v biases side by side, when the spec has qkv_bias
    q_norm: F32 | None        # (D,) per-head RMSNorm of q, when the spec has qk_norm
    k_norm: F32 | None        # (D,)
    wo_t: F32                 # (H*D, n_embd)
    post_attn_norm: F32 | None  # (n_embd,) when the spec has post_norms
    ffn_norm: F32             # (n_embd,)
    w_gate_up_t: F32          # (n_embd, 2*n_ff): gate and up projections side by side
    w_down_t: F32             # (n_ff, n_embd)
    post_ffw_norm: F32 | None  # (n_embd,) when the spec has post_norms
    sliding_window: int       # 0: attends to every earlier position
    rope: RopeTable


@attrs.frozen(eq=False)
class Block:
    """One block ready to run: LayerWeights' norms, RoPE table and window, with its four
    matrices bound to a kernel (runtime/kernels.py), which may keep them in its own form."""

    index: int
    attn_norm: F32
    qkv_bias: F32 | None  # (H*D + 2*Hkv*D,), added to the qkv product
    qk_norm: F32 | None  # (H + Hkv, D): q_norm for each query head, then k_norm for each KV head
    post_attn_norm: F32 | None
    ffn_norm: F32
    post_ffw_norm: F32 | None
    sliding_window: int
    rope: RopeTable
    qkv: Projection      # (n_embd) -> (H*D + 2*Hkv*D)
    wo: Projection       # (H*D) -> (n_embd)
    gate_up: Projection  # (n_embd) -> (2*n_ff)
    down: Projection     # (n_ff) -> (n_embd)

    @classmethod
    def bind(cls, lw: LayerWeights, bind: Callable[[F32], Projection]) -> Block:
        """The block of `lw` with its matrices handed to a kernel's `bind`."""
        qk_norm = None
        if lw.q_norm is not None and lw.k_norm is not None:
            d = lw.q_norm.shape[0]
            n_head = lw.wo_t.shape[0] // d
            qk_norm = _joint_qk_norm(lw.q_norm, lw.k_norm, n_head, (lw.wqkv_t.shape[1] - n_head * d) // (2 * d))
        return cls(index=lw.index, attn_norm=lw.attn_norm, qkv_bias=lw.qkv_bias, qk_norm=qk_norm,
                   post_attn_norm=lw.post_attn_norm, ffn_norm=lw.ffn_norm,
                   post_ffw_norm=lw.post_ffw_norm, sliding_window=lw.sliding_window, rope=lw.rope,
                   qkv=bind(lw.wqkv_t), wo=bind(lw.wo_t),
                   gate_up=bind(lw.w_gate_up_t), down=bind(lw.w_down_t))

    def n_bytes(self) -> int:
        """Bytes of weights in the block: its norms, and its matrices as the kernel reads them."""
        vectors = (self.attn_norm, self.qkv_bias, self.qk_norm, self.post_attn_norm, self.ffn_norm, self.post_ffw_norm)
        matrices = (self.qkv, self.wo, self.gate_up, self.down)
        return sum(v.nbytes for v in vectors if v is not None) + sum(m.weight_bytes for m in matrices)


def _joint_qk_norm(q_norm: F32, k_norm: F32, n_head: int, n_head_kv: int) -> F32:
    """One norm over q's and k's heads together, (H + Hkv, D): the same per-head arithmetic, one call."""
    return np.concatenate([np.tile(q_norm, (n_head, 1)), np.tile(k_norm, (n_head_kv, 1))])


def load_layer(model: GGUFModel, il: int, rope: RopeTable) -> LayerWeights:
    """Dequantize the weights of block il to float32."""
    hp = model.hparams
    spec = hp.spec
    e, d, ff = hp.n_embd, hp.head_dim, hp.n_ff
    q_dim, kv_dim = hp.n_head * d, hp.n_head_kv * d
    p = f"blk.{il}."

    def norm(name: str, n: int, present: bool) -> F32 | None:
        return model.load_f32(p + name, (n,)) if present else None

    wqkv_t = np.empty((e, q_dim + 2 * kv_dim), dtype=np.float32)
    wqkv_t[:, :q_dim] = model.load_f32_transposed(p + "attn_q.weight", (q_dim, e))
    wqkv_t[:, q_dim:q_dim + kv_dim] = model.load_f32_transposed(p + "attn_k.weight", (kv_dim, e))
    wqkv_t[:, q_dim + kv_dim:] = model.load_f32_transposed(p + "attn_v.weight", (kv_dim, e))
    qkv_bias = None
    if spec.qkv_bias:
        qkv_bias = np.concatenate([model.load_f32(p + f"attn_{name}.bias", (n,))
                                   for name, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))])
    w_gate_up_t = np.empty((e, 2 * ff), dtype=np.float32)
    w_gate_up_t[:, :ff] = model.load_f32_transposed(p + "ffn_gate.weight", (ff, e))
    w_gate_up_t[:, ff:] = model.load_f32_transposed(p + "ffn_up.weight", (ff, e))
    return LayerWeights(
        index=il,
        attn_norm=model.load_f32(p + "attn_norm.weight", (e,)),
        wqkv_t=wqkv_t,
        qkv_bias=qkv_bias,
        q_norm=norm("attn_q_norm.weight", d, spec.qk_norm),
        k_norm=norm("attn_k_norm.weight", d, spec.qk_norm),
        wo_t=model.load_f32_transposed(p + "attn_output.weight", (e, q_dim)),
        post_attn_norm=norm("post_attention_norm.weight", e, spec.post_norms),
        ffn_norm=model.load_f32(p + "ffn_norm.weight", (e,)),
        w_gate_up_t=w_gate_up_t,
        w_down_t=model.load_f32_transposed(p + "ffn_down.weight", (e, ff)),
        post_ffw_norm=norm("post_ffw_norm.weight", e, spec.post_norms),
        sliding_window=hp.sliding_window if hp.is_sliding_layer(il) else 0,
        rope=rope,
    )


# ---------------------------------------------------------------- block steps


def rms_norm(x: F32, weight: F32, eps: float) -> F32:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (GGUF weights include any +1)."""
    mean_sq = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    # The casts here restate float32: numpy's stubs widen float32 scalar arithmetic to float64.
    return cast(F32, x * (np.float32(1.0) / np.sqrt(mean_sq + np.float32(eps))) * weight)


def apply_rope(x: F32, positions: npt.NDArray[np.int64], rope: RopeTable, neox: bool) -> F32:
    """Rotate (R, heads, D) by each row's position; NEOX pairs (i, i+D/2), else (2i, 2i+1)."""
    cos = rope.cos[positions][:, None, :]  # (R, 1, D/2)
    sin = rope.sin[positions][:, None, :]
    out = np.empty_like(x)
    if neox:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:] = x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x2 * cos + x1 * sin
    return out


def gelu_tanh(x: F32) -> F32:
    """GELU, tanh approximation (as ggml_gelu)."""
    inner = _GELU_SQRT_2_OVER_PI * x * (np.float32(1.0) + _GELU_COEF_A * x * x)
    return cast(F32, np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner)))


def silu(x: F32) -> F32:
    """x * sigmoid(x)."""
    return cast(F32, x / (np.float32(1.0) + np.exp(-x)))


def attend(q: F32, keys: F32, values: F32, q_positions: npt.NDArray[np.int64], key_start: int,
           sliding_window: int) -> F32:
    """Causal (optionally sliding-window) softmax attention of one session's queries.

    q (T, H, D) already scaled; keys/values (Hkv, L, D) for positions key_start..+L.
    Returns (T, H*D).
    """
    n_keys = keys.shape[1]
    if (q.shape[0] == 1 and int(q_positions[0]) == key_start + n_keys - 1
            and (sliding_window == 0 or n_keys <= sliding_window)):
        return _attend_last(q, keys, values)
    return _attend_masked(q, keys, values, q_positions, key_start, sliding_window)


def _attend_masked(q: F32, keys: F32, values: F32, q_positions: npt.NDArray[np.int64], key_start: int,
                   sliding_window: int) -> F32:
    """`attend` for any queries: causal and window masks built from the positions; (T, H*D)."""
    t, n_head, d = q.shape
    n_head_kv, n_keys, _ = keys.shape
    group = n_head // n_head_kv
    # query head h reads key/value head h // group
    qg = q.reshape(t, n_head_kv, group, d).transpose(1, 2, 0, 3).reshape(n_head_kv, group * t, d)
    scores = np.matmul(qg, keys.transpose(0, 2, 1))  # (Hkv, group*T, L)
    scores = scores.reshape(n_head_kv, group, t, n_keys)
    key_pos = np.arange(key_start, key_start + n_keys)
    distance = q_positions[:, None] - key_pos[None, :]  # (T, L)
    masked = distance < 0
    if sliding_window > 0:
        masked |= distance >= sliding_window
    if masked.any():
        scores[:, :, masked] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out: F32 = np.matmul(probs.reshape(n_head_kv, group * t, n_keys), values)  # (Hkv, group*T, D)
    return out.reshape(n_head_kv, group, t, d).transpose(2, 0, 1, 3).reshape(t, n_head * d)


def _attend_last(q: F32, keys: F32, values: F32) -> F32:
    """`attend` for one query at the last key position (a decode step): no key is masked.

    The same operations as `_attend_masked` in the same order, without the mask work, so the
    result is bit for bit the same (pinned by tests/runtime/test_stage.py); (1, H*D).
    """
    _, n_head, d = q.shape
    n_head_kv = keys.shape[0]
    qg = q.reshape(n_head_kv, n_head // n_head_kv, d)  # (Hkv, group, D)
    scores = np.matmul(qg, keys.transpose(0, 2, 1))  # (Hkv, group, L)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out: F32 = np.matmul(probs, values)  # (Hkv, group, D)
    return out.reshape(1, n_head * d)


def attention_block(x: F32, lw: Block, slot: int, hp: ModelHParams,
                    segments: Sequence[Segment], positions: npt.NDArray[np.int64]) -> F32:
    """Self-attention of the normed residual x (R, n_embd); stores k/v; returns (R, n_embd)."""
    r = x.shape[0]
    d, n_head, n_head_kv = hp.head_dim, hp.n_head, hp.n_head_kv
    q_dim, kv_dim = n_head * d, n_head_kv * d
    qkv = lw.qkv(x)  # (R, H*D + 2*Hkv*D)
    if lw.qkv_bias is not None:
        qkv += lw.qkv_bias
    # q's and k's heads side by side, (R, H + Hkv, D): norm and RoPE act per head, so one call
    # each over both gives the same numbers as two.
    qk = qkv[:, :q_dim + kv_dim].reshape(r, n_head + n_head_kv, d)
    v = qkv[:, q_dim + kv_dim:].reshape(r, n_head_kv, d)
    if lw.qk_norm is not None:
        qk = rms_norm(qk, lw.qk_norm, hp.rms_eps)
    qk = apply_rope(qk, positions, lw.rope, hp.rope_neox)
    q, k = qk[:, :n_head], qk[:, n_head:]
    q *= np.float32(1.0 / np.sqrt(d))
    out = np.empty((r, q_dim), dtype=np.float32)
    for seg in segments:
        rows = slice(seg.row_start, seg.row_start + seg.n_rows)
        pos_end = seg.pos_start + seg.n_rows
        seg.kv.store(slot, seg.pos_start, k[rows], v[rows])
        key_start = 0
        if lw.sliding_window > 0:
            key_start = max(0, seg.pos_start - lw.sliding_window + 1)
        keys, values = seg.kv.view(slot, key_start, pos_end)
        out[rows] = attend(q[rows], keys, values, positions[rows], key_start, lw.sliding_window)
    return lw.wo(out)  # (R, n_embd)


def feed_forward(x: F32, lw: Block, activation: str) -> F32:
    """down(act(gate(x)) * up(x)) with act GELU-tanh (gemma3) or SiLU (llama); (R, n_embd)."""
    n_ff = lw.down.in_features
    gate_up = lw.gate_up(x)  # (R, 2*n_ff)
    gate, up = gate_up[:, :n_ff], gate_up[:, n_ff:]
    act = gelu_tanh(gate) if activation == "gelu" else silu(gate)
    act *= up
    return lw.down(act)


def block(x: F32, lw: Block, slot: int, hp: ModelHParams,
          segments: Sequence[Segment], positions: npt.NDArray[np.int64]) -> F32:
    """One transformer block as the architecture's row says: pre-norm attention and a gated FFN with
    residuals, each sub-block's output normed again where the row has post norms; (R, n_embd)."""
    post = hp.spec.post_norms
    h = rms_norm(x, lw.attn_norm, hp.rms_eps)
    attn = attention_block(h, lw, slot, hp, segments, positions)
    if post:
        assert lw.post_attn_norm is not None
        attn = rms_norm(attn, lw.post_attn_norm, hp.rms_eps)
    x = x + attn
    h = rms_norm(x, lw.ffn_norm, hp.rms_eps)
    ffn = feed_forward(h, lw, hp.spec.ffn_glu)
    if post:
        assert lw.post_ffw_norm is not None
        ffn = rms_norm(ffn, lw.post_ffw_norm, hp.rms_eps)
    return x + ffn
