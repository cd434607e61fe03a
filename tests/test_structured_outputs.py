"""Structured outputs end to end: `serve` over two real stages of a random-weight Gemma 3 answers
`response_format`, llama-server's `json_schema`, `grammar` and `regex`, through the `openai` package,
llama-server's /completion and the ZeroMQ request API, and every answer that ends with `stop`
validates against its schema; a random model says nothing valid unless the constraint makes it."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from skippy_zmq.client import Client
from skippy_zmq.launch.topology import free_tcp_ports
from tests.conftest import TINY_GEMMA3_LAYERS
from tests.gateway.test_command import Gateway, serving
from tests.pipeline_helpers import running, write_topology

pytestmark = pytest.mark.slow
pytest.importorskip("llguidance")

PERSON = {"type": "object", "additionalProperties": False, "required": ["color", "count", "ok"],
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 99},
                         "ok": {"type": "boolean"}}}
MESSAGES: Any = [{"role": "user", "content": "Describe the box as JSON."}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_path: Path) -> Iterator[tuple[Gateway, str]]:
    directory = tmp_path_factory.mktemp("structured")
    topology = write_topology(directory, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2, lane_count=8, ctx_size=512)
    zmq_endpoint = f"tcp://127.0.0.1:{free_tcp_ports(1)[0]}"
    with running(topology), serving("--topology", str(topology), "--zmq-bind", zmq_endpoint) as served:
        served.wait_healthy()
        yield served, zmq_endpoint


def test_json_schema_answers_validate_whole_streamed_and_for_every_choice(gateway: tuple[Gateway, str]) -> None:
    client = gateway[0].client()
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "box", "schema": PERSON, "strict": True}}
    whole = client.chat.completions.create(model="tiny-gemma3", messages=MESSAGES, response_format=response_format, n=2,
                                           temperature=0.9, seed=5, max_tokens=240, presence_penalty=0.5)
    assert len(whole.choices) == 2
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    stream = client.chat.completions.create(model="tiny-gemma3", messages=MESSAGES, response_format=response_format,
                                            temperature=0, max_tokens=240, stream=True)
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_the_budget_ending_first_is_length_and_json_object_gives_an_object(gateway: tuple[Gateway, str]) -> None:
    client = gateway[0].client()
    long_string: Any = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 200}}, "required": ["text"]}}}
    cut = client.chat.completions.create(model="tiny-gemma3", messages=MESSAGES, response_format=long_string, max_tokens=6)
    assert cut.choices[0].finish_reason == "length"
    assert (cut.choices[0].message.content or "").lstrip().startswith("{")
    plain = client.completions.create(model="tiny-gemma3", prompt="JSON:", max_tokens=40, temperature=0,
                                      extra_body={"response_format": {"type": "json_object"}})
    text = plain.choices[0].text
    if plain.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")


def test_llama_server_fields_grammar_json_schema_and_a_regex_with_logprobs_and_bias(
        gateway: tuple[Gateway, str]) -> None:
    served = gateway[0]
    for body, pattern in (
        ({"prompt": "Answer:", "grammar": 'root ::= ("yes" | "no") "."', "n_predict": 10}, r"(yes|no)\."),
        ({"prompt": "Answer:", "json_schema": {"enum": ["alpha", "beta"]}, "n_predict": 10}, r'"(alpha|beta)"'),
        ({"prompt": "Code:", "regex": "[a-z]{3}-[0-9]{2}", "n_predict": 12, "n_probs": 2, "temperature": 0.7,
          "seed": 3, "repeat_penalty": 1.3, "logit_bias": [[5, -100.0]]}, r"[a-z]{3}-[0-9]{2}"),
    ):
        request = urllib.request.Request(served.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.loads(response.read())
        assert re.fullmatch(pattern, answer["content"]), answer["content"]
        assert answer["stop_type"] == "eos"
        if "n_probs" in body:
            assert len(answer["completion_probabilities"]) >= 6


def test_a_bad_schema_or_grammar_is_a_400_naming_where(gateway: tuple[Gateway, str]) -> None:
    client = gateway[0].client()
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}},
         "response_format.json_schema.schema", r"\$\.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "cannot enforce"),
        ({"grammar": "root ::= nothing"}, "grammar", "Rule 'nothing' not found"),
        ({"regex": "a", "json_schema": {}}, "regex", "json_schema and regex both constrain the text"),
        ({"regex": "("}, "regex", "unclosed group"),
    ]
    for extra, param, match in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny-gemma3", messages=MESSAGES, max_tokens=4, extra_body=extra)
        assert refused.value.param == param
        assert re.search(match, str(refused.value.message)), refused.value.message


def test_the_zeromq_client_takes_the_same_fields(gateway: tuple[Gateway, str]) -> None:
    with Client(gateway[1], timeout_s=30) as client:
        out = client.chat(MESSAGES, max_tokens=240, temperature=0,
                          response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": PERSON}})
        jsonschema.validate(json.loads(out.text), PERSON)
