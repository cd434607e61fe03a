"""GGUF files of real model shapes with random weights in one of llama.cpp's type mixes.

A shape (one row of SHAPES) gives the dimensions; the tokenizer keys are copied from another
GGUF (or the tiny vocab of testing/tiny.py for the small CI shapes); a type mix (one row of
MIXES: Q4_K_M, the default, Q8_0 or Q4_0) gives each matrix the type `llama-quantize` gives it
for that file type, and its blocks are drawn from random pools (testing/random_blocks.py),
written tensor by tensor and GROUP_BLOCKS blocks at a time, so a 7.3 GB file never sits in
memory (docs/PROTOCOL.md §7, "Loading"; figures in docs/BENCHMARKS.md, "Random-weights files
of real shapes").
"""

from __future__ import annotations

import math
import os
import re
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.arch import arch_spec
from skippy_zmq.model.gguf_file import ArchKey, GGUFHeader, GGUFValueType, read_header
from skippy_zmq.model.gguf_model import require_gguf
from skippy_zmq.testing.random_blocks import BlockPool, PoolSet, block_size
from skippy_zmq.testing.tiny import add_tiny_vocab, tiny_vocab

# Blocks drawn (from a generator of their own) and written per step: bounds the writer's memory
# whatever the tensor, about 3 MiB.
GROUP_BLOCKS = 1 << 14
# The output head (and Gemma's tied embedding) wider than N(0, 1/n_embd): logits of standard
# deviation about 2. With a tied table the input token's own logit then stands out (greedy
# gemma3-12b repeats it, 13.6-16.6 ahead of the next); llama3-8b's tokens vary, 0.16-0.75 ahead
# (docs/BENCHMARKS.md, "Random-weights files of real shapes").
OUTPUT_GAIN = 2.0
_NORM_SPREAD = 0.05  # norm weights 1 + N(0, spread²): near 1, as trained models' are


