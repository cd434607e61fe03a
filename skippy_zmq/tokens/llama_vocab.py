"""A GGUF's vocabulary as llama.cpp itself loads it (vocab only, no weights), through the
libllama that llama-cpp-python builds: the same tokenizer code llama-server runs, for every
vocabulary kind and pre-tokenizer llama.cpp knows (docs/PROTOCOL.md §7, "Tokenizer").

This module only moves bytes across the C boundary. What llama.cpp would abort on (an id outside
the vocab, an SPM vocab without its byte tokens) is refused before the call: an uncaught C++
exception ends the whole process.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import os
import threading
import weakref
from typing import Any

from skippy_zmq.errors import ModelLoadError, TokenizerError


class VocabType(enum.IntEnum):
    """llama.cpp's `enum llama_vocab_type`."""

    NONE = 0
    SPM = 1  # SentencePiece byte-fallback BPE (tokenizer.ggml.model "llama")
    BPE = 2  # byte-level BPE with a pre-tokenizer ("gpt2")
    WPM = 3  # WordPiece ("bert")
    UGM = 4  # SentencePiece unigram ("t5")
    RWKV = 5
    PLAMO2 = 6


class TokenAttr(enum.IntFlag):
    """llama.cpp's `enum llama_token_attr`, as it decides them at load."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


def is_marker(attr: int, piece: bytes) -> bool:
    """Whether a token is a marker a grammar names as a token, never as text: a control token, or a
    user-defined one written like one (`<tool_call>`); llguidance's rule for llama.cpp vocabularies."""
    return bool(attr & TokenAttr.CONTROL) or (bool(attr & TokenAttr.USER_DEFINED) and piece[:1] == b"<"
                                             and piece[-1:] == b">")


_LOAD_LOCK = threading.Lock()  # llama.cpp's log callback is process-wide: one load at a time
_captured: list[str] = []


