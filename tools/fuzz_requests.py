"""A hostile-request campaign against a live `skippy-zmq serve`: every HTTP request and ZeroMQ
request-API message must get a 200 or a 4xx naming the problem, never a 5xx or no answer, with no
traceback in the server's log and no memory growth beyond a bound.

The tool starts `serve` itself (one local stage of a tiny random Gemma 3 unless `--model` is
given, `--zmq-bind` on a free port, JSON logs read as they come), then sends N requests one at a
time, each drawn from `MUTATIONS`: valid completions and chats, integers beyond Python's 4,300
digits, integers beyond a field's bounds, lone surrogates in values, keys, ids and field names,
random JSON at any depth, bytes that are not UTF-8 or not JSON, deep nesting, bodies that are not
their Content-Encoding, encodings the gateway does not take (br, zstd), oversize bodies and
frames, wrong frame counts, tokenize, detokenize and embed messages (valid, and with bad fields), and
n, logprobs, penalties and logit_bias beyond their bounds; and valid, out-of-bounds and random
bodies on llama-server's routes (/completion, /tokenize, /detokenize). A greedy check
completion runs before and after; its text must not change.

    python3 -m tools.fuzz_requests                         # 2,000 requests, seed 0
    python3 -m tools.fuzz_requests --requests 500 --seed 7 --json
    python3 -m tools.fuzz_requests --model gemma3-270m-q4_k_m

Exit status: 0 when nothing went wrong; 1 on a 5xx, an unanswered request, an outcome the row
does not expect, a traceback in the log, serve's death, a changed check, or RSS growth above
`--rss-growth-mib`; 2 when the campaign could not start; 130 when interrupted.

Outcomes: an HTTP request is its status class (200, 4xx, 5xx, or "none" when no answer came
within `--timeout`). A ZeroMQ message is the class of its first answer (an `error` frame's
`code`; `final`, `pong` and `info` are 200), or 5xx if any answer was, or "none"; a message is
answered once an `info` sent after it comes back (the gateway answers in order) and, for a
completion or chat it accepted, once its `final` or `error` came.

To add a mutation kind, add one row to `MUTATIONS`: a name, the API, a weight, a function that
builds the probe, the outcomes it expects, and a claim about the probe that
tests/tools/test_fuzz_requests.py checks in-process (together with the expected outcomes, against the
gateway's socket-free parsers).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any

import attrs
import click
import numpy as np
import zmq

from skippy_zmq.errors import RequestJsonError
from skippy_zmq.gateway.http import MAX_BODY_BYTES
from skippy_zmq.gateway.request_json import MAX_INTEGER_DIGITS, RequestJson
from skippy_zmq.wire.request_api import MAX_FRAME_BYTES
from tools._common import (
    EXIT_NOT_STARTED,
    ToolError,
    finish,
    interrupt_on_sigterm,
    proc_status_kib,
    progress,
    run_directory,
    skippy_command,
    start,
    stop,
    tiny_gemma3,
)

HTTP, ZMQ = "http", "zmq"
OK, CLIENT_ERROR, SERVER_ERROR, NO_ANSWER = "200", "4xx", "5xx", "none"
ANY_ANSWER = frozenset({OK, CLIENT_ERROR})
REFUSED = frozenset({CLIENT_ERROR})
SERVED = frozenset({OK})
TRACEBACK = "Traceback (most recent call last)"
CHECK_BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
PROMPTS = ("Hello", "The capital of France is", "Once upon a time", "def f(x):", "1, 2, 3,")
_SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff", "\ud83d")


# --- probes --------------------------------------------------------------------------------------


@attrs.frozen
class Probe:
    """One request: an HTTP POST (path, body, headers) or a ZeroMQ message (its frames)."""

    api: str
    body: bytes = b""
    path: str = "/v1/completions"
    headers: tuple[tuple[str, str], ...] = ()
    frames: tuple[bytes, ...] = ()
    method: str = "POST"


@attrs.frozen
class Literal:
    """JSON text written into a document as it is (integers Python cannot convert)."""

    text: str


def json_text(value: Any) -> str:
    """JSON of `value`: strings as json.dumps writes them (a lone surrogate as its \\u escape)."""
    if isinstance(value, Literal):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(key)}:{json_text(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(json_text(item) for item in value) + "]"
    return json.dumps(value)


def _pick(rng: np.random.Generator, options: Sequence[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


def _huge(rng: np.random.Generator) -> Literal:
    digits = int(rng.integers(MAX_INTEGER_DIGITS + 1, 20_000))
    return Literal(("-" if rng.random() < 0.3 else "") + "9" * digits)


def _text(rng: np.random.Generator, *, surrogate: bool = False) -> str:
    pieces = [_pick(rng, ("a", "é", " ", "\U0001f600", "<eos>", "x" * 5)) for _ in range(int(rng.integers(1, 5)))]
    if surrogate:
        pieces.insert(int(rng.integers(len(pieces) + 1)), _pick(rng, _SURROGATES))
    return "".join(pieces)


def valid_completion(rng: np.random.Generator) -> dict[str, Any]:
    """A completion the tiny pipeline serves: a short prompt, 1..4 tokens."""
    body: dict[str, Any] = {"prompt": _pick(rng, PROMPTS), "max_tokens": int(rng.integers(1, 5))}
    if rng.random() < 0.5:
        body["temperature"] = 0
    if rng.random() < 0.3:
        body["seed"] = int(rng.integers(0, 2**62))
    if rng.random() < 0.3:
        body["stream"] = True
    return body


def valid_chat(rng: np.random.Generator) -> dict[str, Any]:
    """A chat the tiny pipeline serves."""
    body = valid_completion(rng)
    del body["prompt"]
    return {"messages": [{"role": "user", "content": _pick(rng, PROMPTS)}], **body}


def random_json(rng: np.random.Generator, depth: int = 0) -> Any:
    """Any JSON value: lone surrogates in keys and strings, huge integers, nesting up to 4 deep."""
    roll = int(rng.integers(9 if depth < 4 else 7))
    if roll == 0:
        return None
    if roll == 1:
        return bool(rng.integers(2))
    if roll == 2:
        return int(rng.integers(-(2**63), 2**63)) * int(_pick(rng, (1, 1, 10**20)))
    if roll == 3:
        return _huge(rng)
    if roll == 4:
        return float(rng.standard_normal() * 10 ** int(rng.integers(0, 300)))
    if roll in (5, 6):
        return _text(rng, surrogate=rng.random() < 0.4)
    if roll == 7:
        return [random_json(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    keys = ("prompt", "messages", "max_tokens", "stream", "role", "content", "id", "v", "type")
    return {(_pick(rng, keys) if rng.random() < 0.6 else _text(rng, surrogate=rng.random() < 0.3)):
            random_json(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))}


def _http(body: dict[str, Any] | bytes, *, chat: bool = False, headers: tuple[tuple[str, str], ...] = ()) -> Probe:
    data = body if isinstance(body, bytes) else json_text(body).encode()
    return Probe(HTTP, data, "/v1/chat/completions" if chat else "/v1/completions", headers)


def _zmq(frame: dict[str, Any] | bytes, *frames: bytes) -> Probe:
    data = frame if isinstance(frame, bytes) else json_text(frame).encode()
    return Probe(ZMQ, frames=(data, *frames))


def _zmq_request(rng: np.random.Generator, body: dict[str, Any], kind: str = "completion") -> dict[str, Any]:
    return {"v": 1, "type": kind, "id": f"r{int(rng.integers(1 << 30))}", **body}


def _either(rng: np.random.Generator) -> tuple[dict[str, Any], bool]:
    chat = rng.random() < 0.4
    return (valid_chat(rng) if chat else valid_completion(rng)), chat


# --- the mutation kinds (one function each; the table is below) --------------------------------

Maker = Callable[[np.random.Generator], Probe]

_BOUNDED = ("max_tokens", "max_completion_tokens", "seed", "top_k", "temperature", "top_p", "min_p",
            "repeat_penalty", "n", "presence_penalty", "stream", "user")
_OUT_OF_BOUNDS: tuple[tuple[str, Any], ...] = (
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2**31), ("max_tokens", 10**30),
    ("max_completion_tokens", 2**63), ("seed", 2**64), ("seed", -(2**63) - 1), ("top_k", 2**31), ("top_k", -2),
    ("temperature", 2.5), ("temperature", Literal("1e400")), ("top_p", 1.5), ("min_p", -0.5),
    ("repeat_penalty", Literal("1e-400")), ("repeat_penalty", 1e300), ("n", 0), ("best_of", 10**40),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("logprobs", 6), ("logit_bias", {"1": 101}),
    ("logit_bias", {"x": 1}), ("logit_bias", {str(2**31): 1}),
)


def make_http_valid(rng: np.random.Generator) -> Probe:
    """A valid completion or chat (1..4 tokens; streamed or whole)."""
    body, chat = _either(rng)
    return _http(body, chat=chat)


def make_http_huge_integer(rng: np.random.Generator) -> Probe:
    """A valid request with one field, or one prompt token id, an integer of more than 4,300 digits."""
    body, chat = _either(rng)
    if not chat and rng.random() < 0.2:
        body["prompt"] = [1, 2, _huge(rng)]
    else:
        body[_pick(rng, _BOUNDED)] = _huge(rng)
    return _http(body, chat=chat)


def make_http_out_of_bounds(rng: np.random.Generator) -> Probe:
    """A valid request with one field just or far beyond its bounds (int32, uint64, [0, 2], ...)."""
    body, chat = _either(rng)
    name, value = _pick(rng, _OUT_OF_BOUNDS)
    if name == "best_of":
        chat = False
        body = valid_completion(rng)
    body[name] = value
    return _http(body, chat=chat)


def _with_surrogate_value(rng: np.random.Generator, body: dict[str, Any], chat: bool) -> None:
    bad = _text(rng, surrogate=True)
    where = int(rng.integers(5))
    if where == 0:
        body["stop"] = ["\n", bad]
    elif where == 1:
        body["user"] = bad
    elif where == 2:
        body["model"] = bad
    elif chat:
        body["messages"][0]["content"] = bad if where == 3 else [{"type": "text", "text": bad}]
    else:
        body["prompt"] = bad


def make_http_surrogate_value(rng: np.random.Generator) -> Probe:
    """A lone surrogate in the prompt, a chat content or part, a stop string, user or model."""
    body, chat = _either(rng)
    _with_surrogate_value(rng, body, chat)
    return _http(body, chat=chat)


def make_http_surrogate_key(rng: np.random.Generator) -> Probe:
    """A lone surrogate in a key: top level, in a message, in stream_options or metadata."""
    body, chat = _either(rng)
    key = _text(rng, surrogate=True)
    where = int(rng.integers(3))
    if where == 0:
        body[key] = 1
    elif where == 1 and chat:
        body["messages"][0][key] = None
    else:
        body["metadata"] = {"k": {key: "v"}}
    return _http(body, chat=chat)


def make_http_random_json(rng: np.random.Generator) -> Probe:
    """Random JSON at any depth, alone or as the fields of a valid request."""
    body, chat = _either(rng)
    document = random_json(rng)
    if isinstance(document, dict) and rng.random() < 0.7:
        document = {**body, **document}
    return _http(document if not isinstance(document, Literal) else {"prompt": document}, chat=chat)


def make_http_not_utf8(rng: np.random.Generator) -> Probe:
    """A valid request with bytes that are not UTF-8 in a string (0xFF, or a UTF-8-encoded surrogate)."""
    body, chat = _either(rng)
    data = json_text(body).encode()
    at = data.index(b'"', data.index(b":") + 1) + 1  # inside the first string value
    return _http(data[:at] + _pick(rng, (b"\xff", b"\xed\xa0\x80", b"\xc0\xaf")) + data[at:], chat=chat)


def make_http_not_json(rng: np.random.Generator) -> Probe:
    """Random bytes, a valid body cut short, or arrays nested 1,000 to 100,000 deep."""
    roll = int(rng.integers(3))
    if roll == 0:
        return _http(rng.bytes(int(rng.integers(0, 200))))
    if roll == 1:
        data = json_text(valid_completion(rng)).encode()
        return _http(data[: int(rng.integers(1, len(data)))])
    return _http(b"[" * int(rng.integers(1_000, 100_000)))


def make_http_bad_encoding(rng: np.random.Generator) -> Probe:
    """Content-Encoding gzip or deflate on a body that is not (or is cut short), or br or zstd (not taken)."""
    body = json_text(valid_completion(rng)).encode()
    encoding = _pick(rng, ("gzip", "deflate", "br", "zstd"))
    if encoding in ("gzip", "deflate") and rng.random() < 0.5:
        body = gzip.compress(body)[:-6] if encoding == "gzip" else zlib.compress(body)[2:]  # broken streams
    return _http(body, headers=(("Content-Encoding", encoding),))


def make_http_gzip(rng: np.random.Generator) -> Probe:
    """A valid request, gzip-compressed with its Content-Encoding."""
    return _http(gzip.compress(json_text(valid_completion(rng)).encode()), headers=(("Content-Encoding", "gzip"),))


def make_http_too_large(rng: np.random.Generator) -> Probe:
    """A body above 1 MiB, sent as is or as a small gzip of it (the limit counts decoded bytes)."""
    data = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + int(rng.integers(1, 1000))) + b'"}'
    if rng.random() < 0.5:
        return _http(gzip.compress(data), headers=(("Content-Encoding", "gzip"),))
    return _http(data)


def make_http_wrong_route(rng: np.random.Generator) -> Probe:
    """An unknown path, or a GET of a POST route."""
    if rng.random() < 0.5:
        return Probe(HTTP, b"{}", "/v1/" + _pick(rng, ("nothing", "embedding", "completions/x", "%ff")))
    return Probe(HTTP, b"", "/v1/completions", method="GET")


LLAMA_PATHS = ("/completion", "/tokenize", "/detokenize")
"""llama-server's routes that take a body (docs/PROTOCOL.md §9.6)."""
_LLAMA_OUT_OF_BOUNDS: dict[str, tuple[tuple[str, Any], ...]] = {
    "/completion": (("n_predict", -2), ("n_predict", 2**31), ("n_probs", 21), ("top_p", 1.5), ("seed", 2**64),
                    ("seed", -2), ("temperature", Literal("1e400")), ("repeat_last_n", -2),
                    ("presence_penalty", 3), ("grammar", "root ::= x"), ("mirostat", 2), ("prompt", [1, 2.5])),
    "/tokenize": (("add_special", 1), ("content", 5), ("with_pieces", "yes"), ("parse_special", [])),
    "/detokenize": (("tokens", [-1]), ("tokens", [2**31]), ("tokens", "x"), ("tokens", [1.5])),
}


