"""skippy_zmq.gateway.tool_formats: each format read whole and streamed (split-equals-whole), the
grammars checked with llguidance on llama.cpp's vocabularies, and chat templates rendering a tool loop as
llama-server did (tests/data/llama_cpp/tool_templates.json: llama-server's /apply-template answers for
these messages and tools, recorded with llama-cpp-python 0.3.36's build and a tiny random model)."""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.gateway.chat import ChatTemplate
from skippy_zmq.gateway.tool_calls import ToolCall, Tools
from skippy_zmq.gateway.tool_formats import (
    FORMATS,
    ToolCallStream,
    ToolFormat,
    assemble,
    call_ids,
    detect_format,
    parse_tool_calls,
    tool_grammar,
)
from skippy_zmq.testing.llama_sources import template_files, vocab_cases
from skippy_zmq.testing.tiny import tiny_vocab, vocab_tokenizer

TOOLS = Tools.from_request([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop"}},
])
ARGS = {"city": 'Paris "<tool_call>" {x} é 😀\n', "days": 3}
COMPACT = json.dumps(ARGS, ensure_ascii=False, separators=(",", ":"))


def _obj(args_key: str, name: str = "get_weather", args: Any = None) -> str:
    return json.dumps({"name": name, args_key: ARGS if args is None else args}, ensure_ascii=False)


# (format, text, content, [(name, arguments)]) for answers that hold calls
GOOD = [
    (ToolFormat.HERMES, f"<tool_call>\n{_obj('arguments')}\n</tool_call>", "", [("get_weather", COMPACT)]),
    (ToolFormat.HERMES, f"Let me look.\n<tool_call>\n{_obj('arguments')}\n</tool_call>\n<tool_call>\n"
                        f"{_obj('arguments', 'noop', {})}\n</tool_call>", "Let me look.\n\n",
     [("get_weather", COMPACT), ("noop", "{}")]),
    (ToolFormat.HERMES, f"<tool_call>\n{_obj('arguments')}", "", [("get_weather", COMPACT)]),  # no closing tag
    (ToolFormat.LLAMA3_JSON, _obj("parameters"), "", [("get_weather", COMPACT)]),
    (ToolFormat.LLAMA3_JSON, f"<|python_tag|>{_obj('parameters')}", "", [("get_weather", COMPACT)]),
    (ToolFormat.MISTRAL, f"Sure. [TOOL_CALLS][{_obj('arguments')}, {_obj('arguments', 'noop', {})}]", "Sure. ",
     [("get_weather", COMPACT), ("noop", "{}")]),
    (ToolFormat.MISTRAL_ARGS, f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(ARGS)}[TOOL_CALLS]noop[CALL_ID]a1b2c3d4e"
                              "[ARGS]{}", "", [("get_weather", COMPACT), ("noop", "{}")]),
    (ToolFormat.GENERIC, json.dumps({"tool_calls": [json.loads(_obj("arguments"))]}), "", [("get_weather", COMPACT)]),
    (ToolFormat.GENERIC, json.dumps({"tool_call": json.loads(_obj("arguments"))}), "", [("get_weather", COMPACT)]),
    (ToolFormat.GENERIC, json.dumps({"response": "It is <b>sunny</b> \"out\""}), 'It is <b>sunny</b> "out"', []),
]
# Broken before any piece of a call went out: the stream agrees with the whole answer.
BAD = [
    (ToolFormat.HERMES, "<tool_call>\n{\"name\" \"get_weather\"}\n</tool_call>"),
    (ToolFormat.HERMES, f"Text <tool_call>\n{_obj('arguments', 'rm_rf')}\n</tool_call>"),
    (ToolFormat.LLAMA3_JSON, '{"answer": 4}'),
    (ToolFormat.MISTRAL, "[TOOL_CALLS]{}"),
    (ToolFormat.MISTRAL, f"[TOOL_CALLS][{_obj('arguments', 'unknown')}]"),
    (ToolFormat.MISTRAL_ARGS, "[TOOL_CALLS]get_weather{\"city\": 1}"),
    (ToolFormat.GENERIC, '{"something": "else"}'),
]
# Broken after a call's first pieces went out (possible without a grammar only): whole, all content.
BAD_LATE = [
    (ToolFormat.HERMES, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }}\n</tool_call>"),
    (ToolFormat.HERMES, f"<tool_call>\n{_obj('arguments')}\n</tool_call>\n<tool_call>\n{{\"name\": \"noop\""),
    (ToolFormat.HERMES, f"<tool_call>\n{_obj('arguments')} trailing\n</tool_call>"),
    (ToolFormat.LLAMA3_JSON, _obj("parameters")[:-3]),
]
PLAIN = [
    (ToolFormat.HERMES, "No call here, just <tool a tag."),
    (ToolFormat.LLAMA3_JSON, "  The answer is {4}."),
    (ToolFormat.GENERIC, "Not JSON at all"),
]


