"""skippy_zmq.gateway.chat against llama-server: every chat template of llama.cpp's models/templates/
renders every recorded message set as llama-server's `--jinja` mode did (/apply-template, recorded by
tools/record_chat_templates.py into tests/data/llama_cpp/chat_templates.json)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest

from skippy_zmq.gateway.chat import ChatTemplate
from skippy_zmq.testing.llama_sources import template_files
from skippy_zmq.testing.tiny import tiny_vocab
from skippy_zmq.tokens.tokenizer import Tokenizer

RECORD = Path(__file__).parents[1] / "data" / "llama_cpp" / "chat_templates.json"
_DATA: dict[str, Any] = json.loads(RECORD.read_text())

# (template, message set) pairs whose render differs from llama-server's, with the reason; a
# message set of None stands for every set of that template.
DIFFERENCES: dict[tuple[str, str | None], str] = {}


def _tokenizer() -> Tokenizer:
    """A vocab with the recorded model's BOS and EOS texts and its add_bos."""
    vocab = tiny_vocab()
    ids = {token: i for i, token in enumerate(vocab[0])}
    spec = _DATA["vocab"]
    return Tokenizer([t.encode() for t in vocab[0]], list(vocab[1]), list(vocab[2]), bos_id=ids[spec["bos_token"]],
                     eos_id=ids[spec["eos_token"]], unk_id=ids["<unk>"], pad_id=ids["<pad>"], add_bos=spec["add_bos"],
                     add_space_prefix=False)


TOK = _tokenizer()
NOW = datetime.datetime.combine(datetime.date.fromisoformat(_DATA["date"]), datetime.time(12))
CASES = [(name, set_name) for name, record in sorted(_DATA["templates"].items()) for set_name in record["renders"]]


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    """llama.cpp's templates by name."""
    return {path.stem: path.read_text() for path in template_files()}


def test_the_record_covers_every_template_of_llama_cpp_and_is_small(sources: dict[str, str]) -> None:
    assert sorted(_DATA["templates"]) == sorted(sources)
    assert RECORD.stat().st_size < 400 * 1024
    assert all("refused" not in record for record in _DATA["templates"].values())


@pytest.mark.parametrize(("name", "set_name"), CASES)
def test_a_template_renders_as_llama_server_does(sources: dict[str, str], name: str, set_name: str) -> None:
    record = _DATA["templates"][name]
    expected = record["renders"][set_name]
    if "error" in expected:
        pytest.fail(f"llama-server refused: {expected['error']}")
    reason = DIFFERENCES.get((name, set_name)) or DIFFERENCES.get((name, None))
    if reason is not None:
        pytest.xfail(reason)
    template = ChatTemplate.from_source(sources[name], TOK, origin=name)
    assert template.render_text(_DATA["message_sets"][set_name], now=NOW) == record["prefix"] + expected["rest"]