def _positive(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    """Attrs validator: an int field must be > 0."""
    if value <= 0:
        raise ModelLoadError(f"model shape: {attr.name} = {value} must be > 0")


@attrs.frozen
class RopeScaling:
    """RoPE scaling as a GGUF states it: `{arch}.rope.scaling.type`, `.factor` and, when > 0,
    `.original_context_length` (YaRN files carry the context the model was trained at)."""

    kind: str
    factor: float
    original_context: int = 0

    def __attrs_post_init__(self) -> None:
        """Refuse an empty kind, a factor that is not a positive finite number, a negative context."""
        if not self.kind:
            raise ModelLoadError("RoPE scaling: the type must not be empty")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ModelLoadError(f"RoPE scaling: factor {self.factor} must be a positive finite number")
        if self.original_context < 0:
            raise ModelLoadError(f"RoPE scaling: original context {self.original_context} must be >= 0")

    @classmethod
    def parse(cls, text: str) -> RopeScaling | None:
        """`none`, `linear:F`, `longrope:F` or `yarn:F[:ORIGINAL_CONTEXT]` (the command line's form);
        ModelLoadError naming what is wrong."""
        if text == "none":
            return None
        form = "expected 'none', 'linear:FACTOR', 'longrope:FACTOR' or 'yarn:FACTOR[:CONTEXT]', e.g. yarn:4:32768"
        kind, _, rest = text.partition(":")
        factor, _, context = rest.partition(":")
        if kind not in ("linear", "longrope", "yarn") or not factor or (context and kind != "yarn"):
            raise ModelLoadError(f"--rope-scaling {text!r}: {form}")
        try:
            value = float(factor)
        except ValueError:
            raise ModelLoadError(f"--rope-scaling {text!r}: factor {factor!r} is not a number") from None
        try:
            original = int(context) if context else 0
        except ValueError:
            raise ModelLoadError(f"--rope-scaling {text!r}: context {context!r} is not a whole number") from None
        return cls(kind=kind, factor=value, original_context=original)


@attrs.frozen
class ModelShape:
    """The dimensions of one model family member, as its GGUF metadata states them."""

    name: str
    arch: str
    n_layer: int = attrs.field(validator=_positive)
    n_embd: int = attrs.field(validator=_positive)
    n_head: int = attrs.field(validator=_positive)
    n_head_kv: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    n_ff: int = attrs.field(validator=_positive)
    rope_freq_base: float
    rms_eps: float
    context_length: int = attrs.field(validator=_positive)
    sliding_window: int = 0  # gemma3: the window of 5 layers in 6
    rope_scaling: RopeScaling | None = None
    n_expert: int = 0  # > 0: every layer's feed-forward is n_expert experts (qwen3moe, Mixtral's llama)
    n_expert_used: int = 0
    n_ff_exp: int = 0  # each expert's hidden width (Mixtral's: n_ff)
    n_ff_shexp: int = 0  # > 0: a shared expert this wide beside the experts (qwen2moe)

    def __attrs_post_init__(self) -> None:
        """Check what the runtime and llama.cpp need: a known arch, whole query groups, even heads,
        rows of whole 32-value blocks, a window exactly where the arch has one."""
        spec = arch_spec(self.arch, source=f"model shape {self.name!r}")
        where = f"model shape {self.name!r}"
        for field, number in (("rope_freq_base", self.rope_freq_base), ("rms_eps", self.rms_eps)):
            if not (math.isfinite(number) and number > 0):
                raise ModelLoadError(f"{where}: {field} = {number} must be a positive finite number")
        if self.n_head % self.n_head_kv:
            raise ModelLoadError(f"{where}: n_head {self.n_head} must be a multiple of n_head_kv {self.n_head_kv}")
        if self.head_dim % 2:
            raise ModelLoadError(f"{where}: head_dim {self.head_dim} must be even for RoPE")
        for field, value in (("n_embd", self.n_embd), ("n_ff", self.n_ff), ("n_head * head_dim", self.q_dim)):
            if value % 32:
                raise ModelLoadError(f"{where}: {field} = {value} must be a multiple of 32 (whole quantized blocks)")
        if self.n_expert and (not 0 < self.n_expert_used <= self.n_expert or self.n_ff_exp <= 0
                              or self.n_ff_exp % 32):
            raise ModelLoadError(f"{where}: {self.n_expert_used} of {self.n_expert} experts of width {self.n_ff_exp}; "
                                 "expected 1 to n_expert used, a width of whole 32-value blocks")
        if spec.shared_expert != (self.n_ff_shexp > 0) or self.n_ff_shexp % 32:
            raise ModelLoadError(f"{where}: a shared expert {self.n_ff_shexp} wide; {self.arch} "
                                 f"{'has one (width > 0' if spec.shared_expert else 'has none (width 0'}, "
                                 "whole 32-value blocks)")
        if (spec.experts == "required" and not self.n_expert) or (spec.experts == "none" and self.n_expert):
            raise ModelLoadError(f"{where}: {self.n_expert} experts, but {self.arch}'s layers "
                                 f"{'are experts' if spec.experts == 'required' else 'have none'}")
        if (spec.global_layer_period > 0) != (self.sliding_window > 0):
            raise ModelLoadError(f"{where}: sliding_window {self.sliding_window} must be > 0 exactly for "
                                 f"architectures with sliding layers (gemma3); {self.arch} "
                                 f"{'has' if spec.global_layer_period else 'has none'}")

    @property
    def q_dim(self) -> int:
        """Width of the queries, n_head * head_dim (the input of attn_output)."""
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys and values, n_head_kv * head_dim."""
        return self.n_head_kv * self.head_dim


_GEMMA3_SCALING = RopeScaling(kind="linear", factor=8.0)  # on the global layers of 4B, 12B, 27B


def _gemma3(name: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, *,
            sliding_window: int = 1024, rope_scaling: RopeScaling | None = _GEMMA3_SCALING,
            context_length: int = 131072) -> ModelShape:
    """A Gemma 3 row: heads of 256, RoPE base 1e6 (10,000 on the sliding layers, model/arch.py)."""
    return ModelShape(name=name, arch="gemma3", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                      head_dim=256, n_ff=n_ff, rope_freq_base=1_000_000.0, rms_eps=1e-6,
                      context_length=context_length, sliding_window=sliding_window, rope_scaling=rope_scaling)


def _llama3(name: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, *,
            context_length: int = 8192) -> ModelShape:
    """A Llama 3 row: RoPE base 500,000, heads of n_embd / n_head, no scaling (3.0, not 3.1)."""
    return ModelShape(name=name, arch="llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                      head_dim=n_embd // n_head, n_ff=n_ff, rope_freq_base=500_000.0, rms_eps=1e-5,
                      context_length=context_length)


def _mistral(name: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, *,
             head_dim: int = 128, context_length: int = 131072) -> ModelShape:
    """A Mistral Nemo row (`llama`): RoPE base 1e6, RMS eps 1e-5, heads of 128 however wide the rows."""
    return ModelShape(name=name, arch="llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                      head_dim=head_dim, n_ff=n_ff, rope_freq_base=1_000_000.0, rms_eps=1e-5,
                      context_length=context_length)


def _qwen(name: str, arch: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, *,
          head_dim: int = 128, context_length: int = 32768) -> ModelShape:
    """A Qwen 2.5 (`qwen2`) or Qwen 3 (`qwen3`) row: RoPE base 1e6, RMS eps 1e-6, heads of 128 unless given."""
    return ModelShape(name=name, arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                      head_dim=head_dim, n_ff=n_ff, rope_freq_base=1_000_000.0, rms_eps=1e-6,
                      context_length=context_length)


def _qwen3moe(name: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, n_expert: int,
              n_expert_used: int, n_ff_exp: int, *, head_dim: int = 128, context_length: int = 40960) -> ModelShape:
    """A Qwen 3 MoE row: Qwen 3's constants, every layer n_expert experts n_ff_exp wide."""
    return ModelShape(name=name, arch="qwen3moe", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                      head_dim=head_dim, n_ff=n_ff, rope_freq_base=1_000_000.0, rms_eps=1e-6,
                      context_length=context_length, n_expert=n_expert, n_expert_used=n_expert_used,
                      n_ff_exp=n_ff_exp)


def _qwen2moe(name: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, n_expert: int,
              n_expert_used: int, n_ff_exp: int, n_ff_shexp: int, *, head_dim: int = 128,
              context_length: int = 8192) -> ModelShape:
    """A Qwen 1.5 / 2 MoE row: Qwen 2's constants (biases on q, k and v), every layer n_expert experts
    n_ff_exp wide and a shared expert n_ff_shexp wide."""
    return ModelShape(name=name, arch="qwen2moe", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                      head_dim=head_dim, n_ff=n_ff, rope_freq_base=1_000_000.0, rms_eps=1e-6,
                      context_length=context_length, n_expert=n_expert, n_expert_used=n_expert_used,
                      n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp)


def _mixtral(name: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, n_expert: int,
             n_expert_used: int, *, context_length: int = 32768) -> ModelShape:
    """A Mixtral row (`llama` with experts): RoPE base 1e6, RMS eps 1e-5, each expert n_ff wide."""
    return ModelShape(name=name, arch="llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                      head_dim=n_embd // n_head, n_ff=n_ff, rope_freq_base=1_000_000.0, rms_eps=1e-5,
                      context_length=context_length, n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=n_ff)


def _index(shapes: Sequence[ModelShape]) -> Mapping[str, ModelShape]:
    """The table by name; ModelLoadError at import when two rows share one."""
    table: dict[str, ModelShape] = {}
    for shape in shapes:
        if shape.name in table:
            raise ModelLoadError(f"model shape {shape.name!r} is listed twice in SHAPES")
        table[shape.name] = shape
    return table


SHAPES: Mapping[str, ModelShape] = _index([
    _gemma3("gemma3-12b", n_layer=48, n_embd=3840, n_head=16, n_head_kv=8, n_ff=15360),
    _gemma3("gemma3-4b", n_layer=34, n_embd=2560, n_head=8, n_head_kv=4, n_ff=10240),
    _llama3("llama3-8b", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336),
    _qwen("qwen2.5-7b", "qwen2", n_layer=28, n_embd=3584, n_head=28, n_head_kv=4, n_ff=18944),
    _qwen("qwen3-8b", "qwen3", n_layer=36, n_embd=4096, n_head=32, n_head_kv=8, n_ff=12288, context_length=40960),
    _qwen("qwen3-14b", "qwen3", n_layer=40, n_embd=5120, n_head=40, n_head_kv=8, n_ff=17408, context_length=40960),
    _mistral("mistral-nemo-12b", n_layer=40, n_embd=5120, n_head=32, n_head_kv=8, n_ff=14336),
    _qwen3moe("qwen3-30b-a3b", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, n_ff=6144, n_expert=128,
              n_expert_used=8, n_ff_exp=768),
    _mixtral("mixtral-8x7b", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_expert=8, n_expert_used=2),
    _qwen2moe("qwen1.5-moe-a2.7b", n_layer=24, n_embd=2048, n_head=16, n_head_kv=16, n_ff=5632, n_expert=60,
              n_expert_used=4, n_ff_exp=1408, n_ff_shexp=5632),
    # CI: the same code on 256-wide rows (whole Q4_K and Q6_K blocks), files of a few MB.
    _gemma3("gemma3-mini", n_layer=6, n_embd=256, n_head=2, n_head_kv=1, n_ff=512, sliding_window=8,
            rope_scaling=None, context_length=4096),
    _gemma3("gemma3-mini-scaled", n_layer=6, n_embd=256, n_head=2, n_head_kv=1, n_ff=512, sliding_window=8,
            context_length=4096),
    _llama3("llama3-mini", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, n_ff=768, context_length=4096),
    _mistral("mistral-nemo-mini", n_layer=6, n_embd=256, n_head=4, n_head_kv=2, n_ff=768, context_length=4096),
    _qwen("qwen2-mini", "qwen2", n_layer=6, n_embd=256, n_head=4, n_head_kv=2, n_ff=768, head_dim=64,
          context_length=4096),
    _qwen("qwen3-mini", "qwen3", n_layer=6, n_embd=256, n_head=4, n_head_kv=2, n_ff=768, head_dim=128,
          context_length=4096),
    _qwen3moe("qwen3moe-mini", n_layer=6, n_embd=256, n_head=4, n_head_kv=2, n_ff=768, n_expert=16, n_expert_used=4,
              n_ff_exp=256, head_dim=64, context_length=4096),
    _mixtral("mixtral-mini", n_layer=6, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_expert=8, n_expert_used=2,
             context_length=4096),
    _qwen2moe("qwen2moe-mini", n_layer=6, n_embd=256, n_head=4, n_head_kv=2, n_ff=768, n_expert=8, n_expert_used=2,
              n_ff_exp=256, n_ff_shexp=512, head_dim=64, context_length=4096),
])


def shape_named(name: str) -> ModelShape:
    """The shape of that name; ModelLoadError listing the known ones."""
    shape = SHAPES.get(name)
    if shape is None:
        raise ModelLoadError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return shape


# ---------------------------------------------------------------------------------- types


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's "more bits" layers of Q4_K_M: the first and last eighth, and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


# llama.cpp's tensor_type_fallback (src/llama-quant.cpp): a 256-value type whose blocks do not
# fit the rows takes a 32-value one, and a type whose blocks still do not fit is F16.
_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"blk\.(\d+)\.")
# The rule of a mix: (name, n_cols, n_dims, n_layer, tied_output, n_expert) -> the tensor's ggml type.
TypeRule = Callable[[str, int, int, int, bool, int], str]


