"""llama-server's request fields end to end: `serve` over two real stages of a random-weight Gemma 3
answers a batch of /completion prompts, post-sampling probabilities computed by the final stage's
sampler, `response_fields`, a continued assistant message with its `__verbose` prompt, and the chat
prompt's token count (docs/PROTOCOL.md §9.2, §9.6)."""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_GEMMA3_LAYERS
from tests.gateway.test_command import Gateway, serving
from tests.pipeline_helpers import running, write_topology

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_path: Path) -> Iterator[Gateway]:
    directory = tmp_path_factory.mktemp("llama_fields")
    topology = write_topology(directory, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2, lane_count=4, ctx_size=256)
    with running(topology), serving("--topology", str(topology)) as served:
        served.wait_healthy()
        yield served


def post(gateway: Gateway, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(gateway.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read().decode()
    if response.headers.get("Content-Type", "").startswith("text/event-stream"):
        return [json.loads(block.removeprefix("data: ")) for block in raw.split("\n\n") if block]
    return json.loads(raw)


def test_a_batch_of_prompts_answers_each_as_its_own_request(gateway: Gateway) -> None:
    ids = post(gateway, "/tokenize", {"content": "Once upon a time", "add_special": True})["tokens"]
    body = {"n_predict": 6, "temperature": 0, "response_fields": ["index", "content", "tokens_evaluated"]}
    answers = post(gateway, "/completion", body | {"prompt": [ids, "Once upon a time", {"prompt_string": "Hi"}]})
    assert [answer["index"] for answer in answers] == [0, 1, 2]
    assert answers[0] == answers[1] | {"index": 0}  # the same prompt as ids and as text: the same greedy text
    assert answers[0]["tokens_evaluated"] == len(ids) and set(answers[0]) == {"index", "content", "tokens_evaluated"}
    events = post(gateway, "/completion", {"prompt": [ids, ids], "n_predict": 4, "temperature": 0, "stream": True})
    texts = {index: "".join(e["content"] for e in events if e["index"] == index) for index in (0, 1)}
    assert texts[0] == texts[1] == answers[0]["content"][: len(texts[0])]
    assert sorted(e["index"] for e in events if e["stop"]) == [0, 1]


def test_post_sampling_probabilities_are_the_samplers_renormalised_candidates(gateway: Gateway) -> None:
    body = {"prompt": "The sky is", "n_predict": 5, "n_probs": 10, "post_sampling_probs": True, "seed": 7}
    sampled = post(gateway, "/completion", body | {"temperature": 1.0, "top_k": 4})
    plain = post(gateway, "/completion", body | {"temperature": 1.0, "top_k": 4, "post_sampling_probs": False})
    assert sampled["content"] == plain["content"]  # asking for them does not change what is sampled
    assert len(sampled["completion_probabilities"]) == 5
    for entry in sampled["completion_probabilities"]:
        top = entry["top_probs"]
        assert 1 <= len(top) <= 4 and all(0.0 < alt["prob"] <= 1.0 for alt in top)  # top_k 4 kept at most 4
        assert math.fsum(alt["prob"] for alt in top) == pytest.approx(1.0, abs=1e-5)
        assert entry["prob"] == next(alt["prob"] for alt in top if alt["id"] == entry["id"])
        assert "logprob" not in entry and "top_logprobs" not in entry
    greedy = post(gateway, "/completion", body | {"temperature": 0})
    assert all([alt["prob"] for alt in entry["top_probs"]] == [1.0] for entry in greedy["completion_probabilities"])


def test_a_final_assistant_message_is_continued_and_counted(gateway: Gateway) -> None:
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    answer = post(gateway, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "verbose": True})
    prompt = answer["__verbose"]["prompt"]
    assert prompt.endswith("model\nThe color is") and answer["timings"]["predicted_n"] == 3
    counted = post(gateway, "/v1/chat/completions/input_tokens", {"messages": messages})
    assert counted == {"input_tokens": answer["usage"]["prompt_tokens"], "object": "response.input_tokens"}
