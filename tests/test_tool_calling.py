"""Tool calling end to end: `serve` over two real stages answers the `openai` package's tool loop (a
call, its result sent back, a final answer), streamed and not, with `n` 2, on a random-weight Gemma 3
without a chat template (llama-server's generic format) and a random-weight Qwen 3 with Qwen 3's
template (Hermes `<tool_call>` format). The calls of a random model are valid only because the
final stage constrains them."""

from __future__ import annotations

import json
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
from tests.pipeline_helpers import family_tokenizer, running, write_topology

pytestmark = pytest.mark.slow
pytest.importorskip("llguidance")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
        "type": "object", "properties": {"word": {"type": "string", "maxLength": 10}}, "required": ["word"],
        "additionalProperties": False}}},
]
MESSAGES: Any = [{"role": "system", "content": "You call tools."},
                 {"role": "user", "content": "What is the weather in Paris?"}]
BUDGET = 400


@pytest.fixture(scope="module", params=["gemma3-generic", "qwen3-hermes"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           tiny_gemma3_path: Path) -> Iterator[tuple[Gateway, str]]:
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3-generic":
        model, layers, name = tiny_gemma3_path, TINY_GEMMA3_LAYERS, "tiny-gemma3"
    else:
        from skippy_zmq.testing.random_model import SHAPES, write_random_model

        model = write_random_model(directory / "qwen3-mini.gguf", SHAPES["qwen3-mini"], seed=3, output_gain=0.5,
                                   tokenizer=family_tokenizer("qwen2", "Qwen-Qwen3-0.6B"))
        layers, name = 6, "qwen3-mini"
    topology = write_topology(directory, model, layers, 2, lane_count=8, ctx_size=2048)
    endpoint = f"tcp://127.0.0.1:{free_tcp_ports(1)[0]}"
    # Qwen 3's template thinks: a random model's thought would spend the budget before its call
    # (a thought before a call is reasoning.thought_first's, tested in tests/gateway/test_reasoning.py).
    thought = ["--reasoning", "off"] if name == "qwen3-mini" else []
    with running(topology), serving("--topology", str(topology), "--zmq-bind", endpoint, *thought) as gateway:
        gateway.wait_healthy()
        gateway.zmq_endpoint = endpoint  # type: ignore[attr-defined]
        yield gateway, name


def check_call(call: Any, name: str = "get_weather") -> dict[str, Any]:
    assert call.type == "function" and call.function.name == name and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER if name == "get_weather" else TOOLS[1]["function"]["parameters"])
    return arguments  # type: ignore[no-any-return]


def test_the_whole_loop_a_call_its_result_and_an_answer(served: tuple[Gateway, str]) -> None:
    gateway, model = served
    client = gateway.client(timeout_s=120)
    first = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=BUDGET, n=2, temperature=0.8, seed=4)
    assert len(first.choices) == 2
    for choice in first.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "lookup")
            check_call(call, call.function.name)
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    followed: Any = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    final = client.chat.completions.create(model=model, messages=followed, tools=TOOLS, tool_choice="none",
                                           max_tokens=16, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content is not None


def test_a_named_function_streamed_arrives_whole_with_its_index(served: tuple[Gateway, str]) -> None:
    gateway, model = served
    client = gateway.client(timeout_s=120)
    named: Any = {"type": "function", "function": {"name": "lookup"}}
    stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                            max_tokens=BUDGET, temperature=0, stream=True, parallel_tool_calls=False)
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                entry = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += piece.id or ""
                entry["name"] += (piece.function.name or "") if piece.function else ""
                entry["arguments"] += (piece.function.arguments or "") if piece.function else ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"] and list(calls) == [0]
    assert calls[0]["name"] == "lookup" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOLS[1]["function"]["parameters"])
    whole = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                           max_tokens=BUDGET, temperature=0, parallel_tool_calls=False)
    assert whole.choices[0].message.tool_calls is not None
    assert [c.function.arguments for c in whole.choices[0].message.tool_calls] == [calls[0]["arguments"]]


def test_auto_answers_text_or_valid_calls(served: tuple[Gateway, str]) -> None:
    gateway, model = served
    client = gateway.client(timeout_s=120)
    for seed in range(3):
        out = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=48,
                                             temperature=1.0, seed=seed)
        choice = out.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                check_call(call, call.function.name)
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content is not None


def test_a_tool_whose_parameters_are_not_a_schema_is_a_400_naming_it(served: tuple[Gateway, str]) -> None:
    gateway, model = served
    bad: Any = [TOOLS[0], {"type": "function", "function": {"name": "broken", "parameters": {"type": 5}}}]
    with pytest.raises(openai.BadRequestError) as refused:
        gateway.client().chat.completions.create(model=model, messages=MESSAGES, tools=bad, max_tokens=4)
    assert refused.value.param == "tools[1].function.parameters.type"
    with pytest.raises(openai.BadRequestError) as both:
        gateway.client().chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                                 response_format={"type": "json_object"})
    assert both.value.param == "tools"


def test_the_zeromq_client_gets_the_calls_in_its_final_frame(served: tuple[Gateway, str]) -> None:
    gateway, _ = served
    with Client(gateway.zmq_endpoint, timeout_s=120) as client:  # type: ignore[attr-defined]
        out = client.chat(MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=BUDGET, temperature=0)
    assert out.finish_reason == "tool_calls" and out.tool_calls
    for call in out.tool_calls:
        schema = WEATHER if call.name == "get_weather" else TOOLS[1]["function"]["parameters"]
        jsonschema.validate(json.loads(call.arguments), schema)
    assert out.choices[0].content is not None and call.name in out.text