def _fitted(wanted: str, n_cols: int) -> str:
    """`wanted`, or its fallback when its blocks do not fit rows of n_cols values."""
    if n_cols % 256 and wanted in _FALLBACK:
        wanted = _FALLBACK[wanted]
    return "F16" if n_cols % 32 else wanted


def _is_head(name: str, tied_output: bool) -> bool:
    """The output head, or the token embedding when it is the head (llama.cpp's tied case)."""
    return name == "output.weight" or (tied_output and name == "token_embd.weight")


def _kept(name: str, n_dims: int) -> bool:
    """Tensors the quantizer leaves as they are (F32 here): 1-D ones, norms and the experts' router."""
    return n_dims < 2 or name.endswith("_norm.weight") or "ffn_gate_inp.weight" in name


def _eight_experts(name: str, wanted: str, n_expert: int) -> str:
    """llama.cpp's rule for files of exactly 8 experts (Mixtral), whatever the file type: attn_k and
    attn_v Q8_0."""
    if n_expert == 8 and ("attn_k.weight" in name or "attn_v.weight" in name):
        return "Q8_0"
    return wanted


def q4_k_m_type(name: str, n_cols: int, n_dims: int, n_layer: int, tied_output: bool, n_expert: int = 0) -> str:
    """The ggml type llama.cpp's quantizer gives a tensor for Q4_K_M (its rule, restated):

    1-D tensors, norms and an expert router stay F32; the output head, or the token embedding when
    it is the head, is Q6_K; attn_v and ffn_down (the experts' ffn_down_exps too) are Q6_K on the
    more-bits layers; every other matrix is Q4_K. With exactly 8 experts, attn_k and attn_v are
    Q8_0 and attn_output Q5_K. A type whose 256-value blocks do not fit the rows falls back (Q4_K
    to Q5_0, Q6_K to Q8_0, then F16).
    """
    if _kept(name, n_dims):
        return "F32"
    layer = _LAYER.match(name)
    wanted = "Q4_K"
    if _is_head(name, tied_output):
        wanted = "Q6_K"
    elif layer is not None and ("attn_v.weight" in name or "ffn_down" in name):
        wanted = "Q6_K" if use_more_bits(int(layer.group(1)), n_layer) else "Q4_K"
    if n_expert == 8 and "attn_output.weight" in name:
        wanted = "Q5_K"
    return _fitted(_eight_experts(name, wanted, n_expert), n_cols)


