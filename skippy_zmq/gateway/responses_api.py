"""OpenAI's Responses API (`POST /v1/responses`, `POST /v1/responses/input_tokens`) as a translation onto
the chat route (docs/PROTOCOL.md §9.6, OpenAI Responses); socket-free.

`ResponsesRequest.from_body` turns a Responses request into the body of a chat request, which then goes
through chat's own validation (`CompletionParams.from_body`), and keeps what the Response object echoes.
`response` turns the chat answer into a Response; `ResponseStream` turns the chat route's stream chunks,
in order, into the Responses events (`response.created` ... `response.completed`).

Nothing is stored: `previous_response_id`, `conversation` and item references are a 400, and every
request carries its whole conversation in `input`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from skippy_zmq.gateway.openai_api import (
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

PASSED_FIELDS = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "metadata", "store", "user",
                 "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier",
                 # llama-server's extensions, as its Responses route passes them to chat
                 "top_k", "min_p", "seed", "stop", "repeat_penalty", "presence_penalty", "frequency_penalty",
                 "logit_bias", "cache_prompt", "ignore_eos", "timings_per_token", "return_progress")
"""Fields a Responses request shares with a chat request: passed on as they are (chat checks them)."""
OWN_FIELDS = frozenset({"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning",
                        "include", "truncation", "background", "stream_options", "top_logprobs",
                        "previous_response_id", "conversation", "max_tool_calls", "prompt"})
"""The Responses fields translated or checked here."""
NO_IMAGES = "image input is not supported: this server's models take text only"
_ROLES = ("user", "system", "developer", "assistant")
_NEUTRAL: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "background": (lambda v: v is False, "false"),
    "truncation": (lambda v: v == "disabled", '"disabled" (a prompt too long is a 400)'),
    "top_logprobs": (lambda v: v == 0, "0"),
    "previous_response_id": (lambda _: False, "null: this server stores no responses; send the whole conversation"),
    "conversation": (lambda _: False, "null: this server stores no conversations; send the whole conversation"),
    "prompt": (lambda _: False, "null: this server has no stored prompts"),
    "max_tool_calls": (lambda _: False, "null"),
}
"""Fields accepted at their neutral value only: ignoring another would change what the client gets."""


def new_id(prefix: str) -> str:
    """A fresh id with OpenAI's prefix (`resp_`, `msg_`, `rs_`)."""
    return prefix + secrets.token_hex(12)


@attrs.frozen
class ResponsesRequest:
    """A Responses request as a chat request (`chat`), and the fields its Response echoes (`echo`)."""

    chat: JsonObject
    echo: JsonObject

    @classmethod
    def from_body(cls, body: Any) -> ResponsesRequest:
        """Translate a request body (parsed JSON); ApiError 400 naming the Responses field at fault."""
        if not isinstance(body, dict):
            raise ApiError.invalid(None, "the request body must be a JSON object")
        fields = {name: value for name, value in body.items() if value is not None}
        unknown = sorted(set(fields) - OWN_FIELDS - set(PASSED_FIELDS))
        if unknown:
            name = unknown[0]
            raise ApiError.invalid(shown(name), f"unknown field {shown_value(name)}: /v1/responses does not accept it")
        for name, (accepts, neutral) in _NEUTRAL.items():
            if name in fields and not accepts(fields[name]):
                raise ApiError.invalid(name, f"{name} {shown_value(fields[name])} is not supported; only {neutral} "
                                       "is accepted")
        if "input" not in fields:
            raise ApiError.invalid("input", "input is required")
        chat: JsonObject = {name: fields[name] for name in PASSED_FIELDS if name in fields}
        instructions = string_field(fields["instructions"], "instructions") if "instructions" in fields else ""
        chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + \
            input_messages(fields["input"])
        if not chat["messages"]:
            raise ApiError.invalid("input", "input holds no items; give at least one message")
        if "max_output_tokens" in fields:
            chat["max_tokens"] = integer_field(1, 2**31 - 1)(fields["max_output_tokens"], "max_output_tokens")
        if "tools" in fields:
            chat["tools"] = _tools(fields["tools"])
        if "tool_choice" in fields:
            chat["tool_choice"] = _tool_choice(fields["tool_choice"])
        if "text" in fields:
            chat |= _text(fields["text"])
        if chat.get("stream"):
            chat["stream_options"] = {"include_usage": True}  # response.completed reports the usage
        _check_ignored(fields)
        echo = {"instructions": instructions or None, "max_output_tokens": fields.get("max_output_tokens"),
                "temperature": fields.get("temperature"), "top_p": fields.get("top_p"),
                "tools": fields.get("tools", []), "tool_choice": fields.get("tool_choice", "auto"),
                "parallel_tool_calls": fields.get("parallel_tool_calls", True), "metadata": fields.get("metadata", {}),
                "text": fields.get("text", {"format": {"type": "text"}}), "store": False}
        return cls(chat, echo)


