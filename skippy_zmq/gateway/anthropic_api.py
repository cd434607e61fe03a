"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as a translation
onto the chat route (docs/PROTOCOL.md §9.6, Anthropic Messages); socket-free.

`chat_body` turns a Messages request into the body of a chat request, which then goes through chat's
own validation (`CompletionParams.from_body`), so tools, stop strings, sampling, the prompt cache and
the pipeline are chat's. `message` turns the chat answer into a Message; `MessageStream` turns the
chat route's stream chunks, in order, into Anthropic's events. `error_body` is Anthropic's error
object for an `ApiError`.

What is Anthropic's own is checked here, naming Anthropic's fields: the block types, the roles that
may carry them, `max_tokens` (required on /v1/messages), `tool_choice`, `thinking` and `metadata`.
A field Anthropic does not define is a 400 naming it, as on the OpenAI routes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from skippy_zmq.gateway.openai_api import (
    MAX_STOP_STRINGS,
    ApiError,
    JsonObject,
    SseEvent,
    integer_field,
    list_field,
    object_field,
    shown_value,
    string_field,
)
from skippy_zmq.gateway.request_json import shown

MESSAGE_ID_PREFIX = "msg_"
PASSED_FIELDS = ("model", "temperature", "top_p", "top_k", "stream")
"""Fields a Messages request shares with a chat request: passed on as they are (chat checks them)."""
MESSAGE_FIELDS = frozenset({*PASSED_FIELDS, "messages", "system", "max_tokens", "stop_sequences", "tools",
                            "tool_choice", "metadata", "thinking", "service_tier"})
"""The fields /v1/messages accepts."""
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})
"""The fields /v1/messages/count_tokens accepts."""
NO_IMAGES = "image input is not supported: this server's models take text only"
_ERROR_TYPES: Mapping[int, str] = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                                   500: "api_error", 503: "overloaded_error", 504: "timeout_error"}
_STOP_REASONS: Mapping[str | None, str] = {"length": "max_tokens", "tool_calls": "tool_use"}


# --- the request --------------------------------------------------------------------------------


def chat_body(body: Any, *, count_only: bool = False) -> JsonObject:
    """The chat request a Messages request is (`count_only`: a count_tokens request, no max_tokens);
    ApiError 400 naming the Anthropic field at fault."""
    if not isinstance(body, dict):
        raise ApiError.invalid(None, "the request body must be a JSON object")
    route, accepted = ("/v1/messages/count_tokens", COUNT_FIELDS) if count_only else ("/v1/messages", MESSAGE_FIELDS)
    fields = {name: value for name, value in body.items() if value is not None}
    unknown = sorted(set(fields) - accepted)
    if unknown:
        name = unknown[0]
        raise ApiError.invalid(shown(name), f"unknown field {shown_value(name)}: {route} does not accept it")
    if "messages" not in fields:
        raise ApiError.invalid("messages", "messages is required")
    chat: JsonObject = {name: fields[name] for name in PASSED_FIELDS if name in fields}
    if not count_only:
        if "max_tokens" not in fields:
            raise ApiError.invalid("max_tokens", "max_tokens is required")
        chat["max_tokens"] = integer_field(1, 2**31 - 1)(fields["max_tokens"], "max_tokens")
    system = _system(fields["system"]) if "system" in fields else []
    chat["messages"] = system + _messages(fields["messages"])
    if "stop_sequences" in fields:
        chat["stop"] = _stop_sequences(fields["stop_sequences"])
    if "tools" in fields:
        chat["tools"] = _tools(fields["tools"])
    if "tool_choice" in fields:
        chat |= _tool_choice(fields["tool_choice"])
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # message_delta reports the usage
    _check_thinking(fields.get("thinking"))
    _check_metadata(fields.get("metadata"))
    if "service_tier" in fields:
        string_field(fields["service_tier"], "service_tier")  # one tier here: nothing to choose
    return chat


def _text_block(block: Any, name: str) -> str:
    """A text block's text (`cache_control` and `citations` change nothing here)."""
    block = object_field(block, name)
    if block.get("type") in ("image", "document"):
        raise ApiError.invalid(name, f"{name}: {NO_IMAGES}")
    if block.get("type") != "text":
        raise ApiError.invalid(f"{name}.type", f"{name}.type must be \"text\", got {shown_value(block.get('type'))}")
    return string_field(block.get("text"), f"{name}.text")