def valid_llama(rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
    """A valid body for one of llama-server's routes, and its path."""
    path = _pick(rng, LLAMA_PATHS)
    if path == "/completion":
        body: dict[str, Any] = {"prompt": _pick(rng, PROMPTS), "n_predict": int(rng.integers(1, 5))}
        if rng.random() < 0.5:
            body["temperature"] = 0
        if rng.random() < 0.3:
            body["stream"] = True
        if rng.random() < 0.3:
            body["n_probs"] = int(rng.integers(0, 4))
        return path, body
    if path == "/tokenize":
        return path, {"content": _pick(rng, PROMPTS), "add_special": bool(rng.integers(2)),
                      "with_pieces": bool(rng.integers(2))}
    return path, {"tokens": [int(token) for token in rng.integers(1, 200, int(rng.integers(0, 6)))]}


def make_http_llama_valid(rng: np.random.Generator) -> Probe:
    """A valid /completion (1..4 tokens; streamed or whole), /tokenize or /detokenize."""
    path, body = valid_llama(rng)
    return Probe(HTTP, json_text(body).encode(), path)


def make_http_llama_out_of_bounds(rng: np.random.Generator) -> Probe:
    """A valid llama-server body with one field beyond its bounds, of the wrong type, or not served."""
    path, body = valid_llama(rng)
    name, value = _pick(rng, _LLAMA_OUT_OF_BOUNDS[path])
    return Probe(HTTP, json_text({**body, name: value}).encode(), path)


def make_http_llama_random_json(rng: np.random.Generator) -> Probe:
    """Random JSON at any depth to a llama-server route, alone or as the fields of a valid body."""
    path, body = valid_llama(rng)
    document = random_json(rng)
    if isinstance(document, dict) and rng.random() < 0.7:
        document = {**body, **document}
    return Probe(HTTP, json_text(document).encode(), path)


def make_zmq_valid(rng: np.random.Generator) -> Probe:
    """A valid completion or chat on the request API (streamed unless stream is false)."""
    body, chat = _either(rng)
    body["stream"] = bool(rng.integers(2))
    return _zmq(_zmq_request(rng, body, "chat" if chat else "completion"))


def make_zmq_huge_integer(rng: np.random.Generator) -> Probe:
    """An integer of more than 4,300 digits as v, id, a field or a token id."""
    frame = _zmq_request(rng, valid_completion(rng))
    frame[_pick(rng, ("v", "id", "max_tokens", "seed", "top_k", "temperature"))] = _huge(rng)
    return _zmq(frame)


def make_zmq_out_of_bounds(rng: np.random.Generator) -> Probe:
    """A field beyond its bounds, an id longer than 128 characters, or a waiting list above 256."""
    roll = int(rng.integers(3))
    if roll == 0:
        frame = _zmq_request(rng, valid_completion(rng))
        name, value = _pick(rng, _OUT_OF_BOUNDS[:-1])
        frame[name] = value
        return _zmq(frame)
    if roll == 1:
        return _zmq({"v": 1, "type": "completion", "id": "x" * int(rng.integers(129, 10_000)), "prompt": "Hi"})
    return _zmq({"v": 1, "type": "ping", "waiting": [f"w{k}" for k in range(int(rng.integers(257, 2000)))]})


def make_zmq_surrogate_id(rng: np.random.Generator) -> Probe:
    """A lone surrogate in the id of a completion, cancel, ping or info, or in a waiting id."""
    kind = _pick(rng, ("completion", "cancel", "ping", "info", "waiting"))
    bad = _text(rng, surrogate=True)
    if kind == "waiting":
        return _zmq({"v": 1, "type": "ping", "waiting": ["fine", bad]})
    frame: dict[str, Any] = {"v": 1, "type": kind, "id": bad}
    if kind == "completion":
        frame["prompt"] = "Hi"
    return _zmq(frame)


def make_zmq_surrogate_field_name(rng: np.random.Generator) -> Probe:
    """A lone surrogate in a field name of any message type."""
    frame = _zmq_request(rng, valid_completion(rng), _pick(rng, ("completion", "ping", "info", "cancel")))
    if frame["type"] != "completion":
        frame = {"v": 1, "type": frame["type"], "id": frame["id"]}
    frame[_text(rng, surrogate=True)] = 1
    return _zmq(frame)


def make_zmq_surrogate_value(rng: np.random.Generator) -> Probe:
    """A lone surrogate in a prompt, chat content, stop string, user or model."""
    body, chat = _either(rng)
    _with_surrogate_value(rng, body, chat)
    return _zmq(_zmq_request(rng, body, "chat" if chat else "completion"))


def make_zmq_random_json(rng: np.random.Generator) -> Probe:
    """Random JSON at any depth, alone or as the fields of a valid message of any type."""
    document = random_json(rng)
    if isinstance(document, dict) and rng.random() < 0.7:
        base = _zmq_request(rng, valid_completion(rng), _pick(rng, ("completion", "ping", "info", "cancel", "chat")))
        document = {**base, **document}
    return _zmq(document if not isinstance(document, Literal) else {"v": document})


def make_zmq_not_json(rng: np.random.Generator) -> Probe:
    """Random bytes, bytes that are not UTF-8, a cut message, or deep nesting, as the one frame."""
    roll = int(rng.integers(4))
    if roll == 0:
        return _zmq(rng.bytes(int(rng.integers(0, 200))))
    if roll == 1:
        return _zmq(b'{"v":1,"type":"completion","id":"r","prompt":"\xed\xa0\x80"}')
    if roll == 2:
        data = json_text(_zmq_request(rng, valid_completion(rng))).encode()
        return _zmq(data[: int(rng.integers(1, len(data)))])
    return _zmq(b"[" * int(rng.integers(1_000, 100_000)))


def make_zmq_frames(rng: np.random.Generator) -> Probe:
    """A valid message followed by 1..5 more frames, or a frame above 1 MiB."""
    frame = json_text(_zmq_request(rng, valid_completion(rng))).encode()
    if rng.random() < 0.3:
        return _zmq(frame + b" " * MAX_FRAME_BYTES)
    return _zmq(frame, *(rng.bytes(int(rng.integers(0, 50))) for _ in range(int(rng.integers(1, 6)))))


_TEXT_VOCAB = 259  # the tiny vocab's control and byte tokens: ids every served model has
_NEW_FIELDS_OUT_OF_BOUNDS: tuple[tuple[str, Any], ...] = (
    ("n", -1), ("n", 10**30), ("logprobs", -1), ("logprobs", 21), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", [1]),
)


def make_zmq_text(rng: np.random.Generator) -> Probe:
    """A valid tokenize (text, add_special or not) or detokenize (ids of the vocab's first tokens)."""
    request_id = f"t{int(rng.integers(1 << 30))}"
    if rng.random() < 0.5:
        frame: dict[str, Any] = {"v": 1, "type": "tokenize", "id": request_id, "content": _text(rng)}
        if rng.random() < 0.5:
            frame["add_special"] = bool(rng.integers(2))
        return _zmq(frame)
    tokens = [int(token) for token in rng.integers(0, _TEXT_VOCAB, int(rng.integers(0, 20)))]
    return _zmq({"v": 1, "type": "detokenize", "id": request_id, "tokens": tokens})


def make_zmq_text_bad(rng: np.random.Generator) -> Probe:
    """A tokenize or detokenize with a bad, missing or unknown field, or no id."""
    roll = int(rng.integers(6))
    base: dict[str, Any] = {"v": 1, "type": "tokenize", "id": f"t{int(rng.integers(1 << 30))}", "content": "Hi"}
    if roll == 0:
        return _zmq({**base, "content": _pick(rng, (None, 7, ["Hi"], {"a": 1}, _huge(rng)))})
    if roll == 1:
        return _zmq({**base, "add_special": _pick(rng, (1, "yes", [], _huge(rng)))})
    if roll == 2:
        return _zmq({**base, _pick(rng, ("with_pieces", "tokens", "prompt", "stream")): True})
    if roll == 3:
        return _zmq({key: value for key, value in base.items() if key != "id"})
    bad = _pick(rng, (-1, 2**31, True, None, 1.5, "7", _huge(rng)))
    tokens = _pick(rng, ([1, bad], [bad], "1,2", {"0": 1}, None))
    return _zmq({"v": 1, "type": "detokenize", "id": base["id"], "tokens": tokens})


def make_zmq_embed(rng: np.random.Generator) -> Probe:
    """A valid embed: a text, 1..4 texts or lists of the vocab's first token ids, as floats or base64."""
    inputs: list[Any] = [_text(rng) if rng.random() < 0.5 else
                         [int(token) for token in rng.integers(0, _TEXT_VOCAB, int(rng.integers(1, 9)))]
                         for _ in range(int(rng.integers(1, 5)))]
    frame: dict[str, Any] = {"v": 1, "type": "embed", "id": f"e{int(rng.integers(1 << 30))}",
                             "input": inputs[0] if isinstance(inputs[0], str) and rng.random() < 0.3 else inputs}
    if rng.random() < 0.5:
        frame["encoding_format"] = _pick(rng, ("float", "base64"))
    return _zmq(frame)


_EMBED_BAD: tuple[tuple[str, Any], ...] = (
    ("input", None), ("input", ""), ("input", []), ("input", ["ok", ""]), ("input", ["ok", 7]), ("input", [[1], []]),
    ("input", [[1, -1]]), ("input", [2**31]), ("input", {"a": 1}), ("encoding_format", "hex"),
    ("encoding_format", 1), ("dimensions", 0), ("dimensions", "4"), ("model", 5), ("stream", True), ("prompt", "x"),
)


def make_zmq_embed_bad(rng: np.random.Generator) -> Probe:
    """An embed with a bad, missing or unknown field, a huge integer, or no id."""
    base: dict[str, Any] = {"v": 1, "type": "embed", "id": f"e{int(rng.integers(1 << 30))}", "input": ["Hi"]}
    roll = int(rng.integers(5))
    if roll == 0:
        return _zmq({key: value for key, value in base.items() if key != "id"})
    if roll == 1:
        return _zmq({**base, "input": [[1, _huge(rng)]]})
    name, value = _pick(rng, _EMBED_BAD)
    return _zmq({**base, name: value})


def make_zmq_new_fields_out_of_bounds(rng: np.random.Generator) -> Probe:
    """A completion or chat whose n, logprobs, penalty or logit_bias is beyond what any server accepts."""
    body, chat = _either(rng)
    name, value = _pick(rng, _NEW_FIELDS_OUT_OF_BOUNDS)
    if chat and name == "logprobs":
        body["logprobs"], body["top_logprobs"] = True, _pick(rng, (-1, 21, _huge(rng)))
    else:
        body[name] = value
    return _zmq(_zmq_request(rng, body, "chat" if chat else "completion"))


@attrs.frozen
class Mutation:
    """One kind of hostile request: name, API, weight, maker, the outcomes it may have, a claim."""

    name: str
    api: str
    weight: float
    make: Maker
    expect: frozenset[str]
    claim: Callable[[Probe], bool]

    @property
    def about(self) -> str:
        """What the kind sends (the first line of its maker's docstring)."""
        return (self.make.__doc__ or self.name).strip().splitlines()[0]


def invalid_text(data: bytes) -> bool:
    """Whether `data` is UTF-8 JSON holding a lone surrogate (the gateway's own reading of it)."""
    try:
        return RequestJson.parse(data, "probe").invalid_text is not None
    except RequestJsonError:
        return False


def huge_integer(data: bytes) -> bool:
    """Whether `data` holds a run of more than 4,300 digits."""
    run = best = 0
    for byte in data:
        run = run + 1 if 48 <= byte <= 57 else 0
        best = max(best, run)
    return best > MAX_INTEGER_DIGITS


def not_utf8_json(data: bytes) -> bool:
    """Whether the gateway's reader refuses `data` as not UTF-8 JSON."""
    try:
        RequestJson.parse(data, "probe")
    except RequestJsonError:
        return True
    return False


def _first(probe: Probe) -> bytes:
    return probe.frames[0] if probe.api == ZMQ else probe.body


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("http_valid", HTTP, 8, make_http_valid, SERVED, lambda p: not invalid_text(p.body)),
    Mutation("http_huge_integer", HTTP, 5, make_http_huge_integer, REFUSED, lambda p: huge_integer(p.body)),
    Mutation("http_out_of_bounds", HTTP, 5, make_http_out_of_bounds, REFUSED, lambda p: not not_utf8_json(p.body)),
    Mutation("http_surrogate_value", HTTP, 5, make_http_surrogate_value, REFUSED, lambda p: invalid_text(p.body)),
    Mutation("http_surrogate_key", HTTP, 5, make_http_surrogate_key, REFUSED, lambda p: invalid_text(p.body)),
    Mutation("http_random_json", HTTP, 6, make_http_random_json, ANY_ANSWER, lambda p: not not_utf8_json(p.body)),
    Mutation("http_not_utf8", HTTP, 3, make_http_not_utf8, REFUSED, lambda p: not_utf8_json(p.body)),
    Mutation("http_not_json", HTTP, 3, make_http_not_json, REFUSED, lambda p: not_utf8_json(p.body)),
    Mutation("http_bad_encoding", HTTP, 3, make_http_bad_encoding, REFUSED,
             lambda p: dict(p.headers).get("Content-Encoding") in ("gzip", "deflate", "br", "zstd")),
    Mutation("http_gzip", HTTP, 2, make_http_gzip, SERVED, lambda p: p.body[:2] == b"\x1f\x8b"),
    Mutation("http_too_large", HTTP, 0.5, make_http_too_large, REFUSED,
             lambda p: len(gzip.decompress(p.body) if p.headers else p.body) > MAX_BODY_BYTES),
    Mutation("http_wrong_route", HTTP, 1, make_http_wrong_route, REFUSED,
             lambda p: p.method == "GET" or p.path != "/v1/completions"),
    Mutation("http_llama_valid", HTTP, 3, make_http_llama_valid, SERVED, lambda p: p.path in LLAMA_PATHS),
    Mutation("http_llama_out_of_bounds", HTTP, 3, make_http_llama_out_of_bounds, REFUSED,
             lambda p: p.path in LLAMA_PATHS and not not_utf8_json(p.body)),
    Mutation("http_llama_random_json", HTTP, 3, make_http_llama_random_json, ANY_ANSWER,
             lambda p: p.path in LLAMA_PATHS and not not_utf8_json(p.body)),
    Mutation("zmq_valid", ZMQ, 8, make_zmq_valid, SERVED, lambda p: len(p.frames) == 1 and not invalid_text(_first(p))),
    Mutation("zmq_huge_integer", ZMQ, 5, make_zmq_huge_integer, REFUSED, lambda p: huge_integer(_first(p))),
    Mutation("zmq_out_of_bounds", ZMQ, 4, make_zmq_out_of_bounds, REFUSED, lambda p: not not_utf8_json(_first(p))),
    Mutation("zmq_surrogate_id", ZMQ, 4, make_zmq_surrogate_id, REFUSED, lambda p: invalid_text(_first(p))),
    Mutation("zmq_surrogate_field_name", ZMQ, 4, make_zmq_surrogate_field_name, REFUSED,
             lambda p: invalid_text(_first(p))),
    Mutation("zmq_surrogate_value", ZMQ, 4, make_zmq_surrogate_value, REFUSED, lambda p: invalid_text(_first(p))),
    Mutation("zmq_random_json", ZMQ, 6, make_zmq_random_json, ANY_ANSWER, lambda p: not not_utf8_json(_first(p))),
    Mutation("zmq_not_json", ZMQ, 3, make_zmq_not_json, REFUSED, lambda p: not_utf8_json(_first(p))),
    Mutation("zmq_frames", ZMQ, 2, make_zmq_frames, REFUSED,
             lambda p: len(p.frames) > 1 or len(p.frames[0]) > MAX_FRAME_BYTES),
    Mutation("zmq_text", ZMQ, 3, make_zmq_text, SERVED, lambda p: b'tokenize","id"' in _first(p)),
    Mutation("zmq_text_bad", ZMQ, 3, make_zmq_text_bad, REFUSED, lambda p: b'tokenize"' in _first(p)),
    Mutation("zmq_embed", ZMQ, 3, make_zmq_embed, SERVED, lambda p: b'"type":"embed","id"' in _first(p)),
    Mutation("zmq_embed_bad", ZMQ, 3, make_zmq_embed_bad, REFUSED, lambda p: b'"type":"embed"' in _first(p)),
    Mutation("zmq_new_fields_out_of_bounds", ZMQ, 3, make_zmq_new_fields_out_of_bounds, REFUSED,
             lambda p: any(f'"{name}"'.encode() in _first(p) for name, _ in _NEW_FIELDS_OUT_OF_BOUNDS)),
)
"""The campaign's table: one row per kind of hostile request."""


