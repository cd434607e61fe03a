"""Tests of skippy_zmq.tokens.tokenizer: llama.cpp SPM semantics, GGUF vocab loading, detokenizing."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from skippy_zmq.errors import ModelLoadError, TokenizerError
from skippy_zmq.testing.llama_sources import VocabCase, vocab_cases
from skippy_zmq.testing.tiny import vocab_tokenizer, write_vocab
from skippy_zmq.tokens.llama_vocab import LlamaVocab
from skippy_zmq.tokens.tokenizer import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_USER_DEFINED,
    StreamingDetokenizer,
    Tokenizer,
    eog_ids_of,
)

DATA = Path(__file__).parents[1] / "data" / "llama_cpp"
GEMMA3_FILE = "gemma3-270m-q4_k_m.gguf"
BYTE_BASE = 4  # <0x00> is token 4 in the hand-made vocab below
GEMMA3_BYTE_BASE = 238  # <0x00> is token 238 on Gemma 3

# Multi-byte characters a small vocab lacks, so they fall back to byte tokens.
NON_ASCII = "é中😀👨\u200d👩\u200d👧𠀀\ue000"


def _vocab(
    pieces: Mapping[str, float],
    *,
    user_defined: Iterable[str] = (),
    control: Iterable[str] = (),
    add_space_prefix: bool = False,
    add_bos: bool = True,
) -> Tokenizer:
    """Layout of the contract's tiny vocab: 4 specials, 256 byte tokens, the given pieces, the
    user-defined tokens, then the extra control tokens."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN]
    types += [TOKEN_TYPE_BYTE] * 256
    scores = [0.0] * len(tokens)
    for text, score in pieces.items():
        tokens.append(text)
        types.append(TOKEN_TYPE_NORMAL)
        scores.append(score)
    for text in user_defined:
        tokens.append(text)
        types.append(TOKEN_TYPE_USER_DEFINED)
        scores.append(0.0)
    for text in control:
        tokens.append(text)
        types.append(TOKEN_TYPE_CONTROL)
        scores.append(0.0)
    return vocab_tokenizer([t.encode() for t in tokens], scores, types, bos_id=2, eos_id=1, unk_id=3, pad_id=0,
                     add_bos=add_bos, add_space_prefix=add_space_prefix)


def _texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.token_text(i) for i in ids]


LETTERS = dict.fromkeys("abcdefghijklmnopqrstuvwxyz.,!?' \u2581", -10.0)


# -- merge algorithm (llm_tokenizer_spm) ------------------------------------------------------


def test_highest_scoring_pair_merges_first() -> None:
    tok = _vocab({**LETTERS, "ab": -1.0, "bc": -0.5})
    assert _texts(tok, tok.encode("abc", add_special=False)) == ["a", "bc"]
    tok = _vocab({**LETTERS, "ab": -0.2, "bc": -0.5})
    assert _texts(tok, tok.encode("abc", add_special=False)) == ["ab", "c"]


def test_equal_scores_merge_the_leftmost_pair() -> None:
    tok = _vocab({**LETTERS, "ab": -1.0, "bc": -1.0})
    assert _texts(tok, tok.encode("abc", add_special=False)) == ["ab", "c"]
    tok = _vocab({**LETTERS, "aa": -1.0})
    assert _texts(tok, tok.encode("aaaaa", add_special=False)) == ["aa", "aa", "a"]


def test_stale_pairs_are_skipped_after_a_neighbour_merges() -> None:
    # "bc" wins; the queued "ab" and "cd" pairs are stale and must not merge afterwards.
    tok = _vocab({**LETTERS, "ab": -1.0, "cd": -1.0, "bc": -0.1, "abcd": 5.0})
    assert _texts(tok, tok.encode("abcd", add_special=False)) == ["a", "bc", "d"]


def test_merges_build_long_pieces_through_intermediate_pieces() -> None:
    tok = _vocab({**LETTERS, "\u2581t": -1.0, "\u2581th": -0.9, "\u2581the": -0.8, "he": -2.0})
    assert _texts(tok, tok.encode(" the", add_special=False)) == ["\u2581the"]
    # "▁t" + "he" also reaches it; with neither "▁th" nor "he" the whole word is out of reach.
    tok = _vocab({**LETTERS, "\u2581t": -1.0, "\u2581the": -0.8, "he": -2.0})
    assert _texts(tok, tok.encode(" the", add_special=False)) == ["\u2581the"]
    tok = _vocab({**LETTERS, "\u2581t": -1.0, "\u2581the": -0.8})
    assert _texts(tok, tok.encode(" the", add_special=False)) == ["\u2581t", "h", "e"]


def test_spaces_become_u2581() -> None:
    tok = _vocab({**LETTERS, "\u2581a": -1.0})
    assert _texts(tok, tok.encode(" a  b", add_special=False)) == ["\u2581a", "\u2581", "\u2581", "b"]


