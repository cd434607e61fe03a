"""End to end on an expert file: a Qwen 3 MoE-shaped file with Qwen's own vocabulary and chat template,
served over three stage processes like any other file (continuous batching, micro-batches, the prompt
cache, n choices, logprobs, streaming), and replayed to the same text after a stage's kill -9."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skippy_zmq.model.gguf_model import GGUFModel
from skippy_zmq.tokens.tokenizer import Tokenizer
from tests.gateway.test_command import Gateway, _post, serving
from tests.pipeline_helpers import family_tokenizer, reference_greedy, write_topology
from tests.test_survival import MODES, Supervised, run

pytestmark = pytest.mark.slow  # real stage processes on 127.0.0.1

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time", "Grüße aus 東京")
MAX_TOKENS = 16


def _qwen_moe(directory: Path, mix: str) -> Path:
    """qwen3moe-mini (6 layers of 16 experts, 4 used) in llama.cpp's `mix`, with Qwen's vocabulary
    (llama.cpp's ggml-vocab-qwen2.gguf) and Qwen 3's chat template."""
    from skippy_zmq.testing.random_model import SHAPES, mix_named, write_random_model

    return write_random_model(directory / "qwen3moe-mini.gguf", SHAPES["qwen3moe-mini"],
                              tokenizer=family_tokenizer("qwen2", "Qwen-Qwen3-0.6B"), seed=11, output_gain=0.5,
                              mix=mix_named(mix))


@pytest.fixture(scope="module")
def qwen_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Q4_K_M file: Q4_K experts, repacked by the stages."""
    return _qwen_moe(tmp_path_factory.mktemp("moe"), "Q4_K_M")


@pytest.fixture(scope="module")
def references(qwen_moe_path: Path) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from one in-process runtime holding every layer."""
    tokenizer = Tokenizer.from_gguf(qwen_moe_path)
    eog = set(tokenizer.eog_ids)
    return {p: reference_greedy(qwen_moe_path, tokenizer.encode(p), MAX_TOKENS, eog) for p in PROMPTS}


@pytest.fixture(scope="module")
def gateway(qwen_moe_path: Path) -> Iterator[Gateway]:
    """`serve` on the file over 3 stages, 4 lanes in 2 micro-batch groups."""
    with serving("--model", str(qwen_moe_path), "--stages", "3", "--lanes", "4", "--ctx-size", "256",
                 "--micro-batches", "2") as gateway:
        gateway.wait_healthy(120)
        yield gateway
        assert gateway.stop() == 0


def _completion(gateway: Gateway, prompt: str) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0, "return_tokens": True}
    answer: dict[str, Any] = _post(gateway, "/completion", body)
    return answer


def test_concurrent_greedy_requests_get_one_processs_tokens(gateway: Gateway, references: dict[str, list[int]]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # 4 sessions in 2 micro-batches, rows of many experts
        answers = list(pool.map(lambda p: _completion(gateway, p), PROMPTS))
    assert [a["tokens"] for a in answers] == [references[p] for p in PROMPTS]
    assert len({tuple(a["tokens"]) for a in answers}) == len(PROMPTS)
    again = _completion(gateway, PROMPTS[0])  # its prompt now from the prompt cache
    assert again["tokens"] == references[PROMPTS[0]] and again["tokens_cached"] > 0


def test_choices_logprobs_and_streams_on_an_expert_file(gateway: Gateway, references: dict[str, list[int]]) -> None:
    client = gateway.client(timeout_s=60)
    prompt = PROMPTS[2]
    whole = client.completions.create(model="qwen3moe-mini", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      logprobs=2)
    streamed = client.completions.create(model="qwen3moe-mini", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == whole.choices[0].text
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None and logprobs.token_logprobs is not None
    assert all(max(top.values()) == pytest.approx(lp) for top, lp in zip(logprobs.top_logprobs,
                                                                          logprobs.token_logprobs, strict=True))
    runs = []
    for _ in range(2):
        chat = client.chat.completions.create(model="qwen3moe-mini", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=8, n=3, seed=42, temperature=1.2)
        assert [choice.index for choice in chat.choices] == [0, 1, 2]
        runs.append([choice.message.content for choice in chat.choices])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    # Q8_0, as the dense survival tests' file: a replay prefills in chunks what the original decoded
    # a row at a time, and ggml's products give a row the same bits either way only where no kernel
    # changes with the row count. Repacked Q4_K takes its 4-row GEMM for a chunk where a decode step
    # took the GEMV, so a Q4_K_M file replays to the same text only where no margin is that thin
    # (docs/PROTOCOL.md §7, "Batched and alone"; an expert file has more such ties: its routing).
    directory = tmp_path_factory.mktemp("moe-recovery")
    path = _qwen_moe(directory, "Q8_0")
    topology = write_topology(directory, path, GGUFModel(path).hparams.n_layer, 3)
    with Supervised(topology) as supervised:
        yield supervised


@pytest.mark.parametrize("mode", sorted(MODES))
def test_kill_9_of_a_stage_of_an_expert_file_replays_to_identical_text(supervised: Supervised, mode: str) -> None:
    uninterrupted = run(supervised, MODES[mode])
    before = supervised.pid(1)
    results = run(supervised, MODES[mode], hit=(1, signal.SIGKILL))
    assert supervised.pid(1) != before, "the stage was not restarted"
    for got, want in zip(results, uninterrupted, strict=True):
        assert got.error is None, got.error
        assert got.tokens == want.tokens and got.text == want.text
    assert sum(r.replays for r in results) >= 1