def input_messages(value: Any) -> list[JsonObject]:
    """`input`, a string or a list of items, as chat messages: an assistant's reasoning, message and function
    calls that follow one another make one assistant message, as chat has them (after a call, an assistant
    item starts the next one)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[JsonObject] = []
    for index, given in enumerate(list_field(value, "input")):
        where = f"input[{index}]"
        item = object_field(given, where)
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            _assistant(messages)["content"] += _texts(item.get("content"), where, "output_text")
        elif kind == "message":
            messages.append(_input_message(item, where))
        elif kind == "function_call":
            _assistant(messages).setdefault("tool_calls", []).append(_function_call(item, where))
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": string_field(item.get("call_id"), f"{where}.call_id"),
                             "content": _texts(item.get("output"), f"{where}.output", "input_text")})
        elif kind == "reasoning":
            _reasoning(_assistant(messages), item, where)
        else:
            raise ApiError.invalid(f"{where}.type", f"{where}.type must be \"message\", \"function_call\", "
                                   f"\"function_call_output\" or \"reasoning\", got {shown_value(kind)} (this "
                                   "server stores nothing an item_reference could name)")
    return messages


def _assistant(messages: list[JsonObject]) -> JsonObject:
    """The assistant message the next assistant item joins: the last message when it is one, else a new one."""
    if not messages or messages[-1]["role"] != "assistant" or "tool_calls" in messages[-1]:
        messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def _input_message(item: dict[str, Any], where: str) -> JsonObject:
    role = item.get("role")
    if role not in _ROLES:
        raise ApiError.invalid(f"{where}.role", f"{where}.role must be one of {', '.join(map(repr, _ROLES))}, got "
                               f"{shown_value(role)}")
    return {"role": role, "content": _texts(item.get("content"), where + ".content", "input_text")}


def _texts(content: Any, where: str, kind: str) -> str:
    """A content given as a string or as a list of text parts (`kind`, or a refusal), as one string."""
    if isinstance(content, str):
        return content
    texts = []
    for k, given in enumerate(list_field(content, where)):
        at = f"{where}[{k}]"
        part = object_field(given, at)
        part_kind = part.get("type")
        if part_kind in ("input_image", "input_file", "input_audio"):
            raise ApiError.invalid(at, f"{at}: {NO_IMAGES}")
        if part_kind == "refusal":
            texts.append(string_field(part.get("refusal"), f"{at}.refusal"))
        elif part_kind in (kind, "input_text", "output_text"):
            texts.append(string_field(part.get("text"), f"{at}.text"))
        else:
            raise ApiError.invalid(f"{at}.type", f"{at}.type must be {kind!r}, got {shown_value(part_kind)}")
    return "".join(texts)


def _function_call(item: dict[str, Any], where: str) -> JsonObject:
    return {"id": string_field(item.get("call_id"), f"{where}.call_id"), "type": "function",
            "function": {"name": string_field(item.get("name"), f"{where}.name"),
                         "arguments": string_field(item.get("arguments", "{}"), f"{where}.arguments")}}


def _reasoning(message: JsonObject, item: dict[str, Any], where: str) -> None:
    """A reasoning item's text (its content, else its summary) as the assistant message's reasoning_content."""
    parts = item.get("content") or item.get("summary") or []
    text = "".join(string_field(object_field(part, f"{where}.content[{k}]").get("text"), f"{where}.content[{k}].text")
                   for k, part in enumerate(list_field(parts, f"{where}.content")))
    if text:  # only then: the chat route reads reasoning_content where the template shows it
        message["reasoning_content"] = message.get("reasoning_content", "") + text


def _tools(value: Any) -> list[JsonObject]:
    """Function tools as chat's; OpenAI's hosted tools (web search, file search, ...) are not run here."""
    tools = []
    for k, given in enumerate(list_field(value, "tools")):
        at = f"tools[{k}]"
        tool = object_field(given, at)
        if tool.get("type") != "function":
            raise ApiError.invalid(f"{at}.type", f"{at}.type {shown_value(tool.get('type'))} is not supported; only "
                                   "function tools are (this server runs no hosted tools)")
        extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
        if extra:
            raise ApiError.invalid(f"{at}.{shown(extra[0])}", f"unknown field {at}.{shown(extra[0])}")
        tools.append({"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters",
                                                                                    "strict") if key in tool}})
    return tools


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        return value  # none, auto, required: chat's names
    choice = object_field(value, "tool_choice")
    if choice.get("type") != "function" or set(choice) != {"type", "name"}:
        raise ApiError.invalid("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
                               f"{{\"type\": \"function\", \"name\": ...}}, got {shown_value(choice)}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _text(value: Any) -> JsonObject:
    """`text.format` as chat's response_format (`verbosity` changes nothing here)."""
    text = object_field(value, "text")
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise ApiError.invalid(f"text.{shown(extra[0])}", f"unknown field text.{shown(extra[0])}")
    if text.get("format") is None:
        return {}
    given = object_field(text["format"], "text.format")
    if given.get("type") != "json_schema":
        return {"response_format": given}  # text or json_object: the same shapes
    spec = {key: given[key] for key in ("name", "schema", "strict", "description") if key in given}
    extra = sorted(set(given) - {"type", "name", "schema", "strict", "description"})
    if extra:
        raise ApiError.invalid(f"text.format.{shown(extra[0])}", f"unknown field text.format.{shown(extra[0])}")
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