def test_characters_outside_the_vocab_fall_back_to_utf8_byte_tokens() -> None:
    tok = _vocab(LETTERS)
    for ch in NON_ASCII:
        assert tok.encode(ch, add_special=False) == [BYTE_BASE + b for b in ch.encode()]
    assert tok.encode("a\n\x00", add_special=False) == [tok.encode("a", add_special=False)[0], BYTE_BASE + 10, BYTE_BASE]


def test_a_vocab_missing_byte_tokens_is_refused_at_load() -> None:
    # llama.cpp's byte fallback would abort the process at the first character outside the vocab.
    with pytest.raises(ModelLoadError, match=r"lacks 255 of the 256 byte tokens \(<0x00>, <0x01>"):
        vocab_tokenizer([b"<bos>", b"a"], [0.0, -1.0], [TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL], bos_id=0)


# -- USER_DEFINED / CONTROL handling (tokenizer_st_partition with parse_special=False) ----------


def test_user_defined_tokens_split_first_longest_token_first() -> None:
    tok = _vocab(LETTERS, user_defined=["ab", "bcd"])
    ab, bcd = tok.n_vocab - 2, tok.n_vocab - 1
    # llama.cpp matches the longest token over the whole text before shorter ones.
    assert tok.encode("abcd", add_special=False) == [tok.encode("a", add_special=False)[0], bcd]
    assert tok.encode("abab", add_special=False) == [ab, ab]


def test_user_defined_tokens_are_never_merged_into() -> None:
    tok = _vocab({**LETTERS, "a\u2581": 5.0}, user_defined=["\n\n", "  "])
    nl2, sp2 = tok.n_vocab - 2, tok.n_vocab - 1
    ids = tok.encode("a\n\n\n  b", add_special=False)
    assert ids[1:3] == [nl2, BYTE_BASE + 10] and ids[3] == sp2 and tok.token_text(ids[4]) == "b"
    # "a▁" would outscore everything, but the two spaces are one USER_DEFINED token first.
    assert _texts(tok, tok.encode("a  b", add_special=False)) == ["a", "  ", "b"]


def test_control_token_text_is_plain_text() -> None:
    tok = _vocab({**LETTERS, "<": -1.0, ">": -1.0})
    ids = tok.encode("<eos><bos>", add_special=False)
    assert 1 not in ids and 2 not in ids
    assert tok.decode(ids) == "<eos><bos>"


def test_add_space_prefix_prefixes_every_text_fragment() -> None:
    tok = _vocab({**LETTERS, "\u2581hi": -1.0, "hi": -1.5}, user_defined=["\n\n"], add_space_prefix=True)
    ids = tok.encode("hi\n\nhi")
    assert _texts(tok, ids) == ["<bos>", "\u2581hi", "\n\n", "\u2581hi"]
    # decode() keeps the leading space, as llama-server's `content` and /detokenize do.
    assert tok.decode(ids) == " hi\n\n hi"
    assert tok.encode("") == [2]


def test_add_bos_follows_the_vocab_unless_given() -> None:
    tok = _vocab(LETTERS)
    assert tok.encode("a")[0] == 2 and tok.encode("a", add_special=False)[0] != 2
    no_bos = _vocab(LETTERS, add_bos=False)
    assert no_bos.encode("a") == no_bos.encode("a", add_special=False) == no_bos.encode("a", add_special=True)
    assert tok.encode("") == [2] and tok.encode("", add_special=False) == []


