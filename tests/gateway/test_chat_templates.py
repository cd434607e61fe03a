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
from skippy_zmq.testing.llama_sources import template_files, vocab_cases
from skippy_zmq.testing.tiny import tiny_vocab, vocab_tokenizer
from skippy_zmq.tokens.llama_vocab import LlamaVocab
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
    return vocab_tokenizer(vocab[0], vocab[1], vocab[2], bos_id=ids[spec["bos_token"]],
                           eos_id=ids[spec["eos_token"]], unk_id=ids["<unk>"], pad_id=ids["<pad>"],
                           add_bos=spec["add_bos"])


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


# Each family's template with its family's real vocabulary (the ggml-vocab-*.gguf of llama.cpp's
# sources): the prompt's ids are llama-server's, which tokenizes the rendered text whole with
# special tokens parsed and the vocab's BOS/EOS added.
FAMILIES = [
    ("meta-llama-Llama-3.1-8B-Instruct", "llama-bpe"),
    ("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe"),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "llama-bpe"),
    ("Qwen-Qwen2.5-7B-Instruct", "qwen2"),
    ("Qwen-QwQ-32B", "qwen2"),
    ("Qwen-Qwen3-0.6B", "qwen2"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "qwen2"),
    ("mistralai-Mistral-Nemo-Instruct-2407", "llama-spm"),
    ("microsoft-Phi-3.5-mini-instruct", "phi-3"),
    ("CohereForAI-c4ai-command-r-plus-tool_use", "command-r"),
    ("HuggingFaceTB-SmolLM3-3B", "llama-bpe"),
]


@pytest.mark.parametrize(("name", "vocab"), FAMILIES)
def test_a_familys_prompt_ids_are_llama_servers_on_its_vocabulary(sources: dict[str, str], name: str,
                                                                  vocab: str) -> None:
    path = next(case.path for case in vocab_cases() if case.name == vocab)
    tokenizer = Tokenizer.from_gguf(path)
    oracle = LlamaVocab.load(path)
    template = ChatTemplate.from_source(sources[name], tokenizer, origin=name)
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    for set_name, messages in _DATA["message_sets"].items():
        prompt = template.render(messages, now=NOW)
        expected = bos + oracle.tokenize(prompt.text.encode(), parse_special=True)
        typed = {tokenizer.special_text_in(json.dumps(message, ensure_ascii=False)) for message in messages} - {None}
        if not typed:
            assert list(prompt.ids) == expected, (name, set_name)
            continue
        # A user typed a special token's text (`</s>` is one in Qwen's vocab): llama-server parses it
        # as the token, this gateway keeps it text (docs/PROTOCOL.md §7, "Tokenizer").
        special_ids = {oracle.tokenize(text.encode(), parse_special=True)[0] for text in typed if text}
        assert sum(i in special_ids for i in prompt.ids) < sum(i in special_ids for i in expected), (name, set_name)