def schedule(rng: np.random.Generator, count: int, table: Sequence[Mutation] = MUTATIONS) -> Iterator[Mutation]:
    """`count` kinds to send: every row once first (so a short run covers the table), then drawn by weight."""
    weights = np.array([row.weight for row in table], dtype=np.float64)
    for index in range(count):
        yield table[index] if index < len(table) else table[int(rng.choice(len(table), p=weights / weights.sum()))]


def status_class(status: int | None) -> str:
    """200, 4xx, 5xx, or none (no answer)."""
    if status is None:
        return NO_ANSWER
    return OK if status < 300 else CLIENT_ERROR if status < 500 else SERVER_ERROR


# --- the server under test -----------------------------------------------------------------------


class ServeLog:
    """Reads serve's stderr (JSON lines) on a thread: its endpoints, tracebacks, warnings, a copy on disk."""

    def __init__(self, stream: Any, copy_to: Path) -> None:
        self.events: list[dict[str, Any]] = []
        self.tracebacks = 0
        self.traceback_excerpt: list[str] = []
        self.warnings: list[str] = []
        self.not_json = 0
        self._copy = copy_to.open("w", encoding="utf-8")
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self._copy.write(line)
            self.take(line)
        self._copy.close()

    def take(self, line: str) -> None:
        """Count one line: a raw traceback, or a JSON event whose text holds one, or a warning or error."""
        if line.startswith(TRACEBACK):
            self._traceback(line)
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            self.not_json += bool(line.strip())
            return
        if not isinstance(event, dict):
            return
        self.events.append(event)
        text = " ".join(str(value) for value in event.values() if isinstance(value, str))
        if TRACEBACK in text:
            self._traceback(text)
        if event.get("level") in ("warning", "error", "critical") or event.get("event") in ("warning", "fatal"):
            self.warnings.append(text[:300])

    def _traceback(self, text: str) -> None:
        self.tracebacks += 1
        if not self.traceback_excerpt:
            self.traceback_excerpt = text[text.index(TRACEBACK):].splitlines()[:30]

    def event(self, name: str, timeout_s: float, alive: Callable[[], bool]) -> dict[str, Any]:
        """The first event called `name`; ToolError if it does not come in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive():
            for event in list(self.events):
                if event.get("event") == name:
                    return event
            time.sleep(0.05)
        raise ToolError(f"serve logged no {name!r} event within {timeout_s:g} s")

    def join(self, timeout_s: float) -> None:
        """Wait for the reader to reach the end of the stream."""
        self._thread.join(timeout_s)


class Serve:
    """A `skippy-zmq serve` subprocess on free ports: its URL, request-API endpoint and log."""

    def __init__(self, model_path: Path, directory: Path, ready_timeout_s: float) -> None:
        self.process = start(skippy_command("serve", "--model", str(model_path), "--stages", "1", "--lanes", "4",
                                            "--ctx-size", "512", "--threads", "1", "--port", "0",
                                            "--zmq-bind", "tcp://127.0.0.1:*", "--max-client-requests", "0",
                                            "--log-json"), pipe_stderr=True)
        self.log = ServeLog(self.process.stderr, directory / "serve.log")
        alive = self.alive
        self.url: str = self.log.event("listening", 60, alive)["url"]
        self.zmq_endpoint: str = self.log.event("zmq_listening", 60, alive)["endpoint"]
        self.log.event("ready", ready_timeout_s, alive)
        self.host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)

    @property
    def pid(self) -> int:
        """serve's process id."""
        return self.process.pid

    def alive(self) -> bool:
        """Whether serve still runs."""
        return self.process.poll() is None

    def stop(self) -> int | None:
        """SIGTERM, a bounded wait (then SIGKILL); serve's exit status after SIGTERM (None: killed)."""
        code = stop(self.process)
        self.log.join(10)
        return code