@pytest.mark.parametrize(("text", "message"), [("a\ud800b", "surrogate"), (b"ab", "needs a str")])
def test_encode_rejects_what_is_not_utf8_text(text: object, message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        _vocab(LETTERS).encode(text)  # type: ignore[arg-type]


# -- special-token parsing (tokenizer_st_partition with parse_special=True) --------------------

TURN = "<start_of_turn>"
END = "<end_of_turn>"


def _turn_vocab(*, add_space_prefix: bool = False) -> Tokenizer:
    """LETTERS plus "\n" and "\n\n" user-defined and Gemma's two turn tokens as controls."""
    return _vocab({**LETTERS, "<": -1.0, ">": -1.0, "_": -1.0, "he": -2.0}, user_defined=["\n", "\n\n"],
                  control=[TURN, END], add_space_prefix=add_space_prefix)


def test_parse_special_turns_control_and_unknown_texts_into_ids() -> None:
    tok = _turn_vocab()
    turn, end = tok.encode(TURN + END, add_special=False, parse_special=True)
    assert (tok.token_text(turn), tok.token_text(end)) == (TURN, END)
    eos, _, bos, unk = tok.encode("<eos>a<bos><unk>", add_special=False, parse_special=True)
    assert (eos, bos, unk) == (1, 2, 3)
    ids = tok.encode(TURN + "user\nhe" + END, parse_special=True)
    assert _texts(tok, ids) == ["<bos>", TURN, "u", "s", "e", "r", "\n", "he", END]
    # Off by default: the same text is plain characters, as in test_control_token_text_is_plain_text.
    assert turn not in tok.encode(TURN) and tok.decode(tok.encode(TURN)) == TURN


def test_parse_special_splits_longest_first_across_control_and_user_defined() -> None:
    tok = _vocab({**LETTERS, "<": -1.0, ">": -1.0}, user_defined=["ab"], control=["<ab>"])
    assert _texts(tok, tok.encode("<ab>ab", add_special=False, parse_special=True)) == ["<ab>", "ab"]
    assert _texts(tok, tok.encode("<ab>ab", add_special=False)) == ["<", "ab", ">", "ab"]


def test_parse_special_space_prefix_follows_each_special_token() -> None:
    tok = _turn_vocab(add_space_prefix=True)
    ids = tok.encode(TURN + "a b" + END + "he", add_special=False, parse_special=True)
    assert _texts(tok, ids) == [TURN, "\u2581", "a", "\u2581", "b", END, "\u2581", "he"]


def test_segments_keep_control_text_plain_outside_special_segments() -> None:
    tok = _turn_vocab()
    ids = tok.encode_segments([(TURN + "user\n", True), ("a" + END + "b", False), (END + "\n", True)])
    texts = _texts(tok, ids)
    assert texts[:3] == ["<bos>", TURN, "u"] and texts[-2:] == [END, "\n"]
    assert texts.count(END) == 1 and tok.decode(ids) == "user\na" + END + "b\n"
    # A control text spanning two segments is not parsed either.
    assert END not in _texts(tok, tok.encode_segments([("<end_of", False), ("_turn>", True)]))


def test_segments_merge_and_split_user_defined_across_segment_boundaries() -> None:
    tok = _turn_vocab()
    # "\n" + "\n" is the one user-defined token "\n\n", "h" + "e" the merged piece "he",
    # exactly as the joined text tokenizes.
    ids = tok.encode_segments([(TURN + "h", True), ("e\n", False), ("\n" + END, True)], add_special=False)
    assert _texts(tok, ids) == [TURN, "he", "\n\n", END]
    assert ids == tok.encode(TURN + "he\n\n" + END, add_special=False, parse_special=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text("ab eh<>_\n", max_size=8) | st.sampled_from([TURN, END, "<bos>"]), st.booleans()),
                max_size=8))
def test_segments_free_of_special_text_equal_the_joined_text_parsed(segments: list[tuple[str, bool]]) -> None:
    tok = _turn_vocab(add_space_prefix=True)
    joined = "".join(text for text, _ in segments)
    expected = tok.encode(joined, parse_special=True)
    if all(special or tok.special_text_in(text) is None for text, special in segments):
        assert tok.encode_segments(segments) == expected
    assert tok.encode_segments((text, False) for text, _ in segments) == tok.encode(joined)


def test_special_text_in_names_control_and_unknown_texts_only() -> None:
    tok = _turn_vocab()
    assert tok.special_text_in("say " + END + " now") == END
    assert tok.special_text_in("<unk>") == "<unk>"
    assert tok.special_text_in("a\n\nb <end_of_tur>") is None


@pytest.mark.parametrize(("text", "message"), [("a\ud800b", "surrogate"), (b"ab", "needs a str")])
def test_encode_segments_rejects_what_is_not_utf8_text(text: object, message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        _turn_vocab().encode_segments([("a", True), (text, False)])  # type: ignore[list-item]


# -- decoding ----------------------------------------------------------------------------------


def test_decode_renders_pieces_like_llama_cpp_token_to_piece() -> None:
    tok = _vocab({**LETTERS, "\u2581hello": -1.0}, user_defined=["\n\n"])
    hello, nl2 = tok.n_vocab - 2, tok.n_vocab - 1
    assert tok.token_bytes(hello) == b" hello"
    assert tok.token_bytes(nl2) == b"\n\n"
    assert tok.token_bytes(0) == tok.token_bytes(1) == tok.token_bytes(2) == b""  # CONTROL -> nothing
    assert tok.token_bytes(3) == b""  # UNKNOWN -> nothing too, its text only with special
    assert tok.token_piece(3, special=True) == b"<unk>" and tok.token_piece(2, special=True) == b"<bos>"
    assert tok.token_bytes(BYTE_BASE + 0xC3) == b"\xc3"
    assert tok.decode([2, hello, nl2, BYTE_BASE + 0xC3, BYTE_BASE + 0xA9, 1]) == " hello\n\né"
    assert tok.decode([BYTE_BASE + 0xC3, hello]) == "\ufffd hello"  # invalid UTF-8 -> U+FFFD


@pytest.mark.parametrize("bad", [-1, 10_000])
def test_out_of_range_ids_are_rejected(bad: int) -> None:
    tok = _vocab(LETTERS)
    with pytest.raises(TokenizerError, match=str(bad)):
        tok.decode([5, bad])
    with pytest.raises(TokenizerError, match=str(bad)):
        tok.token_bytes(bad)
    with pytest.raises(TokenizerError, match=str(bad)):
        StreamingDetokenizer(tok).push(bad)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("abc h.\n\t" + NON_ASCII), max_size=40))