# llama.cpp's src/llama-quant.cpp (llama-cpp-python 0.3.36): llama_ftype_get_default_type gives
# Q4_0 or Q8_0; of llama_tensor_get_type_impl's branches only the head's (OUTPUT, or a tied
# TOKEN_EMBD) applies to those file types without an importance matrix; tensor_allows_quantization
# leaves 1-D tensors and norms as they are (F32 here).
def _one_type_mix(default: str, name: str, n_cols: int, n_dims: int, tied_output: bool, n_expert: int) -> str:
    """The rule of a 32-value file type (Q4_0, Q8_0) without an importance matrix: every matrix
    `default` but the head, Q6_K unless `default` is Q8_0; 1-D tensors, norms and an expert router
    F32; with exactly 8 experts, attn_k and attn_v Q8_0."""
    if _kept(name, n_dims):
        return "F32"
    wanted = default
    if _is_head(name, tied_output):
        # llama.cpp: rows of no whole `default` block make the head Q8_0 (then F16, below)
        wanted = "Q8_0" if n_cols % 32 or default == "Q8_0" else "Q6_K"
    return _fitted(_eight_experts(name, wanted, n_expert), n_cols)


def q8_0_type(name: str, n_cols: int, n_dims: int, n_layer: int, tied_output: bool, n_expert: int = 0) -> str:
    """The ggml type llama.cpp's quantizer gives a tensor for Q8_0: every matrix Q8_0, the head
    included; 1-D tensors, norms and an expert router F32; F16 for rows of no whole 32-value block."""
    return _one_type_mix("Q8_0", name, n_cols, n_dims, tied_output, n_expert)


