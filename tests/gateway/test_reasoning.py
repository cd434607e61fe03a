"""skippy_zmq.gateway.reasoning: thought turned on and off in real chat templates, and an answer's thought
read apart from its content, whole and streamed alike."""

from __future__ import annotations

import datetime
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.driver.generation import GenerationResult
from skippy_zmq.errors import ConfigError, RequestError
from skippy_zmq.gateway.chat import ChatTemplate
from skippy_zmq.gateway.openai_api import Choice, ChoiceStreams, CompletionParams, Endpoint, ResponseShape, Usage
from skippy_zmq.gateway.reasoning import (
    CONTENT,
    DEFAULT_THINKING,
    REASONING,
    THOUGHT_MARKERS,
    ReasoningFormat,
    ReasoningReader,
    Thinking,
    answer_rules,
    markers_of,
    thought_first,
)
from skippy_zmq.gateway.sampling_defaults import SamplingDefaults
from skippy_zmq.testing.llama_sources import template_files
from skippy_zmq.testing.tiny import tiny_vocab, vocab_tokenizer
from skippy_zmq.tokens.constraint import Constraint
from skippy_zmq.tokens.grammar import GrammarBook
from skippy_zmq.tokens.tokenizer import Tokenizer, eog_ids_of

THINK = THOUGHT_MARKERS[0]
NOW = datetime.datetime(2026, 12, 5, 12)


def _tokenizer() -> Tokenizer:
    words, scores, kinds = tiny_vocab()
    ids = {token: i for i, token in enumerate(words)}
    return vocab_tokenizer(words, scores, kinds, bos_id=ids["<bos>"], eos_id=ids["<eos>"], unk_id=ids["<unk>"],
                           pad_id=ids["<pad>"], add_bos=False)


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    """llama.cpp's chat templates by name."""
    return {path.stem: path.read_text() for path in template_files()}


def _template(sources: dict[str, str], name: str) -> ChatTemplate:
    return ChatTemplate.from_source(sources[name], _tokenizer(), origin=name)


# --- the templates ---------------------------------------------------------------------------------------

# llama-server's own expectations (its tests' test_reasoning): the prompt's end with --reasoning on/off/auto.
PROMPT_ENDS = [
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", True, "<think>\n", True),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", None, "<think>\n", True),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", False, "<think>\n</think>", False),
    ("Qwen-Qwen3-0.6B", None, "<|im_start|>assistant\n", False),
    ("Qwen-Qwen3-0.6B", False, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("Qwen-QwQ-32B", None, "<|im_start|>assistant\n<think>\n", True),
    ("Qwen-QwQ-32B", False, "<|im_start|>assistant\n<think>\n</think>", False),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", None, "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", False),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", False,
     "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>", False),
]


@pytest.mark.parametrize(("name", "enable", "end", "opened"), PROMPT_ENDS)
def test_thought_on_off_and_auto_end_the_prompt_as_llama_server(sources: dict[str, str], name: str,
                                                                 enable: bool | None, end: str, opened: bool) -> None:
    template = _template(sources, name)
    thinking = Thinking(enable=enable)
    prompt = template.render_text([{"role": "user", "content": "What is today?"}], now=NOW, thinking=thinking)
    assert prompt.endswith(end), prompt[-120:]
    reader = template.reasoning_reader(thinking)
    assert reader is not None and reader.opened is opened


@pytest.mark.parametrize(("name", "marker"), [
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "think"), ("Qwen-Qwen3-0.6B", "think"),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "command-r"), ("ByteDance-Seed-OSS", "seed"),
    ("mistralai-Ministral-3-14B-Reasoning-2512", "mistral"),
    ("Qwen-Qwen2.5-7B-Instruct", None), ("meta-llama-Llama-3.3-70B-Instruct", None), ("google-gemma-2-2b-it", None),
])
def test_a_template_s_thought_markers_are_found(sources: dict[str, str], name: str, marker: str | None) -> None:
    found = markers_of(sources[name])
    assert (found.name if found is not None else None) == marker


