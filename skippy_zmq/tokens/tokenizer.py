"""SentencePiece-style tokenizer built from a GGUF vocab, matching llama.cpp's SPM tokenizer.

Encoding follows llama.cpp (`llm_tokenizer_spm`, docs/PROTOCOL.md §7): USER_DEFINED tokens split
the raw text first (longest first), spaces become U+2581, each remaining fragment is merged
pairwise by highest vocab score (ties: leftmost), and a final symbol with no vocab entry falls
back to one `<0xNN>` token per UTF-8 byte. With special-token parsing on (llama.cpp's
`parse_special`), CONTROL and UNKNOWN token texts split the text too, in one longest-first pass
with the USER_DEFINED ones; `encode_segments` turns it on for chosen spans of a text only, so a
chat template's `<start_of_turn>` is a control token while the same text typed by a user is not.

Decoding follows llama.cpp's `token_to_piece` with `special=False`: NORMAL pieces with U+2581
turned back into spaces, USER_DEFINED and UNKNOWN pieces verbatim, BYTE tokens as their byte,
CONTROL and UNUSED tokens as nothing. Byte sequences that are not valid UTF-8 decode with
Python's `errors="replace"` (one U+FFFD per maximal invalid subsequence).
"""

from __future__ import annotations

import bisect
import codecs
import heapq
import os
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import ModelLoadError, TokenizerError
from skippy_zmq.model.gguf_file import GGUFKey, read_header

# llama.cpp's llama_token_type values, as stored in tokenizer.ggml.token_type.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

SPACE_ESCAPE = "\u2581"
_SPACE_ESCAPE_BYTES = SPACE_ESCAPE.encode()

# Texts llama.cpp treats as end-of-generation when they are CONTROL tokens.
_EOG_TEXTS = frozenset(
    {"<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<EOT>", "<|end_of_text|>"}
)


def _eog_ids(tokens: Sequence[bytes], type_arr: npt.NDArray[np.int32], eos_id: int | None,
             eot_id: int | None) -> frozenset[int]:
    """End-of-generation ids: eos and eot, and the CONTROL tokens whose text is one of _EOG_TEXTS."""
    texts = {text.encode() for text in _EOG_TEXTS}
    eog = {i for i in (eos_id, eot_id) if i is not None}
    eog.update(int(i) for i in np.flatnonzero(type_arr == TOKEN_TYPE_CONTROL) if bytes(tokens[int(i)]) in texts)
    return frozenset(eog)


def eog_ids_of(path: str | os.PathLike[str]) -> frozenset[int]:
    """A GGUF file's end-of-generation ids, as `Tokenizer.from_gguf(path).eog_ids`, without building the
    vocab (what a final stage needs: 0.08 s against 0.5 s for Gemma 3's 262,144 pieces)."""
    header = read_header(path)
    if GGUFKey.TOKENS not in header.metadata or GGUFKey.TOKEN_TYPE not in header.metadata:
        raise ModelLoadError(f"{path}: metadata keys {GGUFKey.TOKENS} and {GGUFKey.TOKEN_TYPE} are needed "
                             "for the end-of-generation ids")
    tokens = header.strings(GGUFKey.TOKENS)
    types = np.asarray(header.array(GGUFKey.TOKEN_TYPE), np.int32)
    if types.shape != (len(tokens),):
        raise ModelLoadError(f"{path}: {GGUFKey.TOKEN_TYPE} has shape {types.shape}; expected ({len(tokens)},) "
                             "like the token list")
    ids = {"eos": header.integer(GGUFKey.EOS_ID, None), "eot": header.integer(GGUFKey.EOT_ID, None)}
    for name, value in ids.items():
        if value is not None and not 0 <= value < len(tokens):
            raise ModelLoadError(f"{path}: {name} token id {value} is outside the vocab [0, {len(tokens)})")
    return _eog_ids(tokens, types, ids["eos"], ids["eot"])


