"""tools/record_chat_templates.py: its message sets are requests the gateway accepts; a record keeps
each template's shared start once."""

from __future__ import annotations

from skippy_zmq.gateway.chat import parse_messages
from tools import record_chat_templates


def test_every_message_set_is_a_chat_request_ending_with_a_user_turn() -> None:
    for messages in record_chat_templates.MESSAGE_SETS.values():
        assert parse_messages(messages)[-1].role == "user"


def test_renders_keep_their_shared_start_once() -> None:
    renders = {"a": {"prompt": "preamble: one"}, "b": {"prompt": "preamble: two"}, "c": {"error": "400: no"}}
    record = record_chat_templates._shared_prefix(renders)
    assert record == {"prefix": "preamble: ", "renders": {"a": {"rest": "one"}, "b": {"rest": "two"},
                                                          "c": {"error": "400: no"}}}
