"""Reasoning models end to end: `serve` over two real stages of a random-weight Qwen-shaped file with
DeepSeek-R1's chat template (which opens `<think>` itself) reads each answer's thought into
`reasoning_content`, streamed and whole alike, turns thought off on request, and lets a constrained
answer follow a thought."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from skippy_zmq.gateway.reasoning import THOUGHT_MARKERS, ReasoningReader
from skippy_zmq.launch.topology import free_tcp_ports
from skippy_zmq.testing.llama_sources import template_files
from tests.gateway.test_command import Gateway, serving
from tests.pipeline_helpers import family_tokenizer, running, write_topology

pytestmark = pytest.mark.slow

R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"
MESSAGES: Any = [{"role": "user", "content": "What is 2 + 2?"}]
READER = ReasoningReader(THOUGHT_MARKERS[0], opened=True)  # the template ends the prompt with "<think>\n"
FIXED = {"cache_prompt": False}  # each request computes its prompt afresh: seeded texts compare exactly


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    from skippy_zmq.testing.random_model import SHAPES, write_random_model

    directory = tmp_path_factory.mktemp("r1")
    model = write_random_model(directory / "qwen3-mini.gguf", SHAPES["qwen3-mini"], seed=5, output_gain=0.5,
                               tokenizer=family_tokenizer("qwen2", "Qwen-Qwen3-0.6B"))
    template = next(path for path in template_files() if path.stem == R1)
    topology = write_topology(directory, model, 6, 2, lane_count=4, ctx_size=1024)
    endpoint = f"tcp://127.0.0.1:{free_tcp_ports(1)[0]}"
    with running(topology), serving("--topology", str(topology), "--chat-template-file", str(template),
                                    "--zmq-bind", endpoint) as served:
        served.wait_healthy()
        served.zmq_endpoint = endpoint  # type: ignore[attr-defined]
        yield served


def _post(gateway: Gateway, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(gateway.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def _chat(gateway: Gateway, **fields: Any) -> Any:
    client = gateway.client(timeout_s=120)
    settings: dict[str, Any] = {"max_tokens": 24, "temperature": 0.9, "seed": 11}
    extra = FIXED | fields.pop("extra", {})
    return client.chat.completions.create(model="m", messages=MESSAGES, extra_body=extra, **(settings | fields))


def test_the_prompt_opens_a_thought_unless_thought_is_off(gateway: Gateway) -> None:
    assert _post(gateway, "/apply-template", {"messages": MESSAGES})["prompt"].endswith("<think>\n")
    off = _post(gateway, "/apply-template", {"messages": MESSAGES, "reasoning_effort": "none"})["prompt"]
    assert off.endswith("<think>\n</think>")
    kwargs = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    assert _post(gateway, "/apply-template", kwargs)["prompt"] == off


def test_an_answer_s_thought_is_reasoning_content_whole_and_streamed(gateway: Gateway) -> None:
    raw = _chat(gateway, extra={"reasoning_format": "none"}).choices[0].message
    assert raw.content and getattr(raw, "reasoning_content", None) is None
    thought, content = READER.split(raw.content)
    message = _chat(gateway).choices[0].message
    assert (getattr(message, "reasoning_content", None), message.content) == (thought, content)
    assert thought  # a random model's 24 tokens hardly close the thought: most of the text is thought
    legacy = _chat(gateway, extra={"reasoning_format": "deepseek-legacy"}).choices[0].message
    assert (legacy.content, getattr(legacy, "reasoning_content", None)) == (raw.content, thought)
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in _chat(gateway, stream=True):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            streamed["reasoning_content"] += extra.get("reasoning_content") or ""
            streamed["content"] += choice.delta.content or ""
    assert streamed == {"reasoning_content": thought, "content": content}


def test_a_constrained_answer_may_follow_a_thought(gateway: Gateway) -> None:
    shape = {"response_format": {"type": "json_object"}, "max_tokens": 120}
    off = _chat(gateway, **shape, extra={"reasoning_effort": "none"}).choices[0]
    assert getattr(off.message, "reasoning_content", None) is None  # the template closed the thought
    assert off.message.content.lstrip().startswith("{")
    if off.finish_reason == "stop":
        assert isinstance(json.loads(off.message.content), dict)
    # Thought on: free text until the closing marker, then only the object (reasoning.thought_first).
    on = _chat(gateway, **shape).choices[0]
    thought, content = getattr(on.message, "reasoning_content", None), on.message.content
    assert thought  # the template opened the thought: the answer starts inside it
    if on.finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # a random model's thought may not end within the budget
        assert content == "" or content.lstrip().startswith("{")
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in _chat(gateway, **shape, stream=True)
                       if chunk.choices)
    assert streamed == content


def test_the_zmq_api_reads_the_thought_apart_too(gateway: Gateway) -> None:
    from skippy_zmq.client import Client

    raw = _chat(gateway, extra={"reasoning_format": "none"}).choices[0].message.content
    thought, content = READER.split(raw)
    with Client(gateway.zmq_endpoint) as client:  # type: ignore[attr-defined]
        final = client.chat(MESSAGES, max_tokens=24, temperature=0.9, seed=11, cache_prompt=False)
    assert final.text == raw
    assert (final.reasoning_content, final.content) == (thought, content)
