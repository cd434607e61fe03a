"""The architecture table: one `ArchSpec` row per architecture, everything that differs between them
(docs/PROTOCOL.md §7, docs/ARCHITECTURE.md "Architectures").

A row is data only: which optional weights the file holds, how RoPE and the sliding layers go, how its
block computes (its norms, its gated activation, where attention is scaled) and its chat fallback. Both
engines build a block from these fields (compute/graphs.py in llama.cpp's operations, float32/layers.py
in numpy), the hyper-parameters are read under the `{name}.` keys (gguf_model.ModelHParams), and the
gateway falls back to `chat_fallback` where a file has no chat template. Adding an architecture whose
block is built from these pieces is one row; a new piece is a new field, read in both engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import attrs

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.turn_formats import CHATML, GEMMA_TURNS, LLAMA2_INST

# RoPE base of every architecture whose file has no rope.freq_base key (as in llama.cpp).
DEFAULT_ROPE_FREQ_BASE = 10000.0


@attrs.frozen
class ArchSpec:
    """What one architecture's files hold and how its layers compute."""

    name: str  # the general.architecture value
    qk_norm: bool  # blk.N.attn_q_norm / attn_k_norm: per-head RMSNorm of q and k, (head_dim,)
    qkv_bias: bool  # blk.N.attn_q.bias / attn_k.bias / attn_v.bias, added to each product's output
    post_norms: bool  # blk.N.post_attention_norm / post_ffw_norm on each sub-block's output
    scale_embeddings: bool  # input embeddings are multiplied by sqrt(n_embd)
    rope_neox: bool  # RoPE rotates pairs (i, i + D/2) rather than (2i, 2i + 1)
    # > 0: the file's attention.sliding_window applies to every layer il with
    # il % period != period - 1, the others attend globally; 0: every layer is global.
    global_layer_period: int
    # RoPE base of sliding layers unless the file has rope.freq_base_swa; None: the global base
    local_rope_freq_base: float | None
    local_rope_scaled: bool  # the file's RoPE scaling applies to sliding layers too (else global layers only)
    rope_freq_factors: bool  # a file's rope_freqs.weight (Llama 3.1 style, (head_dim/2,)) divides the angles
    tied_output: bool  # files of this family usually reuse token_embd as the output head (both load)
    ffn_glu: Literal["gelu", "silu"]  # the feed-forward's gate activation: GEGLU (tanh GELU) or SwiGLU
    scale_q: bool  # q is scaled by 1/sqrt(D) before attention, as llama.cpp's graph does (else the scores)
    chat_fallback: str  # the built-in turn format (Jinja) for a file without tokenizer.chat_template
    # The feed-forward as experts (docs/ARCHITECTURE.md, "The expert layer"): "none", "optional" (the
    # file's {name}.expert_count > 0 makes every layer an expert layer: Mixtral's `llama` files) or
    # "required". A token's router logits go through a softmax, its expert_used_count best experts
    # are kept, their weights renormalised to sum 1 (`norm_expert_weights`, llama.cpp's norm_w).
    experts: Literal["none", "optional", "required"] = "none"
    norm_expert_weights: bool = True
    # Each expert's hidden width is {name}.expert_feed_forward_length (else feed_forward_length)
    expert_ff_key: bool = False
    # Beside the experts, one shared expert every token takes (blk.N.ffn_{gate,up,down}_shexp,
    # {name}.expert_shared_feed_forward_length wide), its output times sigmoid(ffn_gate_inp_shexp . h)
    shared_expert: bool = False
    # Rank pooling's scores go through a softmax (Qwen3-Reranker: P("yes"), P("no")), as llama.cpp's
    # rank pooling does for this architecture (docs/PROTOCOL.md §9.3, Reranking)
    rank_softmax: bool = False


GEMMA3 = ArchSpec(
    name="gemma3",
    qk_norm=True,
    qkv_bias=False,
    post_norms=True,
    scale_embeddings=True,
    rope_neox=True,
    global_layer_period=6,
    local_rope_freq_base=10000.0,
    local_rope_scaled=False,
    rope_freq_factors=False,
    tied_output=True,
    ffn_glu="gelu",
    scale_q=True,
    chat_fallback=GEMMA_TURNS,
)

LLAMA = ArchSpec(
    name="llama",
    qk_norm=False,
    qkv_bias=False,
    post_norms=False,
    scale_embeddings=False,
    rope_neox=False,
    global_layer_period=0,
    local_rope_freq_base=None,
    local_rope_scaled=True,
    rope_freq_factors=True,
    tied_output=False,
    ffn_glu="silu",
    scale_q=False,
    chat_fallback=LLAMA2_INST,
    experts="optional",  # Mixtral: llama.cpp builds the expert layer where expert_count > 0
)

# Qwen 2 and 2.5 (and QwQ, the R1 Qwen distills): a Llama block with biases on q, k and v, NEOX RoPE.
QWEN2 = attrs.evolve(LLAMA, name="qwen2", qkv_bias=True, rope_neox=True, rope_freq_factors=False,
                     chat_fallback=CHATML, experts="none")

# Qwen 3: a Llama block with per-head RMSNorm of q and k before RoPE, NEOX RoPE, no biases.
QWEN3 = attrs.evolve(LLAMA, name="qwen3", qk_norm=True, rope_neox=True, rope_freq_factors=False,
                     chat_fallback=CHATML, experts="none", rank_softmax=True)

# Qwen 3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): a Qwen 3 block whose feed-forward is experts only, each
# as wide as expert_feed_forward_length, the top-k weights renormalised (llama.cpp's norm_w = true).
QWEN3MOE = attrs.evolve(QWEN3, name="qwen3moe", experts="required", expert_ff_key=True, rank_softmax=False)

# Qwen 1.5 and 2 MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): a Qwen 2 block whose feed-forward is experts,
# their top-k weights as the softmax gave them (llama.cpp's norm_w = false), plus a shared expert.
QWEN2MOE = attrs.evolve(QWEN2, name="qwen2moe", experts="required", expert_ff_key=True, norm_expert_weights=False,
                        shared_expert=True)

ARCHITECTURES: Mapping[str, ArchSpec] = {spec.name: spec for spec in (GEMMA3, LLAMA, QWEN2, QWEN3, QWEN3MOE,
                                                                      QWEN2MOE)}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)


def arch_spec(name: str, *, source: str = "") -> ArchSpec:
    """The spec of an architecture; ModelLoadError naming the supported ones if unknown."""
    spec = ARCHITECTURES.get(name)
    if spec is None:
        where = f"{source}: " if source else ""
        raise ModelLoadError(
            f"{where}unsupported architecture {name!r} (general.architecture); supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return spec