# --- sending -------------------------------------------------------------------------------------


@attrs.frozen
class Answer:
    """What came back for one probe: its status (None: nothing), and the first answer's text."""

    status: int | None
    text: str = ""


def send_http(probe: Probe, host: str, port: int, timeout_s: float) -> Answer:
    """POST (or GET) on a new connection; the status and the start of the body."""
    connection = HTTPConnection(host, port, timeout=timeout_s)
    try:
        headers = {"Content-Type": "application/json", **dict(probe.headers)}
        connection.request(probe.method, probe.path, body=probe.body or None, headers=headers)
        response = connection.getresponse()
        body = response.read()
        return Answer(response.status, body[:2000].decode("utf-8", "backslashreplace"))
    except (OSError, HTTPException) as exc:
        return Answer(None, f"{type(exc).__name__}: {exc}")
    finally:
        connection.close()


_ENDING = ("final", "error", "tokens", "text", "embedding")  # the frames that end a request (docs/PROTOCOL.md §8.3)


class ZmqLink:
    """One DEALER to the request API; a message is answered once an `info` sent after it comes back."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.connect(endpoint)
        self._timeout_s = timeout_s
        self._count = 0

    def send(self, probe: Probe) -> Answer:
        """Send the probe's frames and the `info` behind it; collect until both are answered."""
        from skippy_zmq.gateway.zmq_requests import Cancel, Detokenize, Embed, Submit, Tokenize, read_command

        self._count += 1
        marker = f"\x00fuzz-{self._count}"  # no probe's id holds a NUL
        command = read_command(len(probe.frames), probe.frames[0] if probe.frames else None)
        opened = isinstance(command, Submit | Embed | Tokenize | Detokenize)
        waiting = {("info", marker)} | ({("end", command.request_id)} if opened else set())
        self._sock.send_multipart(list(probe.frames))
        self._sock.send(json.dumps({"v": 1, "type": "info", "id": marker}).encode())
        answers: list[dict[str, Any]] = []
        deadline = time.monotonic() + self._timeout_s
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(int(remaining * 1000) + 1):
                return Answer(None, f"no answer within {self._timeout_s:g} s; got {answers[:3]}")
            frame = json.loads(self._sock.recv().decode("utf-8"))  # strict UTF-8: answers are valid text
            kind = "end" if frame.get("type") in _ENDING else frame.get("type")
            waiting.discard((kind, frame.get("id")))
            if frame.get("id") != marker:
                answers.append(frame)
        return _zmq_answer(answers, silent_ok=isinstance(command, Cancel))

    def close(self) -> None:
        """Close the socket (linger 0) and its context."""
        self._sock.close(linger=0)
        self._context.term()