def q4_0_type(name: str, n_cols: int, n_dims: int, n_layer: int, tied_output: bool, n_expert: int = 0) -> str:
    """The ggml type llama.cpp's quantizer gives a tensor for Q4_0: every matrix Q4_0 but the head
    (or the tied embedding), Q6_K (Q8_0 for rows of no whole 256-value block); 1-D tensors, norms and
    an expert router F32; with exactly 8 experts, attn_k and attn_v Q8_0."""
    return _one_type_mix("Q4_0", name, n_cols, n_dims, tied_output, n_expert)


@attrs.frozen
class TypeMix:
    """One of llama.cpp's file types: its name, its general.file_type (llama.h's enum llama_ftype),
    and the rule giving each tensor its ggml type."""

    name: str
    file_type: int
    type_of: TypeRule


MIXES: Mapping[str, TypeMix] = {mix.name: mix for mix in (
    TypeMix(name="Q4_K_M", file_type=15, type_of=q4_k_m_type),  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    TypeMix(name="Q8_0", file_type=7, type_of=q8_0_type),  # LLAMA_FTYPE_MOSTLY_Q8_0
    TypeMix(name="Q4_0", file_type=2, type_of=q4_0_type),  # LLAMA_FTYPE_MOSTLY_Q4_0
)}


def mix_named(name: str) -> TypeMix:
    """The type mix of that name; ModelLoadError listing the known ones."""
    mix = MIXES.get(name)
    if mix is None:
        raise ModelLoadError(f"unknown type mix {name!r}; known: {', '.join(MIXES)}")
    return mix


