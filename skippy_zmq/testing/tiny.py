"""Small random GGUF models (gemma3 or llama) with a SentencePiece-style vocab, for tests."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.arch import ArchSpec, arch_spec
from skippy_zmq.model.gguf_model import require_gguf
from skippy_zmq.tokens.tokenizer import Tokenizer

# Token types as in llama.cpp's llama_token_type.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6

_SPACE = "\u2581"

_WORDS = (  # noqa: SIM905 - a word list reads better as one string
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will my more up out can what about who some into them time only new like could "
    "these two may first then do any now other its our over also me after back did use how "
    "than even most made well way work day man world life hand part child eye woman place "
    "week case point number group problem fact good great little own old right big high "
    "small large next early young long important few public bad same able hello capital "
    "France Paris city country water boils temperature degrees colors red blue green yellow "
    "primary three once upon village small planet solar system Mercury Venus Earth Mars "
    "Jupiter Saturn def return print function list value code data model token stage "
    "The A In It This He She We They There What When How Once List Water"
).split()

_FRAGMENTS = (  # noqa: SIM905 - as _WORDS
    "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io "
    "le ve co me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur ca el ta la ns di fo ho "
    "pe ec pr no ct us ac ot il tr ly nc et ut ss so rs un lo wa ge ie wh ee wi em ad ol rt "
    "po we na ul ni ts mo ow pa im mi ai sh ir su id os iv ia am fi ci vi pl ig tu ev ld ry "
    "mp fe bl ab gh ty op wo sa ay ex ke fr oo av ag if ap gr od bo sp rd do uc bu ei ov by "
    "rm ep tt oc fa ef cu rn ing ion ent and tio the ati for her ter hat tha ere ate his con "
    "res ver all ons nce men ith ted ers pro thi wit are ess not ive was ect rea com eve per"
).split()


TinyVocab = tuple[list[str], list[float], list[int]]


def tiny_vocab() -> TinyVocab:
    """Tokens, scores and types of the tiny vocab: control tokens, 256 bytes, words and their
    prefixes, fragments, one user-defined token."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [_CONTROL, _CONTROL, _CONTROL, _UNKNOWN]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [_BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces: list[str] = []
    for word in _WORDS:
        # every prefix of "▁word" so that pair merges can build the whole word
        full = _SPACE + word
        pieces += [full[:i] for i in range(2, len(full) + 1)]
    pieces += _FRAGMENTS
    seen = set(tokens)
    normal: list[str] = []
    for ch in [chr(c) for c in range(0x21, 0x7F)] + [_SPACE]:
        if ch not in seen:
            seen.add(ch)
            normal.append(ch)
    n_chars = len(normal)
    for piece in pieces:
        if piece not in seen:
            seen.add(piece)
            normal.append(piece)
    # Multi-character pieces score by length then order (longer merges win); single
    # characters score lowest, as in SentencePiece models.
    for i, piece in enumerate(normal):
        tokens.append(piece)
        types.append(_NORMAL)
        scores.append(-1000.0 - i if i < n_chars else -float(i - n_chars) / 1000.0 + len(piece))
    tokens.append("\n\n")
    types.append(_USER_DEFINED)
    scores.append(0.0)
    return tokens, scores, types


def _add_rope_scaling(writer: Any, arch: str, scaling: tuple[str, float] | None, original_context: int,
                      attn_factor: float | None) -> None:
    """The rope.scaling.* keys write_tiny_model was asked for."""
    if scaling is not None:
        # add_string, not add_rope_scaling_type: tests also write types llama.cpp does not know
        writer.add_string(f"{arch}.rope.scaling.type", scaling[0])
        writer.add_rope_scaling_factor(scaling[1])
    if original_context > 0:
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", original_context)
    if attn_factor is not None:
        writer.add_float32(f"{arch}.rope.scaling.attn_factor", attn_factor)