def test_round_trip_on_a_small_vocab(text: str) -> None:
    tok = _vocab({**LETTERS, "\u2581h": -1.0, "ab": -1.0, "\u2581a": -2.0})
    assert tok.decode(tok.encode(text)) == text


def test_streaming_joins_byte_tokens_into_whole_characters() -> None:
    tok = _vocab(LETTERS)
    text = "a😀b👨\u200d👩\u200d👧"
    ids = tok.encode(text, add_special=False)
    stream = StreamingDetokenizer(tok)
    chunks = [stream.push(i) for i in ids]
    assert "".join(chunks) + stream.flush() == text
    # Nothing is emitted until a character's last byte arrives: 😀 is 4 byte tokens after "a".
    assert chunks[:6] == ["a", "", "", "", "😀", "b"]


def test_streaming_flush_replaces_an_unfinished_character_and_restarts() -> None:
    tok = _vocab(LETTERS)
    stream = StreamingDetokenizer(tok)
    assert stream.push(BYTE_BASE + 0xF0) == "" and stream.push(BYTE_BASE + 0x9F) == ""
    assert stream.flush() == "\ufffd"
    assert stream.push(BYTE_BASE + 0x41) == "A" and stream.flush() == ""


def test_streaming_keeps_the_space_prefix_as_llama_server_does() -> None:
    tok = _vocab({**LETTERS, "\u2581hi": -1.0}, add_space_prefix=True)
    ids = tok.encode("hi hi")
    stream = StreamingDetokenizer(tok)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids) == " hi hi"


_BYTE_HEAVY_IDS = st.lists(
    st.one_of(
        st.integers(BYTE_BASE + 0x80, BYTE_BASE + 0xFF),  # continuation and lead bytes
        st.integers(BYTE_BASE, BYTE_BASE + 0x7F),
        st.sampled_from([0, 1, 2, 3]),
        st.integers(260, 260 + len(LETTERS) - 1),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_BYTE_HEAVY_IDS)
def test_streaming_equals_decode_and_never_splits_a_character(ids: list[int]) -> None:
    # Defined semantics: the pushes plus flush give exactly decode(ids), i.e. the joined token bytes
    # decoded with errors="replace"; a chunk never holds part of a character that later bytes complete.
    tok = _vocab(LETTERS)
    stream = StreamingDetokenizer(tok)
    chunks = [stream.push(i) for i in ids]
    assert "".join(chunks) + stream.flush() == tok.decode(ids)
    emitted = 0
    for k, chunk in enumerate(chunks):
        emitted += len(chunk)
        # Every chunk so far equals the decode of some byte prefix of what was pushed so far.
        prefix = b"".join(tok.token_bytes(i) for i in ids[: k + 1])
        assert "".join(chunks[: k + 1]) == prefix[: _decodable_length(prefix)].decode("utf-8", "replace")
    assert emitted <= len(tok.decode(ids))


def _decodable_length(data: bytes) -> int:
    """Bytes of `data` before a trailing UTF-8 sequence that is incomplete but still completable."""
    for back in range(1, min(3, len(data)) + 1):
        lead = data[-back]
        if lead < 0x80:
            return len(data)
        if lead < 0xC0:
            continue  # a continuation byte: look further back for its lead
        need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        if back >= need:
            return len(data)
        tail = data[-back:]
        # 0x80 / 0x90 / 0xA0 as next byte cover the narrowed ranges after E0, ED, F0 and F4.
        fills = [bytes([c]) + b"\x80" * (need - back - 1) for c in (0x80, 0x90, 0xA0)]
        return len(data) - back if any(_is_utf8(tail + f) for f in fills) else len(data)
    return len(data)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- GGUF loading ----------------------------------------------------------------------------


def _write_vocab_gguf(path: Path, *, model: str = "llama", eos: int = 1) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + ["a", "\u2581a", "\n\n"]
    types = [3, 3, 3, 2] + [6] * 256 + [1, 1, 4]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 260 + [-2.0, -1.0, 0.0])
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(eos)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    # Unrelated keys of other types, which the reader must step over.
    writer.add_array("general.tags", ["x", "yz"])
    writer.add_uint64("general.some_u64", 2**40)
    writer.add_float64("general.some_f64", 0.5)
    writer.add_array("general.some_ints", [1, 2, 3])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_end_of_generation_ids_alone_refuse_an_eos_outside_the_vocab(tmp_path: Path) -> None:
    path = _write_vocab_gguf(tmp_path / "v.gguf", eos=400)
    with pytest.raises(ModelLoadError, match=r"v\.gguf: tokenizer.ggml.eos_token_id is 400, outside the vocab \[0, 263\)"):
        eog_ids_of(path)