@attrs.frozen
class TensorPlan:
    """One tensor to write: name, numpy shape (rows, cols), ggml type, and the scale of its values."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    sigma: float  # values ~ N(0, sigma²); a norm's are 1 + N(0, sigma²)
    norm: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of its data in the file."""
        elems, nbytes = block_size(self.type_name)
        return math.prod(self.shape) // elems * nbytes


def plan_tensors(shape: ModelShape, n_vocab: int, *, output_gain: float = OUTPUT_GAIN,
                 mix: TypeMix = MIXES["Q4_K_M"]) -> list[TensorPlan]:
    """Every tensor of the shape in file order (embedding, output norm, head, then layer by layer),
    each matrix of the type `mix` gives it; the head (or the tied embedding) has values of
    N(0, output_gain² / n_embd)."""
    spec = arch_spec(shape.arch)
    tied = spec.tied_output

    def matrix(name: str, rows: int, cols: int, gain: float = 1.0, experts: int = 0) -> TensorPlan:
        kind = mix.type_of(name, cols, 3 if experts else 2, shape.n_layer, tied, shape.n_expert)
        dims = (experts, rows, cols) if experts else (rows, cols)
        return TensorPlan(name=name, shape=dims, type_name=kind, sigma=gain / math.sqrt(cols))

    def norm(name: str, n: int) -> TensorPlan:
        return TensorPlan(name=name, shape=(n,), type_name="F32", sigma=_NORM_SPREAD, norm=True)

    e, hd = shape.n_embd, shape.head_dim
    plans = [matrix("token_embd.weight", n_vocab, e, output_gain if tied else 1.0), norm("output_norm.weight", e)]
    if not tied:
        plans.append(matrix("output.weight", n_vocab, e, output_gain))
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        plans += [norm(p + "attn_norm.weight", e), matrix(p + "attn_q.weight", shape.q_dim, e),
                  matrix(p + "attn_k.weight", shape.kv_dim, e), matrix(p + "attn_v.weight", shape.kv_dim, e),
                  matrix(p + "attn_output.weight", e, shape.q_dim)]
        if spec.qkv_bias:  # small F32 biases, as a converted Qwen 2 file holds them
            plans += [TensorPlan(name=p + name + ".bias", shape=(n,), type_name="F32", sigma=_NORM_SPREAD)
                      for name, n in (("attn_q", shape.q_dim), ("attn_k", shape.kv_dim), ("attn_v", shape.kv_dim))]
        if spec.qk_norm:
            plans += [norm(p + "attn_q_norm.weight", hd), norm(p + "attn_k_norm.weight", hd)]
        if spec.post_norms:
            plans.append(norm(p + "post_attention_norm.weight", e))
        plans.append(norm(p + "ffn_norm.weight", e))
        if shape.n_expert:  # the router, then every expert's gate, up and down as one tensor each
            n, ff = shape.n_expert, shape.n_ff_exp
            plans += [matrix(p + "ffn_gate_inp.weight", n, e), matrix(p + "ffn_gate_exps.weight", ff, e, experts=n),
                      matrix(p + "ffn_up_exps.weight", ff, e, experts=n),
                      matrix(p + "ffn_down_exps.weight", e, ff, experts=n)]
            if shape.n_ff_shexp:  # the shared expert's gate (E,), F32 as every 1-D tensor, then its FFN
                shared = shape.n_ff_shexp
                plans += [TensorPlan(name=p + "ffn_gate_inp_shexp.weight", shape=(e,), type_name="F32",
                                     sigma=1.0 / math.sqrt(e)),
                          matrix(p + "ffn_gate_shexp.weight", shared, e), matrix(p + "ffn_up_shexp.weight", shared, e),
                          matrix(p + "ffn_down_shexp.weight", e, shared)]
        else:
            plans += [matrix(p + "ffn_gate.weight", shape.n_ff, e), matrix(p + "ffn_up.weight", shape.n_ff, e),
                      matrix(p + "ffn_down.weight", e, shape.n_ff)]
        if spec.post_norms:
            plans.append(norm(p + "post_ffw_norm.weight", e))
    return plans


# ---------------------------------------------------------------------------------- writing


@attrs.frozen
class CopiedKey:
    """One metadata entry copied from another file, with its stored types."""

    key: str
    value: Any
    vtype: GGUFValueType
    item_type: GGUFValueType | None