def _ids(fmt: ToolFormat) -> Any:
    return call_ids(fmt, seed=7)


def _streamed(fmt: ToolFormat, pieces: list[str], tools: Tools = TOOLS) -> tuple[Any, list[dict[str, Any]]]:
    stream = ToolCallStream(fmt, tools, ids=_ids(fmt))
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    return assemble(deltas), deltas


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), GOOD)
def test_a_whole_answer_splits_into_content_and_calls(fmt: ToolFormat, text: str, content: str,
                                                      calls: list[tuple[str, str]]) -> None:
    answer = parse_tool_calls(fmt, text, TOOLS, ids=_ids(fmt))
    assert answer.content == content
    assert [(c.name, c.arguments) for c in answer.calls] == calls
    ids = _ids(fmt)
    assert [c.id for c in answer.calls] == [ids.next() for _ in calls]
    assert all(len(c.id) == (9 if fmt in (ToolFormat.MISTRAL, ToolFormat.MISTRAL_ARGS) else 29) for c in answer.calls)


@pytest.mark.parametrize(("fmt", "text"), BAD_LATE)
def test_a_late_break_is_content_whole_and_the_rest_of_the_text_streamed(fmt: ToolFormat, text: str) -> None:
    assert parse_tool_calls(fmt, text, TOOLS) == parse_tool_calls(fmt, text, TOOLS)
    assert parse_tool_calls(fmt, text, TOOLS).content == text
    assembled, _ = _streamed(fmt, list(text))
    assert assembled.calls and text.endswith(assembled.content)


@pytest.mark.parametrize(("fmt", "text"), BAD + PLAIN)
def test_an_answer_with_a_broken_call_is_all_content(fmt: ToolFormat, text: str) -> None:
    assert parse_tool_calls(fmt, text, TOOLS).calls == ()
    assert parse_tool_calls(fmt, text, TOOLS).content == text
    assert _streamed(fmt, list(text))[0].content == text  # one character at a time: nothing went out as a call


def test_tool_choice_none_reads_no_calls() -> None:
    text = GOOD[0][1]
    none = Tools(TOOLS.specs, "none")
    assert parse_tool_calls(ToolFormat.HERMES, text, none).content == text
    assert _streamed(ToolFormat.HERMES, [text], none)[0].content == text


def test_the_stream_sends_text_at_once_and_holds_back_a_possible_marker() -> None:
    stream = ToolCallStream(ToolFormat.HERMES, TOOLS, ids=_ids(ToolFormat.HERMES))
    assert stream.feed("Hello <tool") == [{"content": "Hello "}]
    assert stream.feed("_call>\n{\"name\": \"get_") == []
    header = stream.feed("weather\", \"arguments\": {\"ci")
    assert header[0] == {"tool_calls": [{"index": 0, "id": _ids(ToolFormat.HERMES).next(), "type": "function",
                                         "function": {"name": "get_weather", "arguments": ""}}]}
    assert header[1] == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    assert stream.feed('ty": "Par') == [{"tool_calls": [{"index": 0, "function": {"arguments": '"city":"Par'}}]}]
    assert stream.feed('is"}}\n</tool_call>') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'is"}'}}]}]
    assert stream.finish() == []
    assert stream.calls == (ToolCall(_ids(ToolFormat.HERMES).next(), "get_weather", '{"city":"Paris"}'),)


def test_a_call_cut_off_by_the_end_comes_back_as_content() -> None:
    stream = ToolCallStream(ToolFormat.HERMES, TOOLS)
    assert stream.feed("A <tool_call>\n{\"name\": ") == [{"content": "A "}]
    assert stream.finish() == [{"content": "<tool_call>\n{\"name\": "}]


def test_a_call_that_breaks_after_its_first_pieces_sends_the_rest_as_content() -> None:
    stream = ToolCallStream(ToolFormat.HERMES, TOOLS)
    sent = stream.feed('<tool_call>\n{"name": "noop", "arguments": {')
    assert sent[0]["tool_calls"][0]["function"]["name"] == "noop"
    assert stream.feed("]") == [{"content": '<tool_call>\n{"name": "noop", "arguments": {]'}]
    assert stream.feed(" more") == [{"content": " more"}]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(GOOD + BAD + PLAIN), st.data())