def _system(value: Any) -> list[JsonObject]:
    """`system`, a string or a list of text blocks, as the chat's first message (none when empty)."""
    if isinstance(value, str):
        return [{"role": "system", "content": value}] if value else []
    texts = [_text_block(block, f"system[{k}]") for k, block in enumerate(list_field(value, "system"))]
    return [{"role": "system", "content": [{"type": "text", "text": text} for text in texts]}] if texts else []


def _messages(value: Any) -> list[JsonObject]:
    """Anthropic's turns as chat messages: a user turn's tool results become tool messages (first, since
    Anthropic puts them first and chat wants them right after the calls), its text one user message."""
    turns = list_field(value, "messages")
    chat: list[JsonObject] = []
    for index, given in enumerate(turns):
        where = f"messages[{index}]"
        turn = object_field(given, where)
        extra = sorted(set(turn) - {"role", "content"})
        if extra:
            raise ApiError.invalid(f"{where}.{shown(extra[0])}", f"unknown field {where}.{shown(extra[0])}; a message "
                                   "has 'role' and 'content'")
        role = turn.get("role")
        if role not in ("user", "assistant"):
            raise ApiError.invalid(f"{where}.role", f"{where}.role must be \"user\" or \"assistant\", got "
                                   f"{shown_value(role)}")
        content = turn.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            continue
        blocks = list_field(content, f"{where}.content")
        chat += _user_turn(blocks, where) if role == "user" else [_assistant_turn(blocks, where)]
    # An empty conversation is a user who said nothing yet (llama-server's permissive default).
    return chat or [{"role": "user", "content": ""}]


def _block_type(block: Any, where: str) -> str:
    kind = object_field(block, where).get("type")
    if kind in ("image", "document"):
        raise ApiError.invalid(where, f"{where}: {NO_IMAGES}")
    return kind if isinstance(kind, str) else ""


def _user_turn(blocks: list[Any], where: str) -> list[JsonObject]:
    results: list[JsonObject] = []
    texts: list[JsonObject] = []
    for k, block in enumerate(blocks):
        at = f"{where}.content[{k}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append({"type": "text", "text": _text_block(block, at)})
        elif kind == "tool_result":
            results.append(_tool_result(block, at))
        else:
            raise ApiError.invalid(f"{at}.type", f"{at}.type must be \"text\" or \"tool_result\" in a user message, "
                                   f"got {shown_value(kind)}")
    return results + ([{"role": "user", "content": texts}] if texts or not results else [])


def _tool_result(block: dict[str, Any], at: str) -> JsonObject:
    call_id = string_field(block.get("tool_use_id"), f"{at}.tool_use_id")
    if "is_error" in block and block["is_error"] is not None and not isinstance(block["is_error"], bool):
        raise ApiError.invalid(f"{at}.is_error", f"{at}.is_error must be true or false")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_block(part, f"{at}.content[{j}]") for j, part in enumerate(content))
    elif content is None:
        content = ""
    string_field(content, f"{at}.content")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant_turn(blocks: list[Any], where: str) -> JsonObject:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[JsonObject] = []
    for k, block in enumerate(blocks):
        at = f"{where}.content[{k}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "thinking":
            thinking.append(string_field(block.get("thinking"), f"{at}.thinking"))
        elif kind == "redacted_thinking":
            continue  # encrypted by another server: nothing here can read it
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
        else:
            raise ApiError.invalid(f"{at}.type", f"{at}.type must be \"text\", \"thinking\" or \"tool_use\" in an "
                                   f"assistant message, got {shown_value(kind)}")
    message: JsonObject = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:  # only then: the chat route reads reasoning_content where the template shows it
        message["reasoning_content"] = "".join(thinking)
    return message