def _zmq_answer(answers: list[dict[str, Any]], *, silent_ok: bool) -> Answer:
    """The class of a message's answers; only a cancel may have none of its own (docs/PROTOCOL.md §8.2)."""
    codes = [int(frame["code"]) if frame.get("type") == "error" else 200 for frame in answers if frame.get("type")
             not in ("delta",)]
    if not codes:
        return Answer(200 if silent_ok else None, "no answer of its own" + (" (a cancel)" if silent_ok else ""))
    status = max(codes) if max(codes) >= 500 else codes[0]
    first = next(frame for frame in answers if frame.get("type") != "delta")
    return Answer(status, json.dumps(first, ensure_ascii=False)[:300])


# --- the campaign --------------------------------------------------------------------------------


@attrs.define
class Tally:
    """Outcomes by mutation kind, statuses, and the first few unexpected outcomes."""

    by_mutation: dict[str, Counter[str]] = attrs.Factory(dict)
    statuses: Counter[str] = attrs.Factory(Counter)
    unexpected: list[dict[str, Any]] = attrs.Factory(list)
    unexpected_count: int = 0

    def record(self, row: Mutation, probe: Probe, answer: Answer) -> None:
        """Count one probe's outcome."""
        outcome = status_class(answer.status)
        counts = self.by_mutation.setdefault(row.name, Counter())
        counts["sent"] += 1
        counts[outcome] += 1
        self.statuses[f"{row.api} {answer.status}"] += 1
        if outcome not in row.expect:
            counts["unexpected"] += 1
            self.unexpected_count += 1
            if len(self.unexpected) < 10:
                self.unexpected.append({"mutation": row.name, "status": answer.status, "answer": answer.text[:300],
                                        "request": _first(probe)[:200].decode("utf-8", "backslashreplace")})

    def total(self, outcome: str) -> int:
        """How many probes had this outcome."""
        return sum(counts[outcome] for counts in self.by_mutation.values())


