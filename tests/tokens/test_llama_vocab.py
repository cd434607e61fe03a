"""Tests of skippy_zmq.tokens.llama_vocab: llama.cpp's vocabulary across the C boundary."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippy_zmq.errors import ModelLoadError, TokenizerError
from skippy_zmq.testing.llama_sources import vocab_cases
from skippy_zmq.tokens.llama_vocab import LlamaVocab, TokenAttr, VocabType


def _path(name: str) -> Path:
    return next(case.path for case in vocab_cases() if case.name == name)


def test_a_file_llama_cpp_refuses_is_a_load_error_with_its_reason(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 60)
    with pytest.raises(ModelLoadError, match=r"junk\.gguf: llama.cpp cannot load this file's vocabulary: .+"):
        LlamaVocab.load(path)


def test_pieces_longer_than_the_first_buffer_come_whole() -> None:
    vocab = LlamaVocab.load(_path("aquila"))  # holds tokens of 512 characters
    try:
        longest = max(range(vocab.n_tokens), key=lambda i: len(vocab.text(i)))
        piece = vocab.piece(longest, special=True)
        assert len(piece) > 256 and piece == vocab.piece(longest, special=False)
    finally:
        vocab.close()


def test_facts_of_a_byte_level_bpe_vocabulary() -> None:
    vocab = LlamaVocab.load(_path("llama-bpe"))
    assert vocab.type is VocabType.BPE and vocab.n_tokens == 128_256
    assert vocab.special_id("bos") == 128_000 and vocab.adds("bos") and not vocab.adds("eos")
    assert vocab.attr(128_009) & TokenAttr.CONTROL and vocab.text(128_009) == b"<|eot_id|>"
    assert vocab.tokenize(b"", parse_special=True) == []
    assert vocab.tokenize(b"<|eot_id|>", parse_special=True) == [128_009]
    assert len(vocab.tokenize(b"<|eot_id|>", parse_special=False)) > 1
    assert len(vocab.attrs()) == vocab.n_tokens and {128_001, 128_009} <= vocab.eog_ids()


def test_a_closed_vocabulary_refuses_calls_instead_of_crashing() -> None:
    vocab = LlamaVocab.load(_path("qwen2"))
    assert vocab.tokenize(b"hi", parse_special=False)
    vocab.close()
    vocab.close()  # twice is harmless
    with pytest.raises(TokenizerError, match="the vocabulary was closed"):
        vocab.tokenize(b"hi", parse_special=False)
    with pytest.raises(TokenizerError, match="closed"):
        vocab.piece(0, special=True)