def test_reasoning_format_none_and_a_template_without_markers_read_no_thought(sources: dict[str, str]) -> None:
    assert _template(sources, "Qwen-Qwen3-0.6B").reasoning_reader(Thinking(format=ReasoningFormat.NONE)) is None
    assert _template(sources, "Qwen-Qwen2.5-7B-Instruct").reasoning_reader() is None


def test_template_kwargs_reach_the_template_and_a_history_s_thought_is_shown(sources: dict[str, str]) -> None:
    template = ChatTemplate.from_source(
        "{% for m in messages %}[{{ m.role }}:{{ m.reasoning_content or '' }}|{{ m.content }}]{% endfor %}"
        "{{ effort }}", _tokenizer())
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "t"}]
    thinking = Thinking.from_request(DEFAULT_THINKING, {"effort": "high"}, None, None)
    assert template.render_text(messages, thinking=thinking) == "[user:|q][assistant:t|a]high"
    ids = template.render_ids([{"role": "user", "content": "q"},
                               {"role": "assistant", "content": "a", "reasoning_content": "<eos>"}], thinking=thinking)
    assert ids == template.render_ids([{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "a", "reasoning_content": "<eos>"}],
                                      thinking=thinking)
    with pytest.raises(RequestError, match=r"messages\[0\]\.reasoning_content: must be a string"):
        template.render_text([{"role": "assistant", "content": "a", "reasoning_content": 3}])
    with pytest.raises(RequestError, match="chat_template_kwargs: contain the special-token text '<eos>'"):
        template.render_ids(messages, thinking=Thinking.from_request(DEFAULT_THINKING, {"effort": "<eos>"}, None, None))


# --- the settings ----------------------------------------------------------------------------------------


def test_a_request_s_thought_settings_go_over_the_server_s() -> None:
    server = Thinking.from_options("off", "deepseek", '{"effort": "low", "x": 1}')
    assert server == Thinking(False, ReasoningFormat.DEEPSEEK, (("effort", "low"), ("x", 1)))
    mine = Thinking.from_request(server, {"enable_thinking": True, "x": 2}, None, "none")
    assert mine == Thinking(True, ReasoningFormat.NONE, (("effort", "low"), ("x", 2)))
    assert Thinking.from_request(mine, None, "none", None).enable is False
    assert Thinking.from_request(DEFAULT_THINKING, None, "high", None).template_kwargs == (("reasoning_effort", "high"),)
    assert Thinking.from_options("on", "auto", '{"enable_thinking": false}').enable is False  # the JSON is later


@pytest.mark.parametrize(("switch", "shape", "kwargs", "message"), [
    ("maybe", "auto", None, "--reasoning 'maybe' must be one of on, off, auto"),
    ("on", "r1", None, "--reasoning-format 'r1' is not a reasoning format"),
    ("on", "auto", "{", "--chat-template-kwargs is not JSON"),
    ("on", "auto", "[1]", "--chat-template-kwargs must be a JSON object"),
    ("on", "auto", '{"enable_thinking": "false"}', "enable_thinking must be true or false, got 'false'"),
])
def test_bad_server_thought_options_are_named(switch: str, shape: str, kwargs: str | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Thinking.from_options(switch, shape, kwargs)


def test_a_chat_request_carries_its_thought_settings() -> None:
    defaults = SamplingDefaults(thinking=Thinking(enable=False))
    params = CompletionParams.from_body(Endpoint.CHAT, {"messages": [{"role": "user", "content": "q"}],
                                                        "reasoning_format": "deepseek-legacy",
                                                        "chat_template_kwargs": {"enable_thinking": True}}, defaults)
    assert params.thinking == Thinking(True, ReasoningFormat.DEEPSEEK_LEGACY)
    plain = CompletionParams.from_body(Endpoint.CHAT, {"messages": [{"role": "user", "content": "q"}]}, defaults)
    assert plain.thinking == Thinking(enable=False)


# --- reading answers -------------------------------------------------------------------------------------

_PLAIN = st.text(st.sampled_from("ab <>/\n\tthink"), max_size=12)


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(cut, len(text)) for cut in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def _streamed(reader: ReasoningReader, pieces: list[str]) -> tuple[str | None, str]:
    stream = reader.stream()
    out = [piece for part in pieces for piece in stream.feed(part)] + stream.finish()
    thought = "".join(text for kind, text in out if kind == REASONING)
    assert all(text for _, text in out), out  # no empty pieces
    return thought or None, "".join(text for kind, text in out if kind == CONTENT)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.one_of(_PLAIN, st.sampled_from([THINK.start, THINK.end, " ", "\n"])), max_size=8),
       cuts=st.lists(st.integers(0, 80), max_size=10), opened=st.booleans(), legacy=st.booleans())