def check_completion(serve: Serve, timeout_s: float) -> str:
    """The text of a fixed greedy completion (an error text if it fails)."""
    answer = send_http(Probe(HTTP, json.dumps(CHECK_BODY).encode()), serve.host, serve.port, timeout_s)
    with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
        if answer.status == 200:
            return str(json.loads(answer.text)["choices"][0]["text"])
    return f"check failed: {answer.status} {answer.text[:200]}"


@attrs.define
class Campaign:
    """N probes, one at a time, against one serve; the server watched between them."""

    serve: Serve
    requests: int
    seed: int
    timeout_s: float
    say: Callable[[str], None]
    tally: Tally = attrs.Factory(Tally)
    rss_kib: dict[str, int | None] = attrs.Factory(dict)
    checks: list[str] = attrs.Factory(list)
    sent: int = 0
    wall_s: float = 0.0
    died: str | None = None
    interrupted: bool = False

    def run(self) -> None:
        """Send every probe; stop early if serve dies or on Ctrl-C."""
        self.checks.append(check_completion(self.serve, self.timeout_s))
        self.rss_kib["before"] = proc_status_kib(self.serve.pid, "VmRSS")
        rng = np.random.default_rng(self.seed)
        link = ZmqLink(self.serve.zmq_endpoint, self.timeout_s)
        started = time.monotonic()
        try:
            for row in schedule(rng, self.requests):
                probe = row.make(rng)
                answer = (send_http(probe, self.serve.host, self.serve.port, self.timeout_s) if probe.api == HTTP
                          else link.send(probe))
                self.tally.record(row, probe, answer)
                self.sent += 1
                if not self.serve.alive():
                    self.died = f"serve exited with status {self.serve.process.poll()} after {self.sent} requests"
                    break
                if self.sent % 500 == 0:
                    self.say(f"{self.sent} requests, {self.tally.total(SERVER_ERROR)} 5xx, "
                             f"RSS {proc_status_kib(self.serve.pid, 'VmRSS')} KiB")
        except KeyboardInterrupt:
            self.interrupted = True
        finally:
            self.wall_s = time.monotonic() - started
            link.close()
        if self.serve.alive():
            self.rss_kib["after"] = proc_status_kib(self.serve.pid, "VmRSS")
            self.rss_kib["peak"] = proc_status_kib(self.serve.pid, "VmHWM")
            self.checks.append(check_completion(self.serve, self.timeout_s))