def test_any_split_of_an_answer_streams_to_the_whole_answer(case: tuple[Any, ...], data: st.DataObject) -> None:
    fmt, text = case[0], case[1]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assembled, deltas = _streamed(fmt, pieces)
    assert assembled == parse_tool_calls(fmt, text, TOOLS, ids=_ids(fmt))
    indices = [item["index"] for d in deltas for item in d.get("tool_calls", ()) if "id" in item]
    assert indices == list(range(len(indices)))


# --- grammars ----------------------------------------------------------------------------------------

llguidance = pytest.importorskip("llguidance")


@functools.cache
def _tokenizer(vocab: str) -> Any:
    """llama.cpp's vocabulary `vocab` and llguidance's tokenizer of it, as a final stage builds it."""
    from skippy_zmq.tokens.grammar import GrammarBook
    from skippy_zmq.tokens.llama_vocab import LlamaVocab

    path = next(case.path for case in vocab_cases() if case.name == vocab)
    return LlamaVocab.load(path), GrammarBook(path, ()).tokenizer()


def _accepts(vocab: Any, tokenizer: Any, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    ok = matcher.consume_tokens(vocab.tokenize(text.encode(), parse_special=False))
    return bool(ok) and not matcher.is_error() and matcher.is_accepting()


ONE_CALL = {
    ToolFormat.HERMES: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ToolFormat.LLAMA3_JSON: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ToolFormat.MISTRAL: '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    ToolFormat.MISTRAL_ARGS: '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    ToolFormat.GENERIC: '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
}
REFUSED = {
    ToolFormat.HERMES: '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>',
    ToolFormat.LLAMA3_JSON: '{"name": "get_weather", "parameters": {"town": "Paris"}}',
    ToolFormat.MISTRAL: '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": 3}}]',
    ToolFormat.MISTRAL_ARGS: '[TOOL_CALLS]get_weather[ARGS]{"city":  "Paris"}',
    ToolFormat.GENERIC: '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}], "x": 1}',
}


@pytest.mark.parametrize("vocab", ["qwen2", "llama-bpe"])
@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_each_grammar_takes_a_valid_call_and_refuses_a_wrong_one(fmt: ToolFormat, vocab: str) -> None:
    loaded, tokenizer = _tokenizer(vocab)
    for choice in ("required", "get_weather", "auto"):
        grammar = tool_grammar(fmt, Tools(TOOLS.specs, choice))
        assert grammar is not None
        assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar), tokenizer) == ""
        assert _accepts(loaded, tokenizer, grammar, ONE_CALL[fmt]), (choice, grammar)
        assert not _accepts(loaded, tokenizer, grammar, REFUSED[fmt]), (choice, grammar)
    assert tool_grammar(fmt, Tools(TOOLS.specs, "none")) is None


@pytest.mark.parametrize("fmt", [ToolFormat.HERMES, ToolFormat.MISTRAL, ToolFormat.MISTRAL_ARGS])
def test_auto_lets_free_text_run_until_the_marker(fmt: ToolFormat) -> None:
    loaded, tokenizer = _tokenizer("qwen2")
    auto, required = tool_grammar(fmt, TOOLS), tool_grammar(fmt, Tools(TOOLS.specs, "required"))
    assert auto is not None and required is not None
    assert _accepts(loaded, tokenizer, auto, "Just an answer, no call.")
    assert _accepts(loaded, tokenizer, auto, "Let me check. " + ONE_CALL[fmt])
    assert not _accepts(loaded, tokenizer, required, "Just an answer, no call.")


def test_llama3_auto_takes_text_or_a_call_and_json_whitespace_is_bounded() -> None:
    loaded, tokenizer = _tokenizer("llama-bpe")
    auto = tool_grammar(ToolFormat.LLAMA3_JSON, TOOLS)
    assert auto is not None
    assert _accepts(loaded, tokenizer, auto, "It is sunny.")
    assert not _accepts(loaded, tokenizer, auto, '{"name":     "get_weather", "parameters": {"city": "Paris"}}')


def test_single_call_grammars_refuse_a_second_call() -> None:
    loaded, tokenizer = _tokenizer("qwen2")
    single = Tools(TOOLS.specs, "required", parallel=False)
    two = ONE_CALL[ToolFormat.HERMES] + "\n" + ONE_CALL[ToolFormat.HERMES]
    assert not _accepts(loaded, tokenizer, tool_grammar(ToolFormat.HERMES, single) or "", two)
    assert _accepts(loaded, tokenizer, tool_grammar(ToolFormat.HERMES, Tools(TOOLS.specs, "required")) or "", two)