class Tokenizer:
    """SPM tokenizer over a GGUF vocab; ids identical to llama.cpp's, special parsing off or on."""

    def __init__(
        self,
        tokens: Sequence[bytes],
        scores: npt.ArrayLike,
        token_types: npt.ArrayLike,
        *,
        bos_id: int | None,
        eos_id: int | None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        eot_id: int | None = None,
        add_bos: bool = True,
        add_space_prefix: bool = False,
        source: str = "<vocab>",
    ) -> None:
        """Build from raw vocab arrays (token bytes, float scores, llama.cpp token types)."""
        score_arr = np.asarray(scores, dtype=np.float32)
        type_arr = np.asarray(token_types, dtype=np.int32)
        n_vocab = len(tokens)
        if n_vocab == 0:
            raise TokenizerError(f"{source}: vocab is empty; expected at least one token")
        if score_arr.shape != (n_vocab,) or type_arr.shape != (n_vocab,):
            raise TokenizerError(
                f"{source}: scores {score_arr.shape} and token types {type_arr.shape} must both have "
                f"shape ({n_vocab},) like the token list"
            )
        for name, value in (("bos", bos_id), ("eos", eos_id), ("unk", unk_id), ("pad", pad_id), ("eot", eot_id)):
            if value is not None and not 0 <= value < n_vocab:
                raise TokenizerError(f"{source}: {name} token id {value} is outside the vocab [0, {n_vocab})")
        self.source = source
        self.n_vocab = n_vocab
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.unk_id = unk_id
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.add_space_prefix = add_space_prefix
        # Python floats of float32 values compare exactly like llama.cpp's float scores.
        self._scores: list[float] = score_arr.tolist()
        # surrogateescape keeps a (never matching) key for a non-UTF-8 vocab entry.
        self._texts: list[str] = [t.decode("utf-8", "surrogateescape") for t in tokens]
        # Later duplicates win, as in llama.cpp's token_to_id map.
        self._text_to_id: dict[str, int] = {text: i for i, text in enumerate(self._texts)}
        self._byte_ids: list[int | None] = [self._text_to_id.get(f"<0x{b:02X}>") for b in range(256)]
        # Every token covers at most this many characters of the text it encodes (a byte
        # token covers at most one), so a text of n characters needs >= n / this many tokens.
        self.max_piece_chars = max(1, max((len(t) for t in self._texts), default=1))
        self._pieces = _render_pieces(tokens, type_arr)
        # What llama.cpp's token_to_piece with special=True adds: CONTROL tokens as their text.
        self._control_pieces = {int(i): bytes(tokens[int(i)]) for i in np.flatnonzero(type_arr == TOKEN_TYPE_CONTROL)}
        self._user_defined, self._special = _added_tokens(self._texts, type_arr)
        # Two-character heads of those texts: one `in` test each rules out whole groups
        # (Gemma 3 has 6,000 `<unused...>` control tokens).
        self._special_heads = frozenset(token_text[:2] for token_text, _, _ in self._special)
        self.eog_ids: frozenset[int] = _eog_ids(tokens, type_arr, eos_id, eot_id)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the vocab of a GGUF file (tokenizer.ggml.model must be "llama", i.e. SPM)."""
        header = read_header(path)  # parsed once per process and file version
        where = str(path)
        model = header.string(GGUFKey.TOKENIZER_MODEL, None)
        if model != "llama":
            raise ModelLoadError(
                f"{where}: tokenizer.ggml.model is {model!r}; only 'llama' (SentencePiece) is supported"
            )
        for key in (GGUFKey.TOKENS, GGUFKey.SCORES, GGUFKey.TOKEN_TYPE):
            if key not in header.metadata:
                raise ModelLoadError(f"{where}: metadata key {key} is missing; a SentencePiece vocab needs it")
        return cls(
            header.strings(GGUFKey.TOKENS),
            header.array(GGUFKey.SCORES),
            header.array(GGUFKey.TOKEN_TYPE),
            bos_id=header.integer(GGUFKey.BOS_ID, None),
            eos_id=header.integer(GGUFKey.EOS_ID, None),
            unk_id=header.integer(GGUFKey.UNK_ID, None),
            pad_id=header.integer(GGUFKey.PAD_ID, None),
            eot_id=header.integer(GGUFKey.EOT_ID, None),
            add_bos=header.flag(GGUFKey.ADD_BOS, True),
            add_space_prefix=header.flag(GGUFKey.ADD_SPACE_PREFIX, True),
            source=where,
        )

    def token_text(self, token_id: int) -> str:
        """The raw vocab string of a token (U+2581 kept, byte tokens as `<0xNN>`)."""
        self._check_id(token_id)
        return self._texts[token_id]

    def min_tokens(self, n_chars: int, *, add_bos: bool | None = None) -> int:
        """A floor on the tokens of any text of `n_chars` characters, found without encoding it."""
        bos = self.add_bos if add_bos is None else add_bos
        return -(-n_chars // self.max_piece_chars) + (1 if bos else 0)

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; `add_bos=None` follows the GGUF's add_bos_token.

        `parse_special=True` also turns CONTROL and UNKNOWN token texts (`<start_of_turn>`,
        `<bos>`) into their ids, as llama.cpp's `parse_special` does; never use it on user text.
        """
        return self.encode_segments(((text, parse_special),), add_bos=add_bos)

    def encode_segments(self, segments: Iterable[tuple[str, bool]], *, add_bos: bool | None = None) -> list[int]:
        """Token ids of the joined texts of `(text, parse_special)` segments.

        A CONTROL or UNKNOWN token text becomes its id only where it lies wholly inside a segment
        with parse_special; USER_DEFINED tokens and SPM merges see the joined text as one string,
        so segments free of special-token text give the ids of `encode(joined, parse_special=True)`.
        """
        texts: list[str] = []
        plain: list[tuple[int, int]] = []  # [start, end) of segments without special parsing
        parse_special = False
        offset = 0
        for text, special in segments:
            _check_text(text)
            if special:
                parse_special = True
            elif text:
                plain.append((offset, offset + len(text)))
            texts.append(text)
            offset += len(text)
        joined = "".join(texts)
        ids: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError(f"{self.source}: add_bos requested but the vocab has no bos_token_id")
            ids.append(self.bos_id)
        previous_is_special = True
        for fragment in self._partition(joined, plain if parse_special else None):
            if isinstance(fragment, int):
                ids.append(fragment)
                previous_is_special = True
                continue
            prefix = " " if self.add_space_prefix and previous_is_special else ""
            self._merge_fragment((prefix + fragment).replace(" ", SPACE_ESCAPE), ids)
            previous_is_special = False
        return ids

    def special_text_in(self, text: str) -> str | None:
        """The longest CONTROL or UNKNOWN token text that occurs in `text`, or None."""
        for token_text, _, needs_special in self._special:
            if needs_special and token_text in text:
                return token_text
        return None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`: control tokens render as nothing, invalid UTF-8 as U+FFFD."""
        return _strip_space_prefix(self._join_bytes(ids), self.add_space_prefix).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to decoded text (llama.cpp token_to_piece, special=False)."""
        self._check_id(token_id)
        return self._pieces[token_id]

    def token_piece(self, token_id: int, *, special: bool) -> bytes:
        """A token's bytes as llama.cpp's token_to_piece gives them: `token_bytes`, and with `special`
        a CONTROL token as its text (`<bos>`) instead of nothing (llama-server's /tokenize pieces)."""
        self._check_id(token_id)
        if special and token_id in self._control_pieces:
            return self._control_pieces[token_id]
        return self._pieces[token_id]

    def is_eog(self, token_id: int) -> bool:
        """Whether generation stops at this token (eos, eot, and end-of-turn control tokens)."""
        return token_id in self.eog_ids

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.n_vocab:
            raise TokenizerError(f"token id {token_id} is outside the vocab [0, {self.n_vocab}) of {self.source}")

    def _join_bytes(self, ids: Iterable[int]) -> bytes:
        pieces = self._pieces
        out = []
        for raw_id in ids:
            token_id = int(raw_id)
            self._check_id(token_id)
            out.append(pieces[token_id])
        return b"".join(out)

    def _partition(self, text: str, plain: Sequence[tuple[int, int]] | None) -> list[str | int]:
        """Split raw text on added tokens, longest token first over the whole text.

        `plain=None`: USER_DEFINED tokens only (special parsing off). Otherwise every special
        token, except that CONTROL and UNKNOWN texts overlapping a `plain` span do not match.
        """
        if plain is None:
            candidates: Iterable[tuple[str, int, bool]] = ((t, i, False) for t, i in self._user_defined)
        else:
            heads = {head for head in self._special_heads if head in text}
            candidates = (tif for tif in self._special if tif[0][:2] in heads)
        plain_starts = [start for start, _ in plain or ()]
        plain_ends = [end for _, end in plain or ()]
        fragments: list[tuple[int, int] | int] = [(0, len(text))] if text else []
        for token_text, token_id, needs_special in candidates:
            if token_text not in text:
                continue
            size = len(token_text)
            split: list[tuple[int, int] | int] = []
            for fragment in fragments:
                if isinstance(fragment, int):
                    split.append(fragment)
                    continue
                start, end = fragment
                search = start
                while (hit := text.find(token_text, search, end)) >= 0:
                    if needs_special and _overlaps(plain_starts, plain_ends, hit, hit + size):
                        search = hit + 1
                        continue
                    if hit > start:
                        split.append((start, hit))
                    split.append(token_id)
                    start = search = hit + size
                if start < end:
                    split.append((start, end))
            fragments = split
        return [f if isinstance(f, int) else text[f[0] : f[1]] for f in fragments]

    def _merge_fragment(self, text: str, out: list[int]) -> None:
        """Bigram-merge one escaped fragment (llm_tokenizer_spm_session) and append its ids."""
        if text:
            symbols, nxt = _merge_bigrams(text, self._text_to_id, self._scores)
            self._emit(symbols, nxt, out)

    def _emit(self, symbols: list[str], nxt: list[int], out: list[int]) -> None:
        """Append the ids of the merged symbols in order; unknown characters as byte tokens."""
        vocab = self._text_to_id
        index = 0
        while index >= 0:
            piece = symbols[index]
            token_id = vocab.get(piece)
            if token_id is not None:
                out.append(token_id)
            else:
                # Only unmerged single characters reach here: merges always form vocab strings.
                for byte in piece.encode("utf-8"):
                    byte_id = self._byte_ids[byte]
                    if byte_id is None:
                        raise TokenizerError(
                            f"{self.source}: character {piece!r} is not in the vocab and byte token "
                            f"<0x{byte:02X}> is missing, so it cannot be tokenized"
                        )
                    out.append(byte_id)
            index = nxt[index]


def _merge_bigrams(text: str, vocab: dict[str, int], scores: list[float]) -> tuple[list[str], list[int]]:
    """llama.cpp's SPM merge of one non-empty fragment: adjacent symbols whose concatenation is in
    the vocab merge, highest score first (ties to the leftmost pair), until none does. Returns the
    symbols ("" where merged into the left neighbour) and each one's successor index (-1 at the end)."""
    n = len(text)
    symbols = list(text)  # "" once merged into its left neighbour
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    # (-score, left, right, size): max score first, ties to the leftmost pair.
    heap: list[tuple[float, int, int, int]] = []
    for left in range(n - 1):
        token_id = vocab.get(symbols[left] + symbols[left + 1])
        if token_id is not None:
            heap.append((-scores[token_id], left, left + 1, 2))
    heapq.heapify(heap)
    push = heapq.heappush
    pop = heapq.heappop
    while heap:
        _, left, right, size = pop(heap)
        left_text = symbols[left]
        right_text = symbols[right]
        # Stale: one side was merged away or grew since this pair was queued.
        if not left_text or not right_text or len(left_text) + len(right_text) != size:
            continue
        merged = left_text + right_text
        symbols[left] = merged
        symbols[right] = ""
        after = nxt[right]
        nxt[left] = after
        if after >= 0:
            prv[after] = left
        before = prv[left]
        if before >= 0:
            pair = symbols[before] + merged
            token_id = vocab.get(pair)
            if token_id is not None:
                push(heap, (-scores[token_id], before, left, len(pair)))
        if after >= 0:
            pair = merged + symbols[after]
            token_id = vocab.get(pair)
            if token_id is not None:
                push(heap, (-scores[token_id], left, after, len(pair)))
    return symbols, nxt


class StreamingDetokenizer:
    """Turns ids into text one at a time, holding bytes until they form whole UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        """Start an empty stream over `tokenizer`."""
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True

    def push(self, token_id: int) -> str:
        """Text completed by this token; an incomplete UTF-8 tail waits for later tokens."""
        piece = self._tokenizer.token_bytes(token_id)
        if self._at_start and piece:
            piece = _strip_space_prefix(piece, self._tokenizer.add_space_prefix)
            self._at_start = False
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
        self._at_start = True
        return text


def _added_tokens(
    texts: list[str], types: npt.NDArray[np.int32]
) -> tuple[list[tuple[str, int]], list[tuple[str, int, bool]]]:
    """The tokens that split raw text before merging: USER_DEFINED ones (text, id), and with
    special parsing, llama.cpp's one list of CONTROL, USER_DEFINED and UNKNOWN ones (text, id,
    whether it needs special parsing to match)."""
    user_defined = [int(i) for i in np.flatnonzero(types == TOKEN_TYPE_USER_DEFINED)]
    # Longest first; equal lengths by id (llama.cpp's std::sort leaves them unordered).
    by_length = sorted(((texts[i], i) for i in user_defined if texts[i]), key=lambda ti: (-len(ti[0]), ti[1]))
    # Longest in UTF-8 bytes first.
    special = np.isin(types, (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED))
    specials = sorted(
        ((texts[i], i, int(types[i]) != TOKEN_TYPE_USER_DEFINED) for i in (int(j) for j in np.flatnonzero(special))
         if texts[i]),
        key=lambda tif: (-len(tif[0].encode("utf-8", "surrogateescape")), tif[1]),
    )
    return by_length, specials


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


def _strip_space_prefix(data: bytes, add_space_prefix: bool) -> bytes:
    """Drop the one space encode() added in front when the vocab asks for a space prefix."""
    if add_space_prefix and data.startswith(b" "):
        return data[1:]
    return data


def _render_pieces(tokens: Sequence[bytes], types: npt.NDArray[np.int32]) -> list[bytes]:
    """Per-token decoded bytes, as llama.cpp token_to_piece renders them with special=False."""
    pieces: list[bytes] = []
    for raw, token_type in zip(tokens, types.tolist(), strict=True):
        if token_type == TOKEN_TYPE_NORMAL:
            pieces.append(raw.replace(_SPACE_ESCAPE_BYTES, b" "))
        elif token_type == TOKEN_TYPE_BYTE:
            pieces.append(_byte_of(raw))
        elif token_type in (TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN):
            pieces.append(raw)
        else:
            # CONTROL, UNUSED and undefined types render as nothing (llama.cpp suppresses them).
            pieces.append(b"")
    return pieces


def _byte_of(raw: bytes) -> bytes:
    """The byte of a `<0xNN>` token text."""
    if len(raw) == 6 and raw.startswith(b"<0x") and raw.endswith(b">"):
        try:
            return bytes([int(raw[3:5], 16)])
        except ValueError:
            pass
    raise TokenizerError(f"byte token text {raw!r} is not of the form <0xNN>")