def build_report(campaign: Campaign, model: str, rss_growth_mib: float) -> dict[str, Any]:
    """The campaign's summary as one JSON-able object, with `ok`."""
    tally, log, rss = campaign.tally, campaign.serve.log, campaign.rss_kib
    before, after = rss.get("before"), rss.get("after")
    growth_mib = None if before is None or after is None else (after - before) / 1024
    report: dict[str, Any] = {
        "model": model, "seed": campaign.seed, "sent": campaign.sent, "wall_s": round(campaign.wall_s, 1),
        "http": sum(c["sent"] for n, c in tally.by_mutation.items() if n.startswith("http")),
        "zmq": sum(c["sent"] for n, c in tally.by_mutation.items() if n.startswith("zmq")),
        "ok_200": tally.total(OK), "client_errors": tally.total(CLIENT_ERROR),
        "server_errors": tally.total(SERVER_ERROR), "no_answer": tally.total(NO_ANSWER),
        "unexpected": tally.unexpected_count, "unexpected_samples": tally.unexpected,
        "statuses": dict(sorted(tally.statuses.items())),
        "by_mutation": {name: dict(counts) for name, counts in tally.by_mutation.items()},
        "tracebacks": log.tracebacks, "traceback_excerpt": log.traceback_excerpt,
        "warnings": len(log.warnings), "warning_samples": log.warnings[:5], "log_lines_not_json": log.not_json,
        "rss_kib": rss, "rss_growth_mib": None if growth_mib is None else round(growth_mib, 1),
        "rss_growth_bound_mib": rss_growth_mib, "checks": campaign.checks, "died": campaign.died,
        "interrupted": campaign.interrupted,
    }
    report["ok"] = bool(
        not report["server_errors"] and not report["no_answer"] and not report["unexpected"]
        and not log.tracebacks and campaign.died is None and growth_mib is not None and growth_mib <= rss_growth_mib
        and len(set(campaign.checks)) == 1 and not campaign.checks[0].startswith("check failed")
    )
    return report