def _tool_use(block: dict[str, Any], at: str) -> JsonObject:
    call_id = string_field(block.get("id"), f"{at}.id")
    name = string_field(block.get("name"), f"{at}.name")
    arguments = object_field(block.get("input", {}), f"{at}.input")
    return {"id": call_id, "type": "function", "function": {
        "name": name, "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))}}


def _stop_sequences(value: Any) -> list[str]:
    stops = list_field(value, "stop_sequences")
    for k, stop in enumerate(stops):
        string_field(stop, f"stop_sequences[{k}]")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError.invalid("stop_sequences", f"stop_sequences has {len(stops)} strings; at most "
                               f"{MAX_STOP_STRINGS} are accepted")
    return stops


def _tools(value: Any) -> list[JsonObject]:
    """Client tools as chat's functions; Anthropic's server tools (web search, code execution) are not run here."""
    tools = []
    for k, given in enumerate(list_field(value, "tools")):
        at = f"tools[{k}]"
        tool = object_field(given, at)
        if tool.get("type", "custom") != "custom":
            raise ApiError.invalid(f"{at}.type", f"{at}.type {shown_value(tool.get('type'))} is a server tool, which "
                                   "this server does not run; only client tools (with input_schema) are accepted")
        extra = sorted(set(tool) - {"type", "name", "description", "input_schema", "cache_control"})
        if extra:
            raise ApiError.invalid(f"{at}.{shown(extra[0])}", f"unknown field {at}.{shown(extra[0])}")
        if "input_schema" not in tool:
            raise ApiError.invalid(f"{at}.input_schema", f"{at}.input_schema is required")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> JsonObject:
    """`tool_choice` (auto, any, tool with its name, none) and `disable_parallel_tool_use` in chat's fields."""
    choice = object_field(value, "tool_choice")
    kind = choice.get("type")
    allowed = {"auto": {"disable_parallel_tool_use"}, "any": {"disable_parallel_tool_use"},
               "tool": {"name", "disable_parallel_tool_use"}, "none": set()}
    if kind not in allowed:
        raise ApiError.invalid("tool_choice.type", "tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\", "
                               f"got {shown_value(kind)}")
    extra = sorted(set(choice) - allowed[kind] - {"type"})
    if extra:
        raise ApiError.invalid(f"tool_choice.{shown(extra[0])}", f"unknown field tool_choice.{shown(extra[0])} "
                               f"of a tool_choice {kind!r}")
    fields: JsonObject = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind)}
    if kind == "tool":
        fields["tool_choice"] = {"type": "function",
                                 "function": {"name": string_field(choice.get("name"), "tool_choice.name")}}
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise ApiError.invalid("tool_choice.disable_parallel_tool_use",
                                   "tool_choice.disable_parallel_tool_use must be true or false")
        fields["parallel_tool_calls"] = not parallel
    return fields


def _check_thinking(value: Any) -> None:
    """`thinking` is checked and not acted on: a model that thinks does so as its template says, and its
    thoughts come back as thinking blocks; no budget is enforced (docs/PROTOCOL.md §9.6)."""
    if value is None:
        return
    kind = object_field(value, "thinking").get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ApiError.invalid("thinking.type", "thinking.type must be \"enabled\", \"disabled\" or \"adaptive\", "
                               f"got {shown_value(kind)}")
    if kind == "enabled":
        integer_field(1, 2**31 - 1)(value.get("budget_tokens"), "thinking.budget_tokens")


def _check_metadata(value: Any) -> None:
    if value is None:
        return
    user = object_field(value, "metadata").get("user_id")
    if user is not None:
        string_field(user, "metadata.user_id")


# --- the answer ---------------------------------------------------------------------------------


def error_body(error: ApiError) -> JsonObject:
    """Anthropic's error object for `error` (its status stays the HTTP status)."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def stop_reason(finish_reason: str | None, stop_sequence: str) -> str:
    """Anthropic's stop_reason for a chat choice's finish_reason and the stop string that ended it ("" if none)."""
    if finish_reason == "stop" and stop_sequence:
        return "stop_sequence"
    return _STOP_REASONS.get(finish_reason, "end_turn")


def usage(chat_usage: Mapping[str, Any] | None) -> JsonObject:
    """Anthropic's usage for chat's: input tokens not held by the prompt cache, the cached ones, output tokens."""
    chat_usage = chat_usage or {}
    prompt = int(chat_usage.get("prompt_tokens", 0))
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": int(chat_usage.get("completion_tokens", 0))}


def message_id(chat_id: str) -> str:
    """The Message id of a chat answer's id (the same random part)."""
    return MESSAGE_ID_PREFIX + chat_id.rpartition("-")[2]


def _tool_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}  # a call cut short: Anthropic's input is an object whatever happened
    return value if isinstance(value, dict) else {}


