"""Text to token ids and back, exactly as llama.cpp does it: llama.cpp's own vocab code
(`tokens/llama_vocab.py`) tokenizes and renders pieces for every vocabulary kind of VOCAB_KINDS
(docs/PROTOCOL.md §7, "Tokenizer").

What this module adds is the one thing llama.cpp's API cannot say: special tokens parsed in part
of a text only. `encode_segments` splits the joined text on special tokens as llama.cpp's
`tokenizer_st_partition` does (longest first; LSTRIP/RSTRIP tokens eat the whitespace beside
them; USER_DEFINED tokens everywhere) except that a CONTROL or UNKNOWN token's text does not
match where it overlaps a segment without special parsing, then hands each stretch of plain
text to llama.cpp. A chat template's `<|im_start|>` is thus a control token while the same text
typed by a user is not, and a prompt free of such text gets the ids llama-server gives the whole
rendered text.

Pieces are llama.cpp's `token_to_piece` (lstrip 0), as llama-server concatenates them for its
`content` and `/detokenize`; byte sequences that are not valid UTF-8 decode with Python's
`errors="replace"` (one U+FFFD per maximal invalid subsequence).
"""

from __future__ import annotations

import bisect
import codecs
import os
from collections.abc import Iterable, Mapping, Sequence

import attrs

from skippy_zmq.errors import ModelLoadError, TokenizerError
from skippy_zmq.model.gguf_file import GGUFHeader, GGUFKey, read_header
from skippy_zmq.tokens.llama_vocab import LlamaVocab, TokenAttr, VocabType, is_marker

# llama.cpp's llama_token_type values, as stored in tokenizer.ggml.token_type.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6


@attrs.frozen
class VocabKind:
    """One value of `tokenizer.ggml.model` this package serves, and llama.cpp's type for it."""

    model: str
    type: VocabType
    description: str


VOCAB_KINDS: Mapping[str, VocabKind] = {
    kind.model: kind
    for kind in (
        VocabKind("llama", VocabType.SPM, "SentencePiece BPE with byte fallback (Llama 2, Mistral v1-v3, Gemma)"),
        VocabKind("gpt2", VocabType.BPE, "byte-level BPE with the file's pre-tokenizer (Llama 3, Qwen, Mistral "
                  "Nemo's tekken, SmolLM, DeepSeek)"),
        VocabKind("gemma4", VocabType.BPE, "BPE over U+2581-escaped text with byte fallback (Gemma 4)"),
        VocabKind("bert", VocabType.WPM, "WordPiece (BERT-style embedding models)"),
        VocabKind("t5", VocabType.UGM, "SentencePiece unigram (T5-style)"),
    )
}
"""The vocabulary kinds served: one row each; llama.cpp's vocab code does the work for all."""
if any(kind.type is VocabType.NONE or not kind.description for kind in VOCAB_KINDS.values()):
    raise AssertionError("VOCAB_KINDS: every row names a llama.cpp vocab type and says what it is")

_SPECIAL = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN
_NEEDS_PARSE_SPECIAL = TokenAttr.CONTROL | TokenAttr.UNKNOWN
_C_SPACE = " \t\n\v\f\r"  # what C's isspace() strips beside an LSTRIP/RSTRIP token


@attrs.frozen
class _SpecialToken:
    """A token that splits raw text before the tokenizer sees it (llama.cpp's cache_special_tokens)."""

    text: str
    id: int
    needs_parse_special: bool  # CONTROL or UNKNOWN; USER_DEFINED ones always split
    lstrip: bool
    rstrip: bool


def eog_ids_of(path: str | os.PathLike[str]) -> frozenset[int]:
    """A GGUF file's end-of-generation ids, as llama.cpp decides them (what a final stage needs)."""
    _check_header(read_header(path), str(path))
    vocab = LlamaVocab.load(path)
    try:
        return vocab.eog_ids()
    finally:
        vocab.close()


