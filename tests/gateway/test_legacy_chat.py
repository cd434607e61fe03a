"""skippy_zmq.gateway.legacy_chat: llama.cpp's C++ chat formats (serve --no-jinja, built-in names), with
contents kept plain text as in the Jinja path."""

from __future__ import annotations

import pytest

from skippy_zmq.errors import ChatTemplateError, ConfigError
from skippy_zmq.gateway.legacy_chat import LegacyTemplate, builtin_names
from skippy_zmq.gateway.options import ServeOptions, uses_legacy_chat
from skippy_zmq.gateway.tool_calls import Tools
from tests.gateway.test_reasoning import _tokenizer

TOK = _tokenizer()
TURNS = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]


def test_a_built_in_name_renders_llama_cpp_s_format() -> None:
    assert {"chatml", "llama3", "command-r"} <= set(builtin_names())
    command_r = LegacyTemplate("command-r", TOK, origin="--chat-template")
    assert command_r.render_text(TURNS) == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
        "<|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    chatml = LegacyTemplate("chatml", TOK, origin="--chat-template")
    assert chatml.render_text(TURNS[1:], add_generation_prompt=False) == "<|im_start|>user\nHi there<|im_end|>\n"
    continued = [*TURNS[1:], {"role": "assistant", "content": "Wh"}]
    assert chatml.render_text(continued, continue_final=True).endswith("<|im_start|>assistant\nWh")


def test_llama_cpp_recognises_a_format_in_a_template_s_text() -> None:
    text = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert LegacyTemplate(text, TOK, origin="t").render_text(TURNS[1:]).startswith("<|im_start|>user\nHi there")


def test_contents_stay_plain_text_and_the_format_s_markers_are_tokens() -> None:
    chatml = LegacyTemplate("chatml", TOK, origin="--chat-template")
    plain = chatml.render([{"role": "user", "content": "<eos>"}])
    eos = TOK.eos_id
    assert eos is not None and eos not in plain.ids  # the user's text is not the control token
    assert TOK.decode(list(plain.ids)).count("<eos>") == 1


def test_tools_are_told_in_a_system_message_as_the_generic_format() -> None:
    tools = Tools.from_request([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    text = LegacyTemplate("chatml", TOK, origin="x").render_text(TURNS[1:], tools=tools)
    assert text.startswith("<|im_start|>system\nYou may call the tools") and '"name": "f"' in text


def test_an_unknown_format_is_named_with_the_known_ones() -> None:
    with pytest.raises(ChatTemplateError, match=r"--chat-template: llama.cpp has no chat format .lama3.; its built-in "
                       r"names are .*llama3"):
        LegacyTemplate("lama3", TOK, origin="--chat-template")
    with pytest.raises(ConfigError, match="neither Jinja text nor the name"):
        ServeOptions(chat_template="not a name at all")
    assert uses_legacy_chat(ServeOptions(chat_template="llama3"), ("llama3", "--chat-template"))
    assert uses_legacy_chat(ServeOptions(jinja=False), None)
    assert not uses_legacy_chat(ServeOptions(), ("{{ x }}", "--chat-template"))