def message(answer: Mapping[str, Any], *, stop_sequence: str = "") -> JsonObject:
    """The Message a whole chat answer (one choice) is; `stop_sequence` the stop string that ended it."""
    choice = answer["choices"][0]
    said = choice["message"]
    content: list[JsonObject] = []
    if said.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": said["reasoning_content"], "signature": ""})
    if said.get("content") or (not content and not said.get("tool_calls")):  # an empty text rather than no block
        content.append({"type": "text", "text": said.get("content") or ""})
    for call in said.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _tool_input(call["function"]["arguments"])})
    return {"id": message_id(answer["id"]), "type": "message", "role": "assistant", "content": content,
            "model": answer["model"], "stop_reason": stop_reason(choice["finish_reason"], stop_sequence),
            "stop_sequence": stop_sequence or None, "usage": usage(answer.get("usage"))}


class MessageStream:
    """Anthropic's stream events from the chat route's chunks, fed in order (one choice): message_start, each
    content block's start, deltas and stop (blocks numbered from 0 in the order they open: thinking, text,
    tool_use), message_delta with the stop reason and usage, message_stop."""

    def __init__(self, chat_id: str, model: str, input_tokens: int) -> None:
        """A stream for the chat answer `chat_id` whose prompt has `input_tokens` tokens."""
        self.id = message_id(chat_id)
        self.model = model
        self.input_tokens = input_tokens
        # the open block: its key (its kind, and for a tool call the call's index) and its index
        self._open: tuple[tuple[str, int], int] | None = None
        self._blocks = 0
        self._finish_reason: str | None = None
        self._usage: Mapping[str, Any] | None = None

    def start(self) -> list[SseEvent]:
        """The events before any text: message_start."""
        usage = {"input_tokens": self.input_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                 "output_tokens": 0}
        return [("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None, "usage": usage}})]

    def feed(self, chunk: Mapping[str, Any]) -> list[SseEvent]:
        """The events of one chat chunk (its usage, when it carries one, is kept for message_delta)."""
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events: list[SseEvent] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                thought = delta["reasoning_content"]
                events += self._delta(("thinking", 0), {"type": "thinking_delta", "thinking": thought})
            if delta.get("content"):
                events += self._delta(("text", 0), {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
        return events

    def _call(self, call: Mapping[str, Any]) -> list[SseEvent]:
        function = call.get("function") or {}
        events: list[SseEvent] = []
        key = ("tool", int(call.get("index", 0)))
        if "id" in call:  # a call's first delta: its id and name
            block = {"type": "tool_use", "id": call["id"], "name": function.get("name", ""), "input": {}}
            events += self._open_block(key, block)
        if function.get("arguments"):
            events += self._delta(key, {"type": "input_json_delta", "partial_json": function["arguments"]})
        return events

    def _delta(self, key: tuple[str, int], delta: JsonObject) -> list[SseEvent]:
        events: list[SseEvent] = []
        if self._open is None or self._open[0] != key:
            if key[0] == "tool":
                return []  # a call's arguments after another block began: cannot happen in chat's order
            events = self._open_block(key, {"type": key[0], key[0]: ""})
        assert self._open is not None
        return [*events, ("content_block_delta", {"type": "content_block_delta", "index": self._open[1],
                                                  "delta": delta})]

    def _open_block(self, key: tuple[str, int], block: JsonObject) -> list[SseEvent]:
        events = self._close()
        self._open = (key, self._blocks)
        self._blocks += 1
        return [*events, ("content_block_start", {"type": "content_block_start", "index": self._open[1],
                                                  "content_block": block})]

    def _close(self) -> list[SseEvent]:
        if self._open is None:
            return []
        (kind, _), index = self._open
        self._open = None
        events: list[SseEvent] = []
        if kind == "thinking":  # Anthropic's clients expect a signature before a thinking block ends
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "signature_delta", "signature": ""}}))
        return [*events, ("content_block_stop", {"type": "content_block_stop", "index": index})]

    def finish(self, stop_sequence: str = "") -> list[SseEvent]:
        """The last events: the open block's stop (an empty text block when nothing was said), message_delta
        with the stop reason and usage, message_stop."""
        events = self._open_block(("text", 0), {"type": "text", "text": ""}) if not self._blocks else []
        events += self._close()
        usage_now = usage(self._usage) if self._usage else {"output_tokens": 0}
        events.append(("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": stop_reason(self._finish_reason, stop_sequence), "stop_sequence": stop_sequence or None},
            "usage": usage_now}))
        return [*events, ("message_stop", {"type": "message_stop"})]

    def failed(self, error: ApiError) -> list[SseEvent]:
        """The event of a failure after the stream began: Anthropic's error event."""
        return [("error", error_body(error))]