def test_special_token_markers_are_written_as_tokens() -> None:
    grammar = tool_grammar(ToolFormat.HERMES, TOOLS, special_tokens={"<tool_call>": 151657, "</tool_call>": 151658})
    assert grammar is not None and "TEXT <[151657]> body" in grammar and '"<tool_call>"' not in grammar
    assert "<[151658]>" in grammar


# --- chat templates -----------------------------------------------------------------------------------

RECORD = json.loads((Path(__file__).parents[1] / "data" / "llama_cpp" / "tool_templates.json").read_text())


def _tiny() -> Any:
    vocab = tiny_vocab()
    ids = {token: i for i, token in enumerate(vocab[0])}
    return vocab_tokenizer(vocab[0], vocab[1], vocab[2], bos_id=ids["<bos>"], eos_id=ids["<eos>"],
                           unk_id=ids["<unk>"], pad_id=ids["<pad>"], add_bos=True)


EXPECTED_FORMAT = {"Qwen": ToolFormat.HERMES, "NousResearch": ToolFormat.HERMES, "meta-llama": ToolFormat.LLAMA3_JSON,
                   "mistralai-Mistral-Nemo": ToolFormat.MISTRAL, "Mistral-Small-3.2": ToolFormat.MISTRAL_ARGS,
                   "unsloth-mistral-Devstral": ToolFormat.MISTRAL_ARGS}


@pytest.mark.parametrize("name", sorted(RECORD["renders"]))
def test_a_tool_loop_renders_as_llama_server_rendered_it(name: str) -> None:
    source = next(path for path in template_files() if path.stem == name).read_text()
    template = ChatTemplate.from_source(source, _tiny(), origin=name)
    now = datetime.datetime.combine(datetime.date.fromisoformat(RECORD["date"]), datetime.time(12))
    tools = Tools.from_request(RECORD["tools"])
    text = template.render_text(RECORD["messages"], tools=tools, now=now)
    assert text == RECORD["renders"][name]
    assert "22 C sunny" in text and "Weather of a city" in text and "get_weather" in text
    assert template.tool_format is next(f for prefix, f in EXPECTED_FORMAT.items() if name.startswith(prefix))


def test_formats_are_detected_from_the_template_source() -> None:
    assert detect_format(None) is ToolFormat.GENERIC
    assert detect_format("{{ '<tool_call>' }}") is ToolFormat.HERMES
    assert detect_format("<tool_call>\n<function=x>") is ToolFormat.GENERIC  # Qwen3-Coder's XML calls
    assert detect_format("<|start_header_id|>ipython<|end_header_id|>") is ToolFormat.LLAMA3_JSON
    assert detect_format("[TOOL_CALLS] [ARGS]") is ToolFormat.MISTRAL_ARGS
    assert list(FORMATS)[-1] is ToolFormat.GENERIC


def test_a_template_without_tools_gets_the_generic_prompt_and_calls_as_json() -> None:
    template = ChatTemplate.from_source(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}", _tiny(), origin="plain")
    assert template.tool_format is ToolFormat.GENERIC
    text = template.render_text(RECORD["messages"], tools=Tools.from_request(RECORD["tools"]))
    assert text.startswith("<system>You are helpful.\n\nYou may call the tools")
    assert '"tool_calls": [\n    {\n      "name": "get_weather",\n      "arguments": {\n        "city": "Paris"' in text
    assert '<user>{\n  "tool_response": {\n    "tool": "get_weather",\n    "content": "22 C sunny"' in text
    assert "You may call" not in template.render_text(RECORD["messages"], tools=Tools(Tools.from_request(
        RECORD["tools"]).specs, "none"))


def test_special_text_in_arguments_tools_and_results_stays_text() -> None:
    from skippy_zmq.tokens.tokenizer import Tokenizer

    path = next(case.path for case in vocab_cases() if case.name == "llama-bpe")
    tokenizer = Tokenizer.from_gguf(path)
    source = next(p for p in template_files() if p.stem == "meta-llama-Llama-3.1-8B-Instruct").read_text()
    template = ChatTemplate.from_source(source, tokenizer, origin="llama3.1")
    eot = "<|eot_id|>"
    eot_id = tokenizer.encode(eot, parse_special=True)[-1]
    messages = json.loads(json.dumps(RECORD["messages"]).replace("Paris", eot).replace("22 C sunny", eot))
    tools = json.loads(json.dumps(RECORD["tools"]).replace("Weather of a city", eot))
    plain = template.render(RECORD["messages"], tools=Tools.from_request(RECORD["tools"]))
    typed = template.render(messages, tools=Tools.from_request(tools))
    assert typed.text.count(eot) == plain.text.count(eot) + 4  # the question, the arguments, the result, the tool
    assert typed.ids.count(eot_id) == plain.ids.count(eot_id)