def _mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.1f} MiB"


def render(report: dict[str, Any]) -> str:
    """The human-readable summary."""
    sent, wall, rss = report["sent"], max(report["wall_s"], 1e-9), report["rss_kib"]
    lines = [
        f"fuzz_requests: serve of {report['model']}, seed {report['seed']}",
        f"sent {sent} requests in {report['wall_s']:.1f} s ({sent / wall:.0f}/s): HTTP {report['http']}, "
        f"ZeroMQ {report['zmq']}" + (" (INTERRUPTED)" if report["interrupted"] else ""),
        f"  200 {report['ok_200']}, 4xx {report['client_errors']}, 5xx {report['server_errors']}, "
        f"no answer {report['no_answer']}, not the row's expected outcome {report['unexpected']}",
        "  by mutation:                   sent    200    4xx    5xx   none  unexpected",
        *(f"    {name:<26}{c.get('sent', 0):>7}{c.get(OK, 0):>7}{c.get(CLIENT_ERROR, 0):>7}"
          f"{c.get(SERVER_ERROR, 0):>7}{c.get(NO_ANSWER, 0):>7}{c.get('unexpected', 0):>12}"
          for name, c in report["by_mutation"].items()),
        "  statuses: " + ", ".join(f"{key} x{count}" for key, count in report["statuses"].items()),
        *(f"  unexpected: {sample}" for sample in report["unexpected_samples"][:5]),
        f"server log: tracebacks {report['tracebacks']}, warnings and errors {report['warnings']}, "
        f"lines that are not JSON {report['log_lines_not_json']}",
        *(f"  | {line}" for line in report["traceback_excerpt"][:20]),
        *(f"  warning: {line}" for line in report["warning_samples"]),
        f"RSS of serve: before {_mib(rss.get('before'))}, after {_mib(rss.get('after'))}, peak (VmHWM) "
        f"{_mib(rss.get('peak'))}; growth {report['rss_growth_mib']} MiB (bound {report['rss_growth_bound_mib']:g})",
        f"check completion before and after: {'equal' if len(set(report['checks'])) == 1 else 'DIFFERENT'} "
        f"{report['checks'][:2]!r}",
        *([f"died: {report['died']}"] if report["died"] else []),
        "result: " + ("OK" if report["ok"] else "FAILED"),
    ]
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------------


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--requests", "-n", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Requests to send (HTTP and ZeroMQ together).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every random choice.")
@click.option("--model", default=None, help="GGUF path or alias to serve (default: a tiny random Gemma 3).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Seconds a request may go unanswered.")
@click.option("--rss-growth-mib", type=click.FloatRange(min=0), default=64.0, show_default=True,
              help="Largest growth of serve's RSS over the campaign that passes.")
@click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="Seconds serve may take to be ready.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Keep serve's log here (default: a temporary directory, kept only when something went wrong).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
def main(requests: int, seed: int, model: str | None, timeout_s: float, rss_growth_mib: float,
         ready_timeout_s: float, log_dir: str | None, as_json: bool, quiet: bool) -> None:
    """Run one campaign and print its summary."""
    from skippy_zmq.model.catalog import resolve_model

    interrupt_on_sigterm()  # as Ctrl-C: serve is stopped, the summary printed
    say = progress(quiet)
    directory = run_directory(log_dir, "fuzz-requests-")
    model_path = resolve_model(model) if model is not None else tiny_gemma3(directory)
    say(f"starting serve of {model_path}; its log in {directory / 'serve.log'}")
    serve: Serve | None = None
    try:
        serve = Serve(model_path, directory, ready_timeout_s)
        campaign = Campaign(serve, requests, seed, timeout_s, say)
        say(f"sending {requests} requests (seed {seed}) to {serve.url} and {serve.zmq_endpoint}")
        campaign.run()
    except ToolError as exc:
        click.echo(f"fuzz_requests: {exc.message}", err=True)
        sys.exit(EXIT_NOT_STARTED)
    finally:
        if serve is not None:
            serve.stop()
    report = build_report(campaign, str(model_path), rss_growth_mib)
    finish(report, render, as_json=as_json, directory=directory, keep=log_dir is not None,
           interrupted=campaign.interrupted, say=say, kept="serve's log")


if __name__ == "__main__":
    main()