def test_a_streamed_answer_reads_as_the_whole(parts: list[str], cuts: list[int], opened: bool, legacy: bool) -> None:
    text = "".join(parts)
    reader = ReasoningReader(THINK, opened=opened, legacy=legacy)
    assert _streamed(reader, _pieces(text, cuts)) == reader.split(text)
    if legacy:
        assert reader.split(text)[1] == text  # the legacy format keeps the whole text as content


@settings(max_examples=200, deadline=None)
@given(lead=st.sampled_from(["", " ", "\n"]), thought=_PLAIN, content=_PLAIN, opened=st.booleans())
def test_a_thought_and_its_answer_are_read_apart(lead: str, thought: str, content: str, opened: bool) -> None:
    reader = ReasoningReader(THINK, opened=opened)
    text = ("" if opened else lead + THINK.start) + "\n" + thought + "\n" + THINK.end + "\n\n" + content
    if THINK.start in thought + content or THINK.end in thought + content:
        return
    assert reader.split(text) == (thought.strip() or None, content.lstrip())


@pytest.mark.parametrize(("text", "opened", "expected"), [
    ("plain answer", False, (None, "plain answer")),
    ("  <thi", False, (None, "  <thi")),  # an opening marker never finished is text
    ("<think>cut off at the len", False, ("cut off at the len", "")),
    ("still thinking </thin", True, ("still thinking </thin", "")),
    ("x</think>", True, ("x", "")),
    ("</think>\n\nanswer", True, (None, "answer")),
    ("answer <think>inside</think>", False, (None, "answer <think>inside</think>")),
])
def test_edges_of_a_thought(text: str, opened: bool, expected: tuple[str | None, str]) -> None:
    assert ReasoningReader(THINK, opened=opened).split(text) == expected


def _result(text: str, reason: str = "stop") -> GenerationResult:
    return GenerationResult(prompt="", prompt_ids=[5], tokens=[1, 2], text=text, finish_reason=reason)


def test_a_chat_answer_carries_reasoning_content_whole_and_streamed() -> None:
    reader = ReasoningReader(THINK, opened=True)
    shape = ResponseShape.new(Endpoint.CHAT, "m")
    whole = shape.response([Choice.of(_result("Let me see.\n</think>\n\nIt is 4."), logprobs=False,
                                      reasoning=reader)], Usage(1, 2))
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "It is 4.",
                                              "reasoning_content": "Let me see."}
    streams = ChoiceStreams(shape, 1, logprobs=False, reasoning=reader)
    deltas: list[dict[str, Any]] = []
    for part in ["Let ", "me see.\n</th", "ink>\n\nIt", " is 4."]:
        deltas += [chunk["choices"][0]["delta"] for chunk in streams.delta(0, part, [])]
    deltas += [chunk["choices"][0]["delta"] for chunk in streams.ending([_result("")])]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me see."
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."
    kinds = [next(iter(d)) for d in deltas if d]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content")  # every thought delta comes first