def write_tiny_model(path: str | os.PathLike[str], *, arch: str = "llama", n_layer: int = 4,
                     n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128,
                     seed: int = 0, quantize: bool = True, sliding_window: int = 8,
                     rope_scaling: tuple[str, float] | None = None, rope_freq_factors: bool = False,
                     rope_original_context: int = 0, rope_attn_factor: float | None = None,
                     weight_type: str = "Q8_0") -> Path:
    """Write a small random GGUF model of `arch`; some tensors of `weight_type` when `quantize` (Q8_0 by
    gguf's quantizer, any other type by ggml's own, as llama.cpp's tools write it).

    `rope_scaling` (type, factor) writes rope.scaling.type and rope.scaling.factor as Gemma 3
    4B+ and long-context Llama files carry them; `rope_freq_factors` writes a rope_freqs.weight
    of divisors from 1 (fast pairs) to 8 (slow pairs), as Llama 3.1 files carry one;
    `rope_original_context` (when > 0) and `rope_attn_factor` (when given) write
    rope.scaling.original_context_length and rope.scaling.attn_factor, as YaRN files carry them."""
    gguf = require_gguf()
    try:
        spec = arch_spec(arch)
    except ModelLoadError as exc:
        raise ModelLoadError(f"write_tiny_model: {exc}") from None
    if n_embd % n_head != 0 or n_head % n_head_kv != 0 or (n_embd // n_head) % 2 != 0:
        raise ModelLoadError(
            f"write_tiny_model: n_embd {n_embd}, n_head {n_head}, n_head_kv {n_head_kv} must "
            "give an even head_dim and whole query groups"
        )
    qtype = _weight_qtype(gguf, weight_type, n_embd, n_ff) if quantize else None
    out = Path(path)
    vocab = tiny_vocab()
    writer = gguf.GGUFWriter(out, arch)
    _add_metadata(writer, spec, vocab, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                  n_head_kv=n_head_kv, n_ff=n_ff, sliding_window=sliding_window)
    _add_rope_scaling(writer, arch, rope_scaling, rope_original_context, rope_attn_factor)
    rng = np.random.default_rng(seed)

    def add(name: str, value: npt.NDArray[np.float32], quantized: bool) -> None:
        if not quantized or qtype is None:
            writer.add_tensor(name, value)
        elif qtype == gguf.GGMLQuantizationType.Q8_0:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            from skippy_zmq.compute import ggml

            blocks = ggml.quantize(weight_type, value).reshape(value.shape[0], -1)  # (rows, bytes per row)
            writer.add_tensor(name, blocks, raw_dtype=qtype)

    _add_tensors(add, rng, spec, n_vocab=len(vocab[0]), n_layer=n_layer, n_embd=n_embd,
                 n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff)
    if rope_freq_factors:
        half = n_embd // n_head // 2
        writer.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, half, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_metadata(writer: Any, spec: ArchSpec, vocab: TinyVocab, *,
                  n_layer: int, n_embd: int, n_head: int,
                  n_head_kv: int, n_ff: int, sliding_window: int) -> None:
    """Hyper-parameters and the vocab, as a converted model of `spec`'s family has them."""
    head_dim = n_embd // n_head
    writer.add_name(f"tiny-{spec.name}")
    writer.add_block_count(n_layer)
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    # A global base distinct from the sliding layers' own, so a layer using the wrong one shows.
    writer.add_rope_freq_base(10000.0 if spec.local_rope_freq_base is None else 1_000_000.0)
    writer.add_rope_dimension_count(head_dim)
    if spec.global_layer_period > 0:
        writer.add_sliding_window(sliding_window)
    add_tiny_vocab(writer, vocab)


def add_tiny_vocab(writer: Any, vocab: TinyVocab) -> None:
    """The tiny vocab's tokenizer keys on a gguf.GGUFWriter (SentencePiece-style, llama.cpp's "llama")."""
    tokens, scores, types = vocab
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)