class Tokenizer:
    """A GGUF's tokenizer: llama.cpp's ids and pieces, special parsing off, on, or per segment."""

    def __init__(self, vocab: LlamaVocab, header: GGUFHeader) -> None:
        """Wrap a loaded vocabulary (use `from_gguf`); `header` is its file's metadata."""
        self._vocab = vocab
        self.source = vocab.source
        self.n_vocab = vocab.n_tokens
        self.type = vocab.type
        self.bos_id = vocab.special_id("bos")
        self.eos_id = vocab.special_id("eos")
        self.sep_id = vocab.special_id("sep")
        self.pad_id = vocab.special_id("pad")
        self.unk_id: int | None = header.integer(GGUFKey.UNK_ID, None)
        self.add_bos = vocab.adds("bos")
        self.add_eos = vocab.adds("eos")
        self.add_sep = vocab.adds("sep")
        self.eog_ids: frozenset[int] = vocab.eog_ids()
        # surrogateescape: a text that is not UTF-8 keeps a key no valid text can ever match.
        self._texts = [t.decode("utf-8", "surrogateescape") for t in header.strings(GGUFKey.TOKENS)]
        attributes = vocab.attrs()
        specials = [i for i, a in enumerate(attributes) if a & _SPECIAL and self._texts[i]]
        # Longest in UTF-8 bytes first; equal lengths by id (llama.cpp's std::sort leaves them unordered).
        specials.sort(key=lambda i: (-len(self._texts[i].encode("utf-8", "surrogateescape")), i))
        self._special = [
            _SpecialToken(self._texts[i], i, bool(attributes[i] & _NEEDS_PARSE_SPECIAL),
                          bool(attributes[i] & TokenAttr.LSTRIP), bool(attributes[i] & TokenAttr.RSTRIP))
            for i in specials
        ]
        # Two-character heads of the special texts: one `in` test rules out whole groups
        # (Gemma 3 has 6,000 `<unused...>` control tokens).
        self._special_heads = frozenset(token.text[:2] for token in self._special)
        # Every token covers at most this many characters of the text it encodes (a BPE text has
        # one character per byte; a byte token covers at most one), so a text of n characters
        # needs >= n / this many tokens. None where whitespace can vanish (WordPiece, unigram
        # normalization, LSTRIP/RSTRIP tokens): no such floor holds.
        strips = any(token.lstrip or token.rstrip for token in self._special)
        self.max_piece_chars: int | None = (
            None if strips or self.type in (VocabType.WPM, VocabType.UGM)
            else max(1, max((len(t) for t in self._texts), default=1)))
        self._pieces: list[bytes | None] = [None] * self.n_vocab
        self._special_pieces: list[bytes | None] = [None] * self.n_vocab

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a GGUF file's vocabulary (any kind of VOCAB_KINDS), refusing a bad one by name."""
        header = read_header(path)  # parsed once per process and file version
        _check_header(header, str(path))
        return cls(LlamaVocab.load(path), header)

    def close(self) -> None:
        """Free llama.cpp's copy of the vocabulary now rather than when collected."""
        self._vocab.close()

    def token_text(self, token_id: int) -> str:
        """The raw vocab string of a token (U+2581 or byte-level letters kept, `<0xNN>` as written)."""
        self._check_id(token_id)
        return self._texts[token_id].encode("utf-8", "surrogateescape").decode("utf-8", "replace")

    def min_tokens(self, n_chars: int, *, add_special: bool = True) -> int:
        """A floor on the tokens of any text of `n_chars` characters, found without encoding it."""
        prefix, suffix = self._around(add_special, checked=False)
        fixed = len(prefix) + len(suffix)
        if self.max_piece_chars is None:
            return fixed
        return -(-n_chars // self.max_piece_chars) + fixed

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text` as llama.cpp's `llama_tokenize(add_special, parse_special)` gives them.

        `add_special` adds what the vocab asks for around a text (BOS, EOS; CLS and SEP for
        WordPiece). `parse_special=True` also turns CONTROL and UNKNOWN token texts (`<|im_start|>`,
        `<bos>`) into their ids; never use it on user text.
        """
        return self.encode_segments(((text, parse_special),), add_special=add_special)

    def encode_segments(self, segments: Iterable[tuple[str, bool]], *, add_special: bool = True) -> list[int]:
        """Token ids of the joined texts of `(text, parse_special)` segments.

        A CONTROL or UNKNOWN token text becomes its id only where it lies wholly inside a segment
        with parse_special; everything else sees the joined text as one string, so segments free
        of special-token text give the ids of `encode(joined, parse_special=True)`.
        """
        texts: list[str] = []
        plain: list[tuple[int, int]] = []  # [start, end) of non-empty segments without special parsing
        special_spans = 0
        offset = 0
        for text, special in segments:
            _check_text(text)
            if special:
                special_spans += 1
            elif text:
                plain.append((offset, offset + len(text)))
            texts.append(text)
            offset += len(text)
        joined = "".join(texts)
        prefix, suffix = self._around(add_special, checked=True)
        if not plain or not special_spans:
            # One call does it: llama.cpp parses specials everywhere or nowhere.
            body = self._vocab.tokenize(joined.encode(), parse_special=bool(special_spans))
        else:
            body = []
            for fragment in self._partition(joined, plain):
                if isinstance(fragment, int):
                    body.append(fragment)
                else:
                    body.extend(self._vocab.tokenize(fragment.encode(), parse_special=False))
        return [*prefix, *body, *suffix]

    @property
    def special_texts(self) -> tuple[str, ...]:
        """The CONTROL and UNKNOWN token texts, which only special parsing turns into ids; longest first."""
        return tuple(token.text for token in self._special if token.needs_parse_special)

    def marker_ids(self, texts: Iterable[str]) -> dict[str, int]:
        """The ids of those `texts` that are one marker token each (`llama_vocab.is_marker`: a control
        token, or a user-defined one written `<...>`), which a grammar names by id."""
        by_text = {token.text: token.id for token in self._special}
        found = {text: by_text[text] for text in texts if text in by_text}
        return {text: token for text, token in found.items()
                if is_marker(self._vocab.attr(token), text.encode("utf-8", "surrogateescape"))}

    def special_text_in(self, text: str) -> str | None:
        """The longest CONTROL or UNKNOWN token text that occurs in `text`, or None."""
        for token in self._special:
            if token.needs_parse_special and token.text in text:
                return token.text
        return None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` as llama-server's `content`: control tokens render as nothing, invalid UTF-8 as U+FFFD."""
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to decoded text (llama.cpp's token_to_piece, special=False)."""
        return self.token_piece(token_id, special=False)

    def token_piece(self, token_id: int, *, special: bool) -> bytes:
        """A token's bytes as llama.cpp's token_to_piece gives them; with `special` a CONTROL token is
        its text (`<bos>`) instead of nothing (llama-server's /tokenize pieces)."""
        self._check_id(token_id)
        cache = self._special_pieces if special else self._pieces
        piece = cache[token_id]
        if piece is None:
            piece = cache[token_id] = self._vocab.piece(token_id, special=special)
        return piece

    def is_eog(self, token_id: int) -> bool:
        """Whether generation stops at this token (eos, eot, eom and end-of-turn control tokens)."""
        return token_id in self.eog_ids

    def _around(self, add_special: bool, *, checked: bool) -> tuple[list[int], list[int]]:
        """The ids llama.cpp's add_special puts before and after a text, by vocab type."""
        if not add_special:
            return [], []
        if self.type is VocabType.WPM:
            wanted = [("bos", self.bos_id, True), ("sep", self.sep_id, False)]
        else:
            wanted = [("bos", self.bos_id, True)] if self.add_bos else []
            if self.add_eos:
                wanted.append(("eos", self.eos_id, False))
        prefix: list[int] = []
        suffix: list[int] = []
        for name, token_id, before in wanted:
            if token_id is None:
                if checked:
                    raise TokenizerError(f"{self.source}: the vocab asks for a {name} token around a text but has "
                                         f"no {name} token id; tokenize with add_special off")
                continue
            (prefix if before else suffix).append(token_id)
        return prefix, suffix

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.n_vocab:
            raise TokenizerError(f"token id {token_id} is outside the vocab [0, {self.n_vocab}) of {self.source}")

    def _partition(self, text: str, plain: Sequence[tuple[int, int]]) -> list[str | int]:
        """Split raw text on special tokens as llama.cpp's tokenizer_st_partition does with
        special parsing on, except that CONTROL and UNKNOWN texts overlapping a `plain` span do
        not match. Returns plain-text fragments and token ids in order."""
        heads = {head for head in self._special_heads if head in text}
        plain_starts = [start for start, _ in plain]
        plain_ends = [end for _, end in plain]
        fragments: list[tuple[int, int] | int] = [(0, len(text))] if text else []
        for token in self._special:
            if token.text[:2] not in heads or token.text not in text:
                continue
            size = len(token.text)
            split: list[tuple[int, int] | int] = []
            for fragment in fragments:
                if isinstance(fragment, int):
                    split.append(fragment)
                    continue
                start, end = fragment
                search = start
                while (hit := text.find(token.text, search, end)) >= 0:
                    if token.needs_parse_special and _overlaps(plain_starts, plain_ends, hit, hit + size):
                        search = hit + 1
                        continue
                    left_end = hit
                    if token.lstrip:
                        while left_end > start and text[left_end - 1] in _C_SPACE:
                            left_end -= 1
                    if left_end > start:
                        split.append((start, left_end))
                    split.append(token.id)
                    start = hit + size
                    if token.rstrip:
                        while start < end and text[start] in _C_SPACE:
                            start += 1
                    search = start
                if start < end:
                    split.append((start, end))
            fragments = split
        return [f if isinstance(f, int) else text[f[0] : f[1]] for f in fragments]


class StreamingDetokenizer:
    """Turns ids into text one at a time, holding bytes until they form whole UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer, shown: frozenset[int] = frozenset()) -> None:
        """Start an empty stream over `tokenizer`; the `shown` ids render their text even when they are
        control tokens (llama-server's preserved tokens: a tool-call format's markers)."""
        self._tokenizer = tokenizer
        self._shown = shown
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token; an incomplete UTF-8 tail waits for later tokens."""
        piece = self._tokenizer.token_piece(token_id, special=token_id in self._shown)
        text = self._decoder.decode(piece)
        held = self._decoder.getstate()[0]
        if held and not _completable(held):
            # Python's decoder waits on some tails no byte can complete (b"\xed\xa0", a surrogate
            # prefix); their U+FFFD are due now, exactly as a whole decode would place them.
            text += self._decoder.decode(b"", final=True)
            self._decoder.reset()
        return text

    def flush(self) -> str:
        """Text still held (an unfinished sequence becomes U+FFFD); the stream starts over."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


def _check_header(header: GGUFHeader, where: str) -> None:
    """Refuse, naming the key and value, a vocabulary this package does not serve or llama.cpp
    would abort on, before llama.cpp sees it."""
    model = header.string(GGUFKey.TOKENIZER_MODEL, None)
    kind = VOCAB_KINDS.get(model or "")
    if kind is None:
        said = "missing" if model is None else repr(model)
        raise ModelLoadError(f"{where}: {GGUFKey.TOKENIZER_MODEL} is {said}; supported: "
                             + ", ".join(f"{k!r} ({v.description})" for k, v in VOCAB_KINDS.items()))
    if GGUFKey.TOKENS not in header.metadata:
        raise ModelLoadError(f"{where}: metadata key {GGUFKey.TOKENS} is missing; a vocabulary needs its token list")
    tokens = header.strings(GGUFKey.TOKENS)
    if not tokens:
        raise ModelLoadError(f"{where}: {GGUFKey.TOKENS} is empty; expected at least one token")
    for key in (GGUFKey.SCORES, GGUFKey.TOKEN_TYPE):
        if key in header.metadata and len(header.array(key)) != len(tokens):
            raise ModelLoadError(f"{where}: {key} has {len(header.array(key))} entries; expected {len(tokens)}, "
                                 "one per token")
    for key in (GGUFKey.BOS_ID, GGUFKey.EOS_ID, GGUFKey.EOT_ID, GGUFKey.UNK_ID, GGUFKey.PAD_ID):
        value = header.integer(key, None)
        if value is not None and not 0 <= value < len(tokens):
            raise ModelLoadError(f"{where}: {key} is {value}, outside the vocab [0, {len(tokens)})")
    if kind.type is VocabType.SPM:
        # llama.cpp's SPM tokenizer falls back to one <0xNN> token per byte and aborts the process
        # when one is missing (llama_vocab::byte_to_token).
        have = set(tokens)
        missing = [b for b in range(256) if f"<0x{b:02X}>".encode() not in have and bytes([b]) not in have]
        if missing:
            shown = ", ".join(f"<0x{b:02X}>" for b in missing[:4]) + (" ..." if len(missing) > 4 else "")
            raise ModelLoadError(f"{where}: the SentencePiece vocab lacks {len(missing)} of the 256 byte tokens "
                                 f"({shown}); llama.cpp needs every one for its byte fallback")


def _check_text(text: str) -> None:
    """Refuse what is not a str of encodable UTF-8 text (lone surrogates)."""
    if not isinstance(text, str):
        raise TokenizerError(f"encode() needs a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TokenizerError(
            f"text is not encodable as UTF-8 at index {exc.start} ({text[exc.start]!r}); lone surrogates "
            "cannot be tokenized"
        ) from None


def _overlaps(starts: list[int], ends: list[int], start: int, end: int) -> bool:
    """Whether [start, end) overlaps one of the sorted, disjoint spans given by `starts`/`ends`."""
    # The last span that starts before `end` reaches furthest of those that could overlap.
    last = bisect.bisect_left(starts, end) - 1
    return last >= 0 and ends[last] > start


def _completable(tail: bytes) -> bool:
    """Whether more bytes can still turn `tail` (an unfinished UTF-8 sequence) into a character."""
    lead = tail[0]
    need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    if len(tail) > 1:
        fills = [b"\x80" * (need - len(tail))]
    else:
        # After E0, ED, F0 and F4 the second byte's range narrows; 0x80, 0x90 or 0xA0 fits each.
        fills = [bytes([second]) + b"\x80" * (need - 2) for second in (0x80, 0x90, 0xA0)]
    for fill in fills:
        try:
            (tail + fill).decode("utf-8")
        except UnicodeDecodeError:
            continue
        return True
    return False



