"""Constraints at the final stage: masks that allow exactly what the constraint allows, matchers that
follow a session's history through trims and replays, compiled constraints reused by digest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.errors import SessionError
from skippy_zmq.tokens.constraint import Constraint, ConstraintError
from skippy_zmq.tokens.grammar import GrammarBook
from skippy_zmq.tokens.sampling import Sampler, SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer, eog_ids_of

pytest.importorskip("llguidance")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = [2, 40, 41]  # any ids: the matcher reads only what follows the prompt


@pytest.fixture(scope="module")
def book(tiny_gemma3_path: Path) -> GrammarBook:
    return GrammarBook(tiny_gemma3_path, sorted(eog_ids_of(tiny_gemma3_path)))


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_gemma3_path)


def allowed_ids(mask: np.ndarray, n_vocab: int) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little", count=n_vocab)
    return {int(i) for i in np.flatnonzero(bits)}


def test_each_token_of_a_valid_text_is_allowed_where_it_comes(book: GrammarBook, tokenizer: Tokenizer) -> None:
    text = json.dumps({"name": "Ann", "age": 42}, separators=(",", ":"))
    ids = tokenizer.encode(text, add_special=False)
    grammar = book.start(Constraint.json_schema(SCHEMA))
    history = list(PROMPT)
    for token in ids:
        grammar.follow(history, len(PROMPT))
        assert token in allowed_ids(grammar.mask(keep_generating=False), tokenizer.n_vocab)
        history.append(token)
    grammar.follow(history, len(PROMPT))
    # The object is complete: only end-of-generation ids remain.
    assert allowed_ids(grammar.mask(keep_generating=False), tokenizer.n_vocab) <= set(book.eog_ids)


def _allows(book: GrammarBook, tokenizer: Tokenizer, schema: dict[str, Any], text: str) -> bool:
    """Whether the schema's grammar allows every token of `text` where it comes."""
    grammar = book.start(Constraint.json_schema(schema))
    history = list(PROMPT)
    for token in tokenizer.encode(text, add_special=False):
        grammar.follow(history, len(PROMPT))
        if token not in allowed_ids(grammar.mask(keep_generating=False), tokenizer.n_vocab):
            return False
        history.append(token)
    return True


def test_a_tuple_of_items_is_enforced_in_either_draft_s_spelling(book: GrammarBook, tokenizer: Tokenizer) -> None:
    draft7 = {"type": "array", "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": False}
    draft2020 = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}
    for schema in (draft7, draft2020):
        Constraint.json_schema(schema).check()
        assert _allows(book, tokenizer, schema, '[1,"a"]')
        assert not _allows(book, tokenizer, schema, "[1,2]")
        assert not _allows(book, tokenizer, schema, '[1,"a",3]')


def test_the_first_token_must_open_the_object(book: GrammarBook, tokenizer: Tokenizer) -> None:
    grammar = book.start(Constraint.json_schema(SCHEMA))
    grammar.follow(PROMPT, len(PROMPT))
    allowed = allowed_ids(grammar.mask(keep_generating=False), tokenizer.n_vocab)
    assert allowed and all(tokenizer.decode([t]).lstrip(" \n\t").startswith("{") for t in allowed)


def test_ignore_eos_keeps_end_ids_out_unless_nothing_else_is_allowed(book: GrammarBook, tokenizer: Tokenizer) -> None:
    grammar = book.start(Constraint.regex("[0-9]{1,3}"))
    digit = tokenizer.encode("7", add_special=False)
    history = [*PROMPT, *digit]
    grammar.follow(history, len(PROMPT))
    loose = allowed_ids(grammar.mask(keep_generating=False), tokenizer.n_vocab)
    strict = allowed_ids(grammar.mask(keep_generating=True), tokenizer.n_vocab)
    assert loose & set(book.eog_ids) and not strict & set(book.eog_ids) and strict == loose - set(book.eog_ids)
    history += tokenizer.encode("89", add_special=False)
    grammar.follow(history, len(PROMPT))  # three digits: only the end remains, ignore_eos or not
    assert allowed_ids(grammar.mask(keep_generating=True), tokenizer.n_vocab) <= set(book.eog_ids)


@settings(max_examples=25, deadline=None)
@given(cut=st.integers(0, 12), grow=st.integers(0, 12))
def test_a_trimmed_or_replayed_history_gives_the_fresh_matchers_mask(book: GrammarBook, tokenizer: Tokenizer,
                                                                     cut: int, grow: int) -> None:
    ids = tokenizer.encode('{"name":"Bo","age":7}', add_special=False)
    cut, grow = min(cut, len(ids)), min(grow, len(ids))
    followed = book.start(Constraint.json_schema(SCHEMA))
    followed.follow([*PROMPT, *ids[:grow]], len(PROMPT))
    followed.follow([*PROMPT, *ids[:cut]], len(PROMPT))  # a trim back (or on) to `cut`
    fresh = book.start(Constraint.json_schema(SCHEMA))
    fresh.follow([*PROMPT, *ids[:cut]], len(PROMPT))  # a replay: the whole history at once
    assert np.array_equal(followed.mask(keep_generating=False), fresh.mask(keep_generating=False))


def test_a_refused_generated_token_names_its_position(book: GrammarBook, tokenizer: Tokenizer) -> None:
    grammar = book.start(Constraint.regex("[0-9]+"))
    history = [*PROMPT, *tokenizer.encode("12", add_special=False), *tokenizer.encode("x", add_special=False)]
    with pytest.raises(SessionError, match=r"regex constraint refuses generated token \d+ at output position 2"):
        grammar.follow(history, len(PROMPT))


def test_a_constraint_is_compiled_once_per_digest(book: GrammarBook) -> None:
    before = book.compiles
    first = book.start(Constraint.regex("[a-c]{2}q"))
    second = book.start(Constraint.regex("[a-c]{2}q"))
    assert book.compiles == before + 1 and first is not second
    with pytest.raises(ConstraintError, match="unclosed"):
        book.start(Constraint.regex("[a-"))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), temperature=st.floats(0.1, 2.0), top_k=st.integers(0, 50))
def test_the_sampler_never_draws_a_masked_id(book: GrammarBook, tokenizer: Tokenizer, seed: int, temperature: float,
                                             top_k: int) -> None:
    grammar = book.start(Constraint.regex("(yes|no|maybe)"))
    grammar.follow(PROMPT, len(PROMPT))
    mask = grammar.mask(keep_generating=False)
    logits = np.random.default_rng(seed % 2**32).normal(size=tokenizer.n_vocab).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, seed=seed))
    token = sampler.sample(logits, PROMPT, allowed=mask)
    assert token in allowed_ids(mask, tokenizer.n_vocab)
    greedy = Sampler(SamplingParams()).sample(logits, PROMPT, allowed=mask)
    allowed = sorted(allowed_ids(mask, tokenizer.n_vocab))
    assert greedy == allowed[int(np.argmax(logits[allowed]))]