def test_from_gguf_reads_the_vocab(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(_write_vocab_gguf(tmp_path / "v.gguf"))
    assert (tok.n_vocab, tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (263, 2, 1, 3, 0)
    assert tok.add_bos and not tok.add_eos and tok.eog_ids == frozenset({1}) and tok.is_eog(1)
    assert not tok.is_eog(2)
    assert eog_ids_of(tmp_path / "v.gguf") == tok.eog_ids  # a final stage's shortcut, same rule
    assert _texts(tok, tok.encode(" a\n\na")) == ["<bos>", "\u2581a", "\n\n", "a"]


def test_from_gguf_refuses_other_tokenizer_models_naming_the_key_and_the_supported_ones(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.model is 'rwkv'; supported: 'llama' .*'gpt2' .*'bert'"):
        Tokenizer.from_gguf(_write_vocab_gguf(tmp_path / "v.gguf", model="rwkv"))


def test_from_gguf_refuses_a_bpe_vocab_without_merges_with_llama_cpps_reason(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"llama.cpp cannot load .*cannot find tokenizer merges"):
        Tokenizer.from_gguf(_write_vocab_gguf(tmp_path / "v.gguf", model="gpt2"))


def test_from_gguf_refuses_files_that_are_not_gguf(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        Tokenizer.from_gguf(junk)
    with pytest.raises(ModelLoadError, match="cannot read"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(_write_vocab_gguf(tmp_path / "v.gguf").read_bytes()[:2000])
    with pytest.raises(ModelLoadError, match="truncated or malformed"):
        Tokenizer.from_gguf(truncated)


def test_tiny_model_vocab_round_trips(tmp_path: Path) -> None:
    from skippy_zmq.testing.tiny import write_tiny_model

    tok = Tokenizer.from_gguf(write_tiny_model(tmp_path / "tiny.gguf", n_layer=1))
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (2, 1, 3, 0)
    for text in ["The capital of France is", "hello world\n\nnew paragraph", "  spaced  out ", NON_ASCII, ""]:
        ids = tok.encode(text)
        assert ids[0] == 2 and tok.decode(ids) == text
    ids = tok.encode("the\n\nend", add_special=False)
    assert "\n\n" in _texts(tok, ids)
    assert len(tok.encode(" the capital", add_special=False)) == 2  # "▁the", "▁capital" are merged pieces


# -- Gemma 3 270M against llama.cpp (recorded by tools/record_llama_reference.py) ---------------


@pytest.fixture(scope="module")
def gemma3_tokenizer() -> Tokenizer:
    """Tokenizer of Gemma 3 270M, assembling the GGUF into $SKIPPY_ZMQ_CACHE when absent."""
    from skippy_zmq.model.catalog import ensure_gemma3_270m

    path = ensure_gemma3_270m()
    return Tokenizer.from_gguf(path)


_TOKENIZER_CASES = json.loads((DATA / "gemma3_tokenizer.json").read_text())["cases"]
_PROMPTS = json.loads((DATA / "gemma3_prompts.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", _TOKENIZER_CASES, ids=[str(i) for i in range(len(_TOKENIZER_CASES))])
def test_gemma3_ids_match_llama_cpp(gemma3_tokenizer: Tokenizer, case: dict[str, object]) -> None:
    assert gemma3_tokenizer.encode(case["text"], add_special=False) == case["ids"]  # type: ignore[arg-type]


@pytest.mark.slow
def test_gemma3_recorded_cases_cover_the_required_kinds() -> None:
    texts = [c["text"] for c in _TOKENIZER_CASES]
    assert len(texts) >= 40
    for needle in ["   ", "\n\n", "\t", "\r\n", "东京", "😀", "\u200d", "é", "<start_of_turn>", "https://",
                   "def ", "\U00020000", "\ue000", "\x00"]:
        assert any(needle in t for t in texts), needle
    # Several cases really exercise byte fallback in llama.cpp's own output.
    byte_cases = [c for c in _TOKENIZER_CASES if any(GEMMA3_BYTE_BASE <= i < GEMMA3_BYTE_BASE + 256 for i in c["ids"])]
    assert len(byte_cases) >= 3


@pytest.mark.slow
def test_gemma3_prompts_match_llama_cpp(gemma3_tokenizer: Tokenizer) -> None:
    for record in _PROMPTS["prompts"]:
        assert gemma3_tokenizer.encode(record["prompt"]) == record["prompt_ids"]
    sliding = _PROMPTS["sliding"]["prompt_ids"]
    assert len(sliding) > 600
    # The long prompt is canonical SPM output, so decode then encode must reproduce it.
    assert gemma3_tokenizer.encode(gemma3_tokenizer.decode(sliding)) == sliding


# Recorded with llama.cpp (llama_tokenize, add_special=false, parse_special=true) on Gemma 3 270M.
_GEMMA3_SPECIAL_CASES = [
    ("<bos><start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\n",
     [2, 105, 2364, 107, 10979, 993, 236888, 106, 107, 105, 4368, 107]),
    ("<start_of_turn><start_of_turn>x<eos><pad><mask><unk>y<unused5>z",
     [105, 105, 236781, 1, 0, 4, 3, 236762, 11, 236802]),
    ("<start_of_image> <table>\n\n\n<b>a<end_of_turn b",
     [255999, 236743, 168, 109, 200, 236746, 236820, 643, 236779, 1340, 236779, 887, 518]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("text", "ids"), _GEMMA3_SPECIAL_CASES)
def test_gemma3_parse_special_matches_llama_cpp(gemma3_tokenizer: Tokenizer, text: str, ids: list[int]) -> None:
    assert gemma3_tokenizer.encode(text, add_special=False, parse_special=True) == ids


@pytest.mark.slow
def test_gemma3_parse_special_matches_live_llama_cpp(gemma3_tokenizer: Tokenizer) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    from skippy_zmq.model.catalog import ensure_gemma3_270m

    llama = llama_cpp.Llama(str(ensure_gemma3_270m()), vocab_only=True, verbose=False)
    texts = [str(c["text"]) for c in _TOKENIZER_CASES] + [text for text, _ in _GEMMA3_SPECIAL_CASES]
    for text in texts:
        for add_bos in (False, True):
            expected = llama.tokenize(text.encode(), add_bos=add_bos, special=True)
            assert gemma3_tokenizer.encode(text, add_special=add_bos, parse_special=True) == expected, text


@pytest.mark.slow
def test_gemma3_vocab_facts(gemma3_tokenizer: Tokenizer) -> None:
    tok = gemma3_tokenizer
    assert (tok.n_vocab, tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (262_144, 2, 1, 3, 0)
    assert tok.add_bos and not tok.add_eos
    # llama.cpp also ends at 212, "</s>": it marks that text a control token and an end of generation.
    assert tok.token_text(106) == "<end_of_turn>" and tok.eog_ids == frozenset({1, 106, 212})
    assert eog_ids_of(tok.source) == tok.eog_ids
    assert tok.token_text(GEMMA3_BYTE_BASE) == "<0x00>" and tok.token_bytes(GEMMA3_BYTE_BASE + 0x41) == b"A"
    assert tok.decode([2, 105, 2364, 107, 106]) == "user\n"  # control tokens render as nothing


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(st.text(st.characters(exclude_characters="<\u2581", exclude_categories=("Cs",)), max_size=60))
def test_gemma3_round_trip(gemma3_tokenizer: Tokenizer, text: str) -> None:
    # "<" and "▁" are left out: literal "<0x41>" or "<start_of_turn>" text may merge into a byte or
    # control token (as in llama.cpp), and a literal "▁" decodes as a space.
    assert gemma3_tokenizer.decode(gemma3_tokenizer.encode(text)) == text


@pytest.mark.slow
def test_gemma3_streaming_emoji_and_rare_cjk(gemma3_tokenizer: Tokenizer) -> None:
    tok = gemma3_tokenizer
    text = "Hi 𠀀𪚥 \U000f0000 👨\u200d👩\u200d👧 done"
    ids = tok.encode(text)
    assert sum(GEMMA3_BYTE_BASE <= i < GEMMA3_BYTE_BASE + 256 for i in ids) >= 12
    stream = StreamingDetokenizer(tok)
    chunks = [stream.push(i) for i in ids]
    assert "".join(chunks) + stream.flush() == tok.decode(ids) == text
    assert all("\ufffd" not in c for c in chunks)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.integers(GEMMA3_BYTE_BASE, GEMMA3_BYTE_BASE + 255), st.integers(0, 262_143)),
                max_size=40))
def test_gemma3_streaming_equals_decode(gemma3_tokenizer: Tokenizer, ids: list[int]) -> None:
    stream = StreamingDetokenizer(gemma3_tokenizer)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == gemma3_tokenizer.decode(ids)


def test_recorded_data_files_are_small_enough() -> None:
    total = sum(f.stat().st_size for f in DATA.iterdir())
    assert total < 40 * 2**20
    logits = np.load(DATA / "gemma3_logits.npz")
    assert logits["sliding_f32"].shape == (len(_PROMPTS["sliding"]["positions"]), 262_144)


@settings(max_examples=200, deadline=None)
@given(st.text("ab eh<>_\n\u00e9\u4e2d", max_size=60), st.booleans())
def test_min_tokens_never_exceeds_the_encoding(text: str, space_prefix: bool) -> None:
    tok = _turn_vocab(add_space_prefix=space_prefix)
    assert tok.max_piece_chars == max(len(TURN), len(END))
    assert tok.min_tokens(len(text)) <= len(tok.encode(text))


def test_min_tokens_bounds_gemma_prompts(gemma3_tokenizer: Tokenizer) -> None:
    assert gemma3_tokenizer.max_piece_chars == 31
    texts = [record["prompt"] for record in _PROMPTS["prompts"]] + [case["text"] for case in _TOKENIZER_CASES]
    for text in [*texts, "=" * 200, " " * 500, "x" * 1000]:
        assert gemma3_tokenizer.min_tokens(len(text)) <= len(gemma3_tokenizer.encode(text))


def test_token_piece_with_special_renders_control_tokens_as_their_text() -> None:
    tok = _turn_vocab()
    turn, letter = tok.encode(TURN + "u", add_special=False, parse_special=True)
    assert tok.token_piece(turn, special=True) == TURN.encode() and tok.token_piece(turn, special=False) == b""
    assert tok.token_piece(letter, special=True) == tok.token_bytes(letter) == b"u"
    assert tok.token_piece(2, special=True) == b"<bos>"
    with pytest.raises(TokenizerError, match="outside the vocab"):
        tok.token_piece(tok.n_vocab, special=True)


# -- llama.cpp's reference vocabularies (ggml-vocab-*.gguf of its sources) --------------------


@functools.cache
def _reference(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(next(case.path for case in vocab_cases() if case.name == name))


@functools.cache
def _oracle(name: str) -> LlamaVocab:
    """A second, separate load of the vocabulary: llama.cpp's whole-text tokenizing, as llama-server calls it."""
    return LlamaVocab.load(next(case.path for case in vocab_cases() if case.name == name))


_CASES = [pytest.param(case, id=case.name) for case in vocab_cases()]
_WITH_IDS = [pytest.param(case, id=case.name) for case in vocab_cases() if case.texts]
# A vocabulary of every kind and the families people split; phi-3's control tokens strip the
# whitespace after them, nomic-bert-moe's <mask> the whitespace before it.
_PROPERTY_VOCABS = ["llama-bpe", "qwen2", "llama-spm", "phi-3", "command-r", "deepseek-llm", "gpt-2", "bert-bge",
                    "nomic-bert-moe", "gemma-4"]


@pytest.mark.parametrize("case", _WITH_IDS)
def test_reference_texts_give_llama_cpps_recorded_ids(case: VocabCase) -> None:
    tok = _reference(case.name)
    for text, ids in zip(case.texts, case.ids, strict=True):
        assert tok.encode(text, add_special=False) == list(ids), text


@pytest.mark.parametrize("case", _CASES)
def test_every_reference_vocabulary_loads_with_llama_cpps_facts(case: VocabCase) -> None:
    tok = _reference(case.name)
    oracle = _oracle(case.name)
    assert tok.n_vocab == oracle.n_tokens and tok.type is oracle.type
    assert tok.eog_ids == oracle.eog_ids() and tok.eog_ids
    assert (tok.bos_id, tok.eos_id) == (oracle.special_id("bos"), oracle.special_id("eos"))
    # What add_special puts around a text is what llama.cpp's own add_special puts there.
    lib = pytest.importorskip("llama_cpp")
    llama = lib.Llama(str(case.path), vocab_only=True, verbose=False)
    assert tok.encode("Hello world") == llama.tokenize(b"Hello world", add_bos=True, special=False)


_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
_NASTY = st.sampled_from([
    "    ", "\n\n\n", "\t \t", "\r\n", "   x", "2024-12-05", "3.14159", "1234567", "x = f(a, b)  # ok\n",
    "def f():\n    return 1\n", "🦙🦙", "👨‍👩‍👧", "é", "ﬁ", "İ", "\u200b", "\x00", "\ufeff", "中文字符", "Äpfel", " 's", "'ll",
])
_PIECE = st.one_of(_TEXT, _NASTY)


@st.composite
def _segments(draw: st.DrawFn, specials: tuple[str, ...]) -> list[tuple[str, bool]]:
    """Template-like segments (special texts among plain text) and user-like ones (anything)."""
    segments = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            parts = draw(st.lists(st.one_of(st.sampled_from(specials[-40:] or ("",)), _PIECE), max_size=4))
            segments.append(("".join(parts), True))
        else:
            segments.append(("".join(draw(st.lists(_PIECE, max_size=4))), False))
    return segments


def _plain_spans_are_free_of_special_text(tok: Tokenizer, segments: list[tuple[str, bool]]) -> bool:
    """Whether no special text, anywhere in the joined text, overlaps a segment without special parsing."""
    joined = "".join(text for text, _ in segments)
    spans, offset = [], 0
    for text, special in segments:
        if not special and text:
            spans.append((offset, offset + len(text)))
        offset += len(text)
    for special_text in tok.special_texts:
        start = joined.find(special_text)
        while start >= 0:
            if any(start < end and begin < start + len(special_text) for begin, end in spans):
                return False
            start = joined.find(special_text, start + 1)
    return True


@pytest.mark.parametrize("name", _PROPERTY_VOCABS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_segments_free_of_special_text_give_llama_servers_ids_for_the_whole_text(name: str,
                                                                               data: st.DataObject) -> None:
    # llama-server tokenizes a rendered chat prompt whole, special tokens parsed: where no user
    # text holds special text, the segments must give exactly its ids.
    tok = _reference(name)
    segments = data.draw(_segments(tok.special_texts))
    assume(_plain_spans_are_free_of_special_text(tok, segments))
    joined = "".join(text for text, _ in segments)
    assert tok.encode_segments(segments, add_special=False) == _oracle(name).tokenize(joined.encode(),
                                                                                      parse_special=True)


@pytest.mark.parametrize("name", _PROPERTY_VOCABS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_special_text_in_user_segments_stays_text(name: str, data: st.DataObject) -> None:
    tok = _reference(name)
    special = data.draw(st.sampled_from(tok.special_texts))
    before, after = data.draw(_PIECE), data.draw(_PIECE)
    user = before + special + after
    ids = tok.encode_segments([(special, True), (user, False)], add_special=False)
    special_id = tok.encode(special, add_special=False, parse_special=True)
    # The template's own token is one id; the user's copy of its text is that text's plain ids.
    assert ids[: len(special_id)] == special_id and len(special_id) == 1
    assert special_id[0] not in ids[1:] or special_id[0] in tok.encode(user, add_special=False)


_BYTE_LEVEL = ["llama-bpe", "qwen2", "command-r", "deepseek-llm", "gpt-2"]


@pytest.mark.parametrize("name", _BYTE_LEVEL)
@settings(max_examples=80, deadline=None)
@given(text=st.lists(_PIECE, max_size=5).map("".join))
def test_byte_level_vocabularies_round_trip_any_text(name: str, text: str) -> None:
    tok = _reference(name)
    assert tok.decode(tok.encode(text, add_special=False)) == text


@pytest.mark.parametrize("name", _BYTE_LEVEL)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_byte_level_streaming_equals_decode_and_never_splits_a_character(name: str, data: st.DataObject) -> None:
    tok = _reference(name)
    ids = data.draw(st.lists(st.integers(0, tok.n_vocab - 1), max_size=30))
    stream = StreamingDetokenizer(tok)
    chunks = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(chunks) == tok.decode(ids)
    for chunk in chunks:
        chunk.encode("utf-8")  # whole characters only: a lone half would be a surrogate or U+FFFD


@pytest.mark.parametrize("name", _PROPERTY_VOCABS)
def test_lone_surrogates_are_refused_for_every_vocabulary(name: str) -> None:
    with pytest.raises(TokenizerError, match="lone surrogates"):
        _reference(name).encode("a\udc80b")


@pytest.mark.parametrize(("name", "texts"), [
    ("llama-bpe", {"<|eot_id|>", "<|end_of_text|>"}),
    ("qwen2", {"<|im_end|>", "<|endoftext|>"}),
    ("phi-3", {"<|end|>", "</s>"}),
])
def test_end_of_generation_ids_are_the_familys_end_tokens(name: str, texts: set[str]) -> None:
    tok = _reference(name)
    assert texts <= {tok.token_text(i) for i in tok.eog_ids}


def test_pieces_of_byte_level_tokens_are_their_bytes() -> None:
    tok = _reference("llama-bpe")
    ids = tok.encode(" Hello 🦙", add_special=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == " Hello 🦙".encode()
    assert tok.token_piece(128000, special=True) == b"<|begin_of_text|>" and tok.token_bytes(128000) == b""


def test_a_vocab_whose_arrays_disagree_in_length_is_refused_naming_the_key(tmp_path: Path) -> None:
    tokens = [f"<0x{b:02X}>" for b in range(256)] + ["a", "b"]
    path = write_vocab(tmp_path / "v.gguf", tokens, [0.0] * 258, [TOKEN_TYPE_BYTE] * 256 + [TOKEN_TYPE_NORMAL])
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.token_type has 257 entries; expected 258"):
        Tokenizer.from_gguf(path)


def test_a_file_without_a_vocabulary_is_refused_naming_the_key(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.model is missing; supported: 'llama'"):
        Tokenizer.from_gguf(path)