def test_the_whole_thought_of_an_answer_cut_off_is_reasoning() -> None:
    reader = ReasoningReader(THINK)
    choice = Choice.of(_result("<think>\nhalf a thou", "length"), logprobs=False, reasoning=reader)
    assert (choice.reasoning, choice.text) == ("half a thou", "")


# --- a thought before a constrained answer ---------------------------------------------------------------

ANSWER = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
PROMPT = [2, 40, 41]  # any ids: the matcher reads only what follows the prompt


@pytest.fixture(scope="module")
def book(tiny_gemma3_path: Path) -> GrammarBook:
    pytest.importorskip("llguidance")
    return GrammarBook(tiny_gemma3_path, sorted(eog_ids_of(tiny_gemma3_path)))


def _walk(book: GrammarBook, grammar: str, ids: list[int]) -> str:
    """How far the grammar takes `ids`: "refused" at a token it masks, else "complete" where the end may
    follow, or "open" where more must come."""
    session = book.start(Constraint.lark(grammar))
    n_vocab = Tokenizer.from_gguf(book.vocab_path).n_vocab
    history = list(PROMPT)
    for token in [*ids, None]:
        session.follow(history, len(PROMPT))
        bits = np.unpackbits(session.mask(keep_generating=False).view(np.uint8), bitorder="little",
                             count=n_vocab)
        if token is None:
            return "complete" if any(bits[end] for end in book.eog_ids) else "open"
        if not bits[token]:
            return "refused"
        history.append(token)
    raise AssertionError("unreachable")


@pytest.mark.parametrize(("opened", "text", "expected"), [
    (True, 'Two and two.\n</think>\n\n{"a": 4}', "complete"),
    (True, 'x</think>{"a":4}', "complete"),
    (True, '{"a":4}', "open"),  # the template opened the thought: this is still thought
    (True, 'x</think> b </think>{"a":4}', "refused"),  # after the thought, only the answer
    (True, 'x</think>not json', "refused"),
    (False, '{"a":4}', "complete"),  # no thought at all
    (False, '<think>x</think>\n{"a":4}', "complete"),
    (False, 'free text', "refused"),
])
def test_a_thought_may_come_before_a_schema_s_answer(book: GrammarBook, opened: bool, text: str,
                                                      expected: str) -> None:
    tokenizer = Tokenizer.from_gguf(book.vocab_path)
    rules = answer_rules(Constraint.json_schema(ANSWER))
    assert rules is not None
    grammar = thought_first(rules, ReasoningReader(THINK, opened=opened), {})
    assert _walk(book, grammar, tokenizer.encode(text, add_special=False)) == expected


def test_a_closing_marker_the_vocabulary_holds_is_its_token_never_its_spelling(book: GrammarBook) -> None:
    tokenizer = Tokenizer.from_gguf(book.vocab_path)
    marker = 2  # a control token of the tiny vocabulary standing in for `</think>`
    rules = answer_rules(Constraint.json_object())
    assert rules is not None
    grammar = thought_first(rules, ReasoningReader(THINK, opened=True), {THINK.end: marker})
    thought, answer = tokenizer.encode("hm", add_special=False), tokenizer.encode('{"b":1}', add_special=False)
    assert _walk(book, grammar, [*thought, marker, *answer]) == "complete"
    assert _walk(book, grammar, [*thought, *tokenizer.encode("</think>", add_special=False), *answer]) == "open"


def test_only_json_and_the_package_s_own_grammars_take_a_thought_first() -> None:
    assert answer_rules(Constraint.regex("[a-z]+")) is None
    assert answer_rules(Constraint.gbnf('root ::= "a"')) is None
    assert answer_rules(Constraint.lark('start: "a"')) is None  # a client's grammar: its start is its own
    assert answer_rules(Constraint.lark('%llguidance {}\nstart: "a"\n'), generated=True) == 'answer: "a"\n'
    assert answer_rules(Constraint.json_schema(False)) is None
