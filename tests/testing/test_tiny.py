"""Tiny random GGUF models: vocab layout, metadata, quantized tensors, determinism."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.testing.tiny import write_tiny_model


def _fields(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items()}


def test_vocab_layout(tiny_llama_path: Path) -> None:
    f = _fields(tiny_llama_path)
    tokens, types, scores = (f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"],
                             f["tokenizer.ggml.scores"])
    assert isinstance(tokens, list) and isinstance(types, list) and isinstance(scores, list)
    assert tokens[:4] == ["<pad>", "<eos>", "<bos>", "<unk>"] and types[:4] == [3, 3, 3, 2]
    assert tokens[4] == "<0x00>" and tokens[259] == "<0xFF>" and set(types[4:260]) == {6}
    normal = [t for t, ty in zip(tokens, types, strict=True) if ty == 1]
    assert "\u2581" in normal and "a" in normal and "~" in normal and "\u2581the" in normal
    assert [t for t, ty in zip(tokens, types, strict=True) if ty == 4] == ["\n\n"]
    assert len(set(tokens)) == len(tokens)
    assert 512 <= len(tokens) <= 1100
    # a word's pieces all exist so merges can build it, and longer pieces score higher
    for prefix in ("\u2581c", "\u2581ca", "\u2581cap", "\u2581capital"):
        assert prefix in normal
    assert scores[tokens.index("\u2581capital")] > scores[tokens.index("\u2581cap")]
    assert scores[tokens.index("\u2581ca")] > scores[tokens.index("c")]
    assert (f["tokenizer.ggml.model"], f["tokenizer.ggml.bos_token_id"],
            f["tokenizer.ggml.eos_token_id"], f["tokenizer.ggml.unknown_token_id"],
            f["tokenizer.ggml.padding_token_id"], f["tokenizer.ggml.add_bos_token"],
            f["tokenizer.ggml.add_space_prefix"]) == ("llama", 2, 1, 3, 0, True, False)


def test_gemma3_metadata_and_tensors(tiny_gemma3_path: Path) -> None:
    f = _fields(tiny_gemma3_path)
    assert f["general.architecture"] == "gemma3"
    assert f["gemma3.attention.sliding_window"] == 8
    assert f["gemma3.rope.freq_base"] == 1e6
    reader = gguf.GGUFReader(tiny_gemma3_path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert "output.weight" not in types  # tied to token_embd
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["blk.0.attn_q_norm.weight"] == "F32" and "blk.6.post_ffw_norm.weight" in types


def test_unquantized_and_untied_llama(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "f32.gguf", quantize=False, n_layer=2)
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}
    assert "output.weight" in {t.name for t in reader.tensors}


def test_seed_determines_the_file(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf", seed=3, n_layer=1).read_bytes()
    b = write_tiny_model(tmp_path / "b.gguf", seed=3, n_layer=1).read_bytes()
    c = write_tiny_model(tmp_path / "c.gguf", seed=4, n_layer=1).read_bytes()
    assert a == b and a != c


def test_bad_dimensions_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        write_tiny_model(tmp_path / "x.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match="n_head_kv 3"):
        write_tiny_model(tmp_path / "x.gguf", n_head_kv=3)
    with pytest.raises(ModelLoadError, match="multiples of 32"):
        write_tiny_model(tmp_path / "x.gguf", n_embd=48, n_head=3, n_head_kv=1)
    with pytest.raises(ModelLoadError, match=r"weight type 'Q9_9' is not a GGUF tensor type"):
        write_tiny_model(tmp_path / "x.gguf", weight_type="Q9_9")
    with pytest.raises(ModelLoadError, match=r"IQ4_XS needs n_embd \(64\) and n_ff \(128\) multiples of 256"):
        write_tiny_model(tmp_path / "x.gguf", weight_type="IQ4_XS")


@pytest.mark.parametrize("weight_type", ["IQ4_NL", "Q5_1", "MXFP4"])
def test_the_quantized_tensors_take_the_weight_type_asked_for(tmp_path: Path, weight_type: str) -> None:
    path = write_tiny_model(tmp_path / "w.gguf", n_layer=2, weight_type=weight_type)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == weight_type
    assert types["blk.1.attn_v.weight"] == types["blk.0.attn_norm.weight"] == "F32"  # as the Q8_0 files keep them