def write_vocab(path: str | os.PathLike[str], tokens: Sequence[str | bytes], scores: Sequence[float],
                types: Sequence[int], *, model: str = "llama", bos_id: int | None = None, eos_id: int | None = None,
                unk_id: int | None = None, pad_id: int | None = None, eot_id: int | None = None,
                add_bos: bool = True, add_space_prefix: bool = False) -> Path:
    """A vocabulary-only GGUF of the given tokens (what llama.cpp loads with vocab_only)."""
    gguf = require_gguf()
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list([t if isinstance(t, bytes) else t.encode() for t in tokens])
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    for add, value in ((writer.add_bos_token_id, bos_id), (writer.add_eos_token_id, eos_id),
                       (writer.add_unk_token_id, unk_id), (writer.add_pad_token_id, pad_id),
                       (writer.add_eot_token_id, eot_id)):
        if value is not None:
            add(value)
    writer.add_add_bos_token(add_bos)
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def vocab_tokenizer(tokens: Sequence[str | bytes], scores: Sequence[float], types: Sequence[int],
                    **keys: Any) -> Tokenizer:
    """A Tokenizer over the given vocabulary, loaded by llama.cpp from a `write_vocab` file
    (`keys` as write_vocab takes them)."""
    with tempfile.TemporaryDirectory(prefix="skippy-vocab-") as scratch:
        return Tokenizer.from_gguf(write_vocab(Path(scratch) / "vocab.gguf", tokens, scores, types, **keys))


def _weight_qtype(gguf: Any, weight_type: str, n_embd: int, n_ff: int) -> Any:
    """The GGUF type of `weight_type`; ModelLoadError unless it is one and its blocks divide the widths."""
    if weight_type not in gguf.GGMLQuantizationType.__members__:
        raise ModelLoadError(f"write_tiny_model: weight type {weight_type!r} is not a GGUF tensor type")
    qtype = gguf.GGMLQuantizationType[weight_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if n_embd % block != 0 or n_ff % block != 0:
        raise ModelLoadError(
            f"write_tiny_model: {weight_type} needs n_embd ({n_embd}) and n_ff ({n_ff}) multiples of {block}"
        )
    return qtype


def _add_tensors(add: Callable[[str, npt.NDArray[np.float32], bool], None], rng: np.random.Generator,
                 spec: ArchSpec, *, n_vocab: int, n_layer: int, n_embd: int, n_head: int,
                 n_head_kv: int, n_ff: int) -> None:
    """Random weights in file order; add(name, values, quantize_it) stores one tensor."""
    head_dim = n_embd // n_head

    def matrix(rows: int, cols: int) -> npt.NDArray[np.float32]:
        values: npt.NDArray[np.float32] = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        return values

    def norm(n: int) -> npt.NDArray[np.float32]:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # embeddings of unit scale per row so that Gemma's sqrt(n_embd) scaling stays sane
    embd = (rng.standard_normal((n_vocab, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    add("token_embd.weight", embd, True)
    add("output_norm.weight", norm(n_embd), False)
    if not spec.tied_output:
        add("output.weight", matrix(n_vocab, n_embd), False)
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    for il in range(n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", norm(n_embd), False)
        add(p + "attn_q.weight", matrix(q_dim, n_embd), True)
        add(p + "attn_k.weight", matrix(kv_dim, n_embd), True)
        add(p + "attn_v.weight", matrix(kv_dim, n_embd), il % 2 == 0)
        add(p + "attn_output.weight", matrix(n_embd, q_dim), True)
        add(p + "ffn_norm.weight", norm(n_embd), False)
        add(p + "ffn_gate.weight", matrix(n_ff, n_embd), True)
        add(p + "ffn_up.weight", matrix(n_ff, n_embd), il % 2 == 1)
        add(p + "ffn_down.weight", matrix(n_embd, n_ff), True)
        if spec.qkv_bias:
            for name, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                add(p + name + ".bias", (0.1 * rng.standard_normal(n)).astype(np.float32), False)
        if spec.qk_norm:
            add(p + "attn_q_norm.weight", norm(head_dim), False)
            add(p + "attn_k_norm.weight", norm(head_dim), False)
        if spec.post_norms:
            add(p + "post_attention_norm.weight", norm(n_embd), False)
            add(p + "post_ffw_norm.weight", norm(n_embd), False)