@attrs.frozen
class TokenizerKeys:
    """The tokenizer keys a file gets: copied from a GGUF, or the tiny vocab (`keys` empty)."""

    label: str  # "gemma3" for a copy of a gemma3 file's tokenizer, "tiny"
    n_vocab: int
    keys: tuple[CopiedKey, ...] = ()

    def __attrs_post_init__(self) -> None:
        """Without copied keys the file gets the tiny vocab: n_vocab must be its size."""
        tiny = len(tiny_vocab()[0])
        if not self.keys and self.n_vocab != tiny:
            raise ModelLoadError(f"tokenizer {self.label!r}: n_vocab {self.n_vocab} without copied keys; "
                                 f"expected the tiny vocab's {tiny}")

    @classmethod
    def tiny(cls) -> TokenizerKeys:
        """testing/tiny.py's vocab (under a thousand tokens)."""
        return cls(label="tiny", n_vocab=len(tiny_vocab()[0]))

    @classmethod
    def copied_from(cls, path: str | os.PathLike[str]) -> TokenizerKeys:
        """Every `tokenizer.*` key of a GGUF, values and types as stored there."""
        header = read_header(path)
        keys = tuple(_copied(header, key) for key in header.metadata if key.startswith("tokenizer."))
        tokens = header.metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, tuple) or not tokens:
            raise ModelLoadError(f"{header.source}: no tokenizer.ggml.tokens to copy; expected a GGUF with a vocab")
        arch = header.metadata.get("general.architecture", "unknown")
        return cls(label=str(arch), n_vocab=len(tokens), keys=keys)


def _copied(header: GGUFHeader, key: str) -> CopiedKey:
    """One key of `header` as the writer takes it (numeric arrays as lists)."""
    vtype, item_type = header.value_types[key]
    value = header.metadata[key]
    if vtype == GGUFValueType.ARRAY and item_type in (GGUFValueType.ARRAY, None):
        raise ModelLoadError(f"{header.source}: metadata key {key!r} is an array of arrays; it cannot be copied")
    if isinstance(value, np.ndarray):
        value = value.tolist()
    return CopiedKey(key=key, value=value, vtype=vtype, item_type=item_type)


def write_random_model(path: str | os.PathLike[str], shape: ModelShape, *, tokenizer: TokenizerKeys | None = None,
                       seed: int = 0, rope_scaling: RopeScaling | str | None = "shape",
                       output_gain: float = OUTPUT_GAIN, mix: TypeMix = MIXES["Q4_K_M"],
                       edit: Callable[[list[TensorPlan]], list[TensorPlan]] | None = None,
                       keys: Mapping[str, int | float | str | tuple[str, ...]] | None = None,
                       progress: Callable[[str], None] | None = None) -> Path:
    """Write `shape` with random weights in the type mix `mix` to `path`; returns the path.

    `rope_scaling` is the shape's own unless given (None: none). `output_gain` scales the head
    (or Gemma's tied embedding): with a tied table, the input token's own logit stands out by
    about sqrt(n_embd) * gain / (residual RMS), so a high gain repeats the last token with a
    wide margin and a low one (0.5) lets the tokens vary. `edit` may change the tensor plan
    before writing, and `keys` writes metadata over the shape's (ints as uint32): tests make files
    that contradict their metadata with them.
    """
    gguf = require_gguf()
    tok = tokenizer if tokenizer is not None else TokenizerKeys.tiny()
    scaling = shape.rope_scaling if rope_scaling == "shape" else rope_scaling
    if isinstance(scaling, str):
        raise ModelLoadError(f"rope_scaling {scaling!r}: expected a RopeScaling, None or 'shape'")
    if not (math.isfinite(output_gain) and output_gain > 0):
        raise ModelLoadError(f"output_gain {output_gain} must be a positive finite number")
    plans = plan_tensors(shape, tok.n_vocab, output_gain=output_gain, mix=mix)
    if edit is not None:
        plans = edit(plans)
    out = Path(path)
    # Written beside the target and renamed when complete: a failed write leaves no partial
    # file, and a process that maps the old file keeps its pages.
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        _write_file(partial, gguf, shape, tok, scaling, mix, plans, seed, progress or (lambda _text: None),
                    dict(keys or {}))
        os.replace(partial, out)
    except OSError as exc:
        raise ModelLoadError(f"{out}: cannot write the model file: {exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    return out


def _write_file(path: Path, gguf: Any, shape: ModelShape, tok: TokenizerKeys, scaling: RopeScaling | None,
                mix: TypeMix, plans: Sequence[TensorPlan], seed: int, say: Callable[[str], None],
                keys: Mapping[str, int | float | str | tuple[str, ...]]) -> None:
    """Header, metadata (`keys` over the shape's), tensor table, then the tensors' data, to `path`."""
    writer = gguf.GGUFWriter(path, shape.arch)
    _add_metadata(writer, shape, tok, scaling, mix)
    kinds = {int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32, str: GGUFValueType.STRING}
    for key, value in keys.items():  # over the shape's own; a tuple of strings is a string array
        writer.kv_data[0][key] = (gguf.GGUFValue(value=list(value), type=GGUFValueType.ARRAY,
                                                 sub_type=GGUFValueType.STRING) if isinstance(value, tuple)
                                  else gguf.GGUFValue(value=value, type=kinds[type(value)]))
    for plan in plans:
        writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType[plan.type_name])
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        _write_data(writer, plans, seed, say)
    finally:
        writer.close()