def _check_ignored(fields: Mapping[str, Any]) -> None:
    """Fields checked and not acted on: `reasoning` (a model thinks as its template says), `include`
    (nothing extra to include), `stream_options` (no obfuscation to turn off)."""
    if "reasoning" in fields:
        object_field(fields["reasoning"], "reasoning")
    if "include" in fields:
        for k, name in enumerate(list_field(fields["include"], "include")):
            string_field(name, f"include[{k}]")
    if "stream_options" in fields:
        object_field(fields["stream_options"], "stream_options")


# --- the answer ---------------------------------------------------------------------------------


def usage(chat_usage: Mapping[str, Any] | None) -> JsonObject:
    """The Responses usage for chat's."""
    chat_usage = chat_usage or {}
    prompt, completion = int(chat_usage.get("prompt_tokens", 0)), int(chat_usage.get("completion_tokens", 0))
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def _reasoning_item(item_id: str, text: str, status: str) -> JsonObject:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _text_part(text: str) -> JsonObject:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> JsonObject:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> JsonObject:
    return {"id": "fc_" + call_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_object(echo: Mapping[str, Any], response_id: str, created_at: int, model: str, *,
                    output: list[JsonObject], status: str, chat_usage: Mapping[str, Any] | None) -> JsonObject:
    """A Response object: `status` completed, incomplete (the token budget ran out), in_progress or failed."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    body: JsonObject = {"id": response_id, "object": "response", "created_at": created_at, "status": status,
                        "error": None, "incomplete_details": incomplete, "model": model, "output": output,
                        "usage": usage(chat_usage) if chat_usage is not None else None, **echo}
    if status in ("completed", "incomplete"):
        body["completed_at"] = int(time.time())
    return body


def response(answer: Mapping[str, Any], echo: Mapping[str, Any], response_id: str) -> JsonObject:
    """The Response a whole chat answer (one choice) is: a reasoning item, a message, function calls."""
    choice = answer["choices"][0]
    said = choice["message"]
    output: list[JsonObject] = []
    if said.get("reasoning_content"):
        output.append(_reasoning_item(new_id("rs_"), said["reasoning_content"], "completed"))
    if said.get("content") or (not output and not said.get("tool_calls")):  # an empty message rather than nothing
        output.append(_message_item(new_id("msg_"), said.get("content") or "", "completed"))
    for call in said.get("tool_calls") or ():
        output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed"))
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    return response_object(echo, response_id, answer["created"], answer["model"], output=output, status=status,
                           chat_usage=answer.get("usage"))


@attrs.define
class _OpenItem:
    """The output item being streamed: its kind (reasoning, message, call), id, place and text so far."""

    kind: str
    id: str
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""
    call_index: int = -1  # a call's index among the answer's calls


class ResponseStream:
    """The Responses events from the chat route's chunks, fed in order (one choice): response.created and
    response.in_progress, then per output item (reasoning, message, function call, in the order they come)
    its `added`, deltas and `done` events, then response.completed (or response.incomplete when the token
    budget ran out). Every event has its `sequence_number`; the final Response holds the items streamed."""

    def __init__(self, echo: Mapping[str, Any], response_id: str, created_at: int, model: str) -> None:
        """A stream of the Response `response_id` for a request whose Response echoes `echo`."""
        self.echo = echo
        self.id = response_id
        self.created_at = created_at
        self.model = model
        self._sequence = 0
        self._open: _OpenItem | None = None
        self._output: list[JsonObject] = []
        self._finish_reason: str | None = None
        self._usage: Mapping[str, Any] | None = None

    def _event(self, name: str, **data: Any) -> SseEvent:
        event = (name, {"type": name, "sequence_number": self._sequence, **data})
        self._sequence += 1
        return event

    def _response(self, status: str) -> JsonObject:
        return response_object(self.echo, self.id, self.created_at, self.model, output=list(self._output),
                               status=status, chat_usage=self._usage if status != "in_progress" else None)

    def start(self) -> list[SseEvent]:
        """The events before any output: response.created, response.in_progress."""
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def feed(self, chunk: Mapping[str, Any]) -> list[SseEvent]:
        """The events of one chat chunk (its usage, when it carries one, is kept for the Response)."""
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events: list[SseEvent] = []
        if "prompt_progress" in chunk:  # llama-server's return_progress: an in_progress event reports it
            events.append(self._event("response.in_progress", response=self._response("in_progress"),
                                      prompt_progress=chunk["prompt_progress"]))
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
        if "timings" in chunk and events:  # timings_per_token: llama-server's, on the chunk's last event
            events[-1][1]["timings"] = chunk["timings"]
        return events

    def _text(self, kind: str, text: str) -> list[SseEvent]:
        events: list[SseEvent] = []
        if self._open is None or self._open.kind != kind:
            events = self._add(_OpenItem(kind, new_id("rs_" if kind == "reasoning" else "msg_"), len(self._output)))
        item = self._open
        assert item is not None
        item.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        return [*events, self._event(name, item_id=item.id, output_index=item.index, content_index=0, delta=text)]

    def _call(self, call: Mapping[str, Any]) -> list[SseEvent]:
        function = call.get("function") or {}
        events: list[SseEvent] = []
        if "id" in call:  # a call's first delta: its id and name
            events = self._add(_OpenItem("call", "fc_" + call["id"], len(self._output), call_id=call["id"],
                                         name=function.get("name", ""), call_index=int(call.get("index", 0))))
        item = self._open
        arguments = function.get("arguments")
        if not arguments or item is None or item.kind != "call" or item.call_index != call.get("index", 0):
            return events  # arguments after another item began: cannot happen in chat's order
        item.text += arguments
        return [*events, self._event("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=item.index, delta=arguments)]

    def _add(self, item: _OpenItem) -> list[SseEvent]:
        events = self._close()
        self._open = item
        self._output.append({})  # its place: filled when it is done
        events.append(self._event("response.output_item.added", output_index=item.index,
                                  item=self._item(item, "in_progress")))
        if item.kind == "message":
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                      content_index=0, part=_text_part("")))
        return events

    @staticmethod
    def _item(item: _OpenItem, status: str) -> JsonObject:
        done = status == "completed"
        if item.kind == "reasoning":
            return _reasoning_item(item.id, item.text if done else "", status)
        if item.kind == "message":
            return _message_item(item.id, item.text if done else None, status)
        return _call_item(item.call_id, item.name, item.text if done else "", status)

    def _close(self) -> list[SseEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        at = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **at, content_index=0, text=item.text)]
        elif item.kind == "message":
            events = [self._event("response.output_text.done", **at, content_index=0, text=item.text, logprobs=[]),
                      self._event("response.content_part.done", **at, content_index=0, part=_text_part(item.text))]
        else:
            events = [self._event("response.function_call_arguments.done", **at, arguments=item.text)]
        self._output[item.index] = self._item(item, "completed")
        return [*events, self._event("response.output_item.done", output_index=item.index,
                                     item=self._output[item.index])]

    def finish(self) -> list[SseEvent]:
        """The last events: the open item's `done` events (an empty message when nothing was said), then
        response.completed, or response.incomplete when the token budget ran out."""
        events = self._add(_OpenItem("message", new_id("msg_"), 0)) if not self._output else []
        events += self._close()
        status = "incomplete" if self._finish_reason == "length" else "completed"
        return [*events, self._event(f"response.{status}", response=self._response(status))]

    def failed(self, error: ApiError) -> list[SseEvent]:
        """The events of a failure after the stream began: `error`, then response.failed."""
        failed = self._response("failed") | {"error": {"code": error.code or error.type, "message": error.message}}
        return [self._event("error", code=error.code or error.type, message=error.message, param=error.param),
                self._event("response.failed", response=failed)]
