"""Constraints at the final stage, socket-free: the vocabulary's token trie that llguidance masks
with (built once, on the first constrained session), compiled constraints cached by their digest,
and each session's matcher kept in step with the tokens it generated (docs/PROTOCOL.md §5,
"Constrained sessions").

A matcher follows the session's history, never the other way round: before a pick it consumes
the generated tokens it has not seen and rolls back those a trim removed, so a replayed session
(its generated tokens sent again as prompt) and a forked one reach the same state as the
uninterrupted run.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import SessionError
from skippy_zmq.tokens.constraint import Constraint, ConstraintError
from skippy_zmq.tokens.llama_vocab import LlamaVocab, is_marker

MAX_COMPILED = 64
"""Compiled constraints a final stage keeps for reuse (least recently used dropped first)."""
I32Mask = npt.NDArray[np.int32]


class SessionGrammar:
    """One session's matcher and how many of its generated tokens it has consumed."""

    def __init__(self, constraint: Constraint, matcher: Any, n_vocab: int, eog_ids: Sequence[int]) -> None:
        self.constraint = constraint
        self._matcher = matcher
        self.consumed = 0
        self._mask: I32Mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)  # one bit per token id
        self._eog = np.asarray(sorted(eog_ids), dtype=np.int64)

    def follow(self, history: Sequence[int], prompt_tokens: int) -> None:
        """Bring the matcher to the end of the session's `history`, whose tokens after its first
        `prompt_tokens` are the ones it generated; SessionError if the constraint refuses one."""
        matcher = self._matcher
        count = max(len(history) - prompt_tokens, 0)
        if count < self.consumed:  # a trim took generated tokens back
            if matcher.rollback(self.consumed - count):
                self.consumed = count
            else:
                matcher.reset()
                self.consumed = 0
        if count == self.consumed:
            return
        new = [int(token) for token in history[prompt_tokens + self.consumed:]]
        accepted = matcher.validate_tokens(new)
        if accepted < len(new) or not matcher.consume_tokens(new):
            bad = new[min(accepted, len(new) - 1)]
            raise SessionError(f"the {self.constraint.name} constraint refuses generated token {bad} at output "
                               f"position {self.consumed + accepted}: {matcher.get_error() or 'not allowed there'}")
        self.consumed = count

    def mask(self, *, keep_generating: bool) -> I32Mask:
        """The bitmask of the ids allowed next (bit i of word i // 32 for id i); with
        `keep_generating` (`ignore_eos`), end-of-generation ids only where nothing else is."""
        matcher = self._matcher
        matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if matcher.is_error():
            raise SessionError(f"the {self.constraint.name} constraint failed after {self.consumed} generated "
                               f"tokens: {matcher.get_error()}")
        if keep_generating and self._eog.size:
            without = self._mask.copy()
            bits = np.uint32(1) << (self._eog % 32).astype(np.uint32)
            np.bitwise_and.at(without.view(np.uint32), self._eog // 32, ~bits)
            if without.any():
                return without
        return self._mask


class GrammarBook:
    """The final stage's constraint compiler: llguidance's tokenizer of the model's vocabulary and
    the compiled constraints, by digest."""

    def __init__(self, vocab_path: str | os.PathLike[str], eog_ids: Sequence[int]) -> None:
        self.vocab_path = os.fspath(vocab_path)
        self.eog_ids = tuple(sorted(eog_ids))
        self._vocab: LlamaVocab | None = None  # llama.cpp's, which llguidance tokenizes with: kept while used
        self._tokenizer: Any = None
        self._compiled: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.build_s = 0.0  # how long the token trie took to build (0 until it is)
        self.compiles = 0  # constraints compiled (a cached one is not compiled again)

    def tokenizer(self) -> Any:
        """llguidance's tokenizer of the vocabulary, built on first use (2.0 s for 262,144 ids:
        docs/BENCHMARKS.md, "Structured outputs")."""
        with self._lock:
            if self._tokenizer is None:
                started = time.perf_counter()
                self._vocab, self._tokenizer = _build_tokenizer(self.vocab_path, self.eog_ids)
                self.build_s = time.perf_counter() - started
            return self._tokenizer

    def start(self, constraint: Constraint) -> SessionGrammar:
        """A fresh matcher for `constraint`, compiled once per digest; ConstraintError if it is not valid."""
        tokenizer = self.tokenizer()
        compiled = self._compiled.get(constraint.digest)
        if compiled is None:
            import llguidance

            compiled = llguidance.LLMatcher(tokenizer, constraint.grammar(), log_level=0)
            if compiled.is_error():
                raise ConstraintError(f"{constraint.name}: {compiled.get_error()}")
            self.compiles += 1
            self._compiled[constraint.digest] = compiled
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint.digest)
        return SessionGrammar(constraint, compiled.deep_copy(), tokenizer.vocab_size, self.eog_ids)


def _build_tokenizer(path: str, eog_ids: Sequence[int]) -> tuple[LlamaVocab, Any]:
    """The file's vocabulary as llama.cpp loads it, and llguidance's tokenizer over its pieces and
    llama.cpp's own tokenizer; every end-of-generation id ends a constrained text."""
    try:
        from llguidance import LLTokenizer
    except ImportError:
        raise ConstraintError("constraints need the llguidance package; install skippy-zmq[model]") from None
    vocab = LlamaVocab.load(path)
    pieces = vocab.pieces()
    for token_id, attr in enumerate(vocab.attrs()):
        if is_marker(attr, pieces[token_id]):  # llguidance's mark of a token a grammar names, never text
            pieces[token_id] = b"\xff" + pieces[token_id]
    tokenizer = LLTokenizer.from_llamacpp(tokens=pieces, vocab_ptr=vocab.handle,  # type: ignore[attr-defined]
                                          tokenize_fptr=vocab.tokenize_address(),
                                          eos_token=list(eog_ids) or [vocab.special_id("eos") or 0],
                                          slices=None)
    return vocab, tokenizer