def _add_metadata(writer: Any, shape: ModelShape, tok: TokenizerKeys, scaling: RopeScaling | None,
                  mix: TypeMix) -> None:
    """The keys llama.cpp reads for the arch, the file type, and the tokenizer."""
    arch = shape.arch
    writer.add_name(f"{shape.name}-shaped, {tok.label} tokenizer, vocab {tok.n_vocab}, random weights")
    writer.add_file_type(mix.file_type)
    writer.add_quantization_version(2)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.n_expert:
        writer.add_expert_count(shape.n_expert)
        writer.add_expert_used_count(shape.n_expert_used)
        if arch_spec(arch).expert_ff_key:
            writer.add_expert_feed_forward_length(shape.n_ff_exp)
        if shape.n_ff_shexp:
            writer.add_expert_shared_feed_forward_length(shape.n_ff_shexp)
    if scaling is not None:
        writer.add_string(ArchKey.ROPE_SCALING_TYPE.of(arch), scaling.kind)
        writer.add_float32(ArchKey.ROPE_SCALING_FACTOR.of(arch), scaling.factor)
        if scaling.original_context:
            writer.add_uint32(ArchKey.ROPE_SCALING_ORIG_CTX.of(arch), scaling.original_context)
    if not tok.keys:
        add_tiny_vocab(writer, tiny_vocab())
    for copied in tok.keys:
        writer.add_key_value(copied.key, copied.value, copied.vtype, sub_type=copied.item_type)


def _write_data(writer: Any, plans: Sequence[TensorPlan], seed: int, say: Callable[[str], None]) -> None:
    """The tensors' bytes after the header, each padded to the alignment, a group of rows at a time."""
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())
    pools = PoolSet(seed)
    started = time.perf_counter()
    for plan in plans:
        key = zlib.crc32(plan.name.encode())
        if plan.norm:
            rng = np.random.default_rng([seed, key])
            fout.write((1.0 + plan.sigma * rng.standard_normal(plan.shape)).astype("<f4").tobytes())
        else:
            _write_matrix(fout, plan, pools.get(plan.type_name, plan.sigma), [seed, key])
        writer.write_padding(fout, plan.nbytes)
        if plan.name.endswith(("ffn_down.weight", "ffn_down_exps.weight")) or plan.name == "token_embd.weight":
            say(f"wrote {plan.name.removesuffix('.weight')} in {time.perf_counter() - started:.1f}s")


def _write_matrix(fout: Any, plan: TensorPlan, pool: BlockPool, key: list[int]) -> None:
    """One quantized (or F16/F32) matrix drawn from its pool, GROUP_BLOCKS blocks (whole rows) at a
    time; each group has its own generator, so the bytes depend on the seed and nothing else."""
    elems, _nbytes = block_size(plan.type_name)
    rows, cols = math.prod(plan.shape[:-1]), plan.shape[-1]  # an expert tensor's matrices one after the other
    row_blocks = cols // elems
    group_rows = max(1, GROUP_BLOCKS // row_blocks)
    for group, start in enumerate(range(0, rows, group_rows)):
        n = min(group_rows, rows - start)
        fout.write(pool.draw(np.random.default_rng([*key, group]), n * row_blocks).data)