@functools.cache
def _binding() -> tuple[Any, Any]:
    """llama-cpp-python's bindings of libllama, imported on first use (0.3 s), and the log
    callback that captures what a load says (kept alive here: ctypes would free it otherwise)."""
    try:
        import llama_cpp
    except ImportError:
        raise ModelLoadError("the tokenizer needs llama-cpp-python; install skippy-zmq[model]") from None

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def capture(_level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
        _captured.append(text.decode("utf-8", "replace"))

    return llama_cpp, capture


class LlamaVocab:
    """One GGUF's vocabulary loaded by llama.cpp; freed by `close` or when collected."""

    def __init__(self, lib: Any, model: Any, source: str) -> None:
        """Wrap a loaded vocab-only llama_model (use `load`)."""
        self._lib = lib
        self._vocab = lib.llama_model_get_vocab(model)
        self.source = source
        self.type = VocabType(lib.llama_vocab_type(self._vocab))
        self.n_tokens: int = lib.llama_vocab_n_tokens(self._vocab)
        self._finalizer = weakref.finalize(self, lib.llama_model_free, model)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LlamaVocab:
        """Load `path`'s vocabulary; ModelLoadError with llama.cpp's own reason if it refuses."""
        lib, capture = _binding()
        params = lib.llama_model_default_params()
        params.vocab_only = True
        with _LOAD_LOCK:
            _captured.clear()
            lib.llama_log_set(capture, ctypes.c_void_p(0))
            try:
                model = lib.llama_model_load_from_file(os.fsencode(path), params)
            finally:
                _restore_logging(lib)
            said = [line.strip() for line in _captured if "error" in line.lower() or "failed" in line.lower()]
            _captured.clear()
        if not model:
            reason = "; ".join(said[-3:]) or "no reason given"
            raise ModelLoadError(f"{path}: llama.cpp cannot load this file's vocabulary: {reason}")
        return cls(lib, model, str(path))

    def close(self) -> None:
        """Free the vocabulary now (later calls raise TokenizerError)."""
        self._finalizer()

    @property
    def handle(self) -> Any:
        """The llama_vocab pointer while the vocabulary is loaded: a freed one would crash the process."""
        if not self._finalizer.alive:
            raise TokenizerError(f"{self.source}: the vocabulary was closed")
        return self._vocab

    def tokenize(self, text: bytes, *, parse_special: bool) -> list[int]:
        """llama.cpp's ids of `text` (UTF-8), without BOS/EOS: `llama_tokenize(add_special=false)`."""
        if not text:
            return []
        capacity = len(text) + 4  # a token covers at least one byte
        for _ in range(2):
            out = (ctypes.c_int32 * capacity)()
            count = self._lib.llama_tokenize(self.handle, text, len(text), out, capacity, False, parse_special)
            if count >= 0:
                return list(out[:count])
            capacity = -count
        raise TokenizerError(f"{self.source}: llama.cpp's tokenizer gave no ids for a text of {len(text)} bytes")

    def piece(self, token_id: int, *, special: bool) -> bytes:
        """llama.cpp's `llama_token_to_piece(lstrip=0)` of an id already checked to be in range."""
        buffer = ctypes.create_string_buffer(64)  # one per call: threads may ask at once
        size = self._lib.llama_token_to_piece(self.handle, token_id, buffer, len(buffer), 0, special)
        if size < 0:
            buffer = ctypes.create_string_buffer(-size)
            size = self._lib.llama_token_to_piece(self.handle, token_id, buffer, len(buffer), 0, special)
        return buffer.raw[:size]

    def pieces(self) -> list[bytes]:
        """Every id's piece with special tokens rendered (`piece(special=True)`), in id order, through
        one buffer (1.1 s for 262,144 ids)."""
        convert, vocab = self._lib.llama_token_to_piece, self.handle
        buffer = ctypes.create_string_buffer(256)
        out = []
        for token_id in range(self.n_tokens):
            size = convert(vocab, token_id, buffer, len(buffer), 0, True)
            out.append(buffer.raw[:size] if size >= 0 else self.piece(token_id, special=True))
        return out

    def tokenize_address(self) -> int:
        """The address of libllama's `llama_tokenize`, for native code that tokenizes with this vocabulary."""
        address = ctypes.cast(self._lib.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
        assert address is not None, "libllama is loaded"
        return int(address)

    def text(self, token_id: int) -> bytes:
        """The raw vocab text of an id in range (`llama_vocab_get_text`)."""
        return bytes(self._lib.llama_vocab_get_text(self.handle, token_id))

    def attr(self, token_id: int) -> TokenAttr:
        """llama.cpp's attributes of an id in range."""
        return TokenAttr(self._lib.llama_vocab_get_attr(self.handle, token_id))

    def attrs(self) -> list[int]:
        """Every id's attributes, in id order (0.12 s for 262,144 ids)."""
        get, vocab = self._lib.llama_vocab_get_attr, self.handle
        return [get(vocab, i) for i in range(self.n_tokens)]

    def eog_ids(self) -> frozenset[int]:
        """The ids llama.cpp ends generation at (eos, eot, eom and the family's end tokens)."""
        is_eog, vocab = self._lib.llama_vocab_is_eog, self.handle
        return frozenset(i for i in range(self.n_tokens) if is_eog(vocab, i))

    def special_id(self, name: str) -> int | None:
        """The id of a special token (`bos`, `eos`, `eot`, `sep`, `pad`, `nl`), None if the vocab has none."""
        value: int = getattr(self._lib, f"llama_vocab_{name}")(self.handle)
        return value if 0 <= value < self.n_tokens else None

    def adds(self, name: str) -> bool:
        """Whether the vocab asks for a token added around a text (`bos`, `eos`, `sep`)."""
        return bool(getattr(self._lib, f"llama_vocab_get_add_{name}")(self.handle))


def _restore_logging(lib: Any) -> None:
    """Give llama.cpp's log back to llama-cpp-python's handler (it prints by its logger's level)."""
    from llama_cpp import _logger

    lib.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
