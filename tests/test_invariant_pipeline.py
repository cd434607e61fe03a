"""The batch-invariant mode end to end (docs/ARCHITECTURE.md, "Batch-invariant mode"): Gemma 3 270M over two
real stage processes started with it; a seeded generation killed (-9) mid-way at a stage replays to the very
text an uninterrupted run gives, alone or with micro-batches, and a turn served from the prompt cache gives the
text the same turn gives fresh, where llama.cpp's kernels give other texts (checked by hand: without the mode
the micro-batch replay and the cached turn differ). Speculative decoding on top of it gives the text of one token a
step, killed or not, and through serve's routes (docs/PROTOCOL.md §6, Speculative decoding)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from skippy_zmq.defaults import BATCH_INVARIANT_ENV
from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.model.gguf_model import GGUFModel
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer
from tests.pipeline_helpers import write_topology
from tests.test_survival import Supervised

pytestmark = pytest.mark.slow  # the real model over real worker processes

PROMPTS = ("The history of the printing press", "Once upon a time, in a city by the sea,", "def fibonacci(n):")
MAX_TOKENS = 40
KILL_AFTER = 12  # text pieces streamed before stage 0 is killed
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=4321, ignore_eos=True)


@pytest.fixture(scope="module")
def invariant(tmp_path_factory: pytest.TempPathFactory, gemma3_270m_path: Path) -> Iterator[Supervised]:
    """Two stages of Gemma 3 270M in the batch-invariant mode, restarted when killed (as `up` runs them)."""
    n_layer = GGUFModel(gemma3_270m_path).hparams.n_layer
    topology = write_topology(tmp_path_factory.mktemp("invariant"), gemma3_270m_path, n_layer, 2, ctx_size=512)
    previous = os.environ.get(BATCH_INVARIANT_ENV)
    os.environ[BATCH_INVARIANT_ENV] = "1"  # the stage processes inherit it, as `up --batch-invariant` sets it
    try:
        with Supervised(topology) as supervised:
            yield supervised
    finally:
        if previous is None:
            os.environ.pop(BATCH_INVARIANT_ENV, None)
        else:
            os.environ[BATCH_INVARIANT_ENV] = previous


GROUNDED = ("Copy the list: red, orange, yellow, green, blue, indigo, violet, black, white, grey. Once more: red, "
            "orange, yellow,",
            "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n"
            "# the same two functions again\ndef area(w, h):\n")
"""Prompts whose continuations repeat their own text (a list, code): the drafts are accepted."""


def _generate(supervised: Supervised, *, kill: bool, micro_batches: int = 1, draft_max: int = 0,
              prompts: tuple[str, ...] = PROMPTS, sampling: SamplingParams = SEEDED,
              kill_after: int = KILL_AFTER) -> list[GenerationResult]:
    topology = supervised.pipeline.topology
    pieces, killed = 0, []

    def on_text(_index: int, _piece: str) -> None:
        nonlocal pieces
        pieces += 1
        if kill and pieces == kill_after:
            os.kill(supervised.pid(0), signal.SIGKILL)
            killed.append(pieces)

    requests = [GenerationRequest(prompt=prompt, max_tokens=MAX_TOKENS, sampling=sampling, draft_max=draft_max)
                for prompt in prompts]
    settings = SchedulerSettings(silence_s=3.0, reply_timeout_s=120.0, recovery_timeout_s=120.0,
                                 micro_batches=micro_batches)
    with PipelineTransport(topology, Tokenizer.from_gguf(Path(topology.model)), settings) as client:
        client.wait_ready(120.0)
        results = client.generate(requests, on_text)
    assert not kill or killed, "stage 0 was never killed: the generation was too short"
    return results


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_kill_9_mid_generation_replays_to_the_uninterrupted_text(invariant: Supervised,
                                                                   micro_batches: int) -> None:
    want = _generate(invariant, kill=False)
    got = _generate(invariant, kill=True, micro_batches=micro_batches)
    for result, reference in zip(got, want, strict=True):
        assert result.error is None, result.error
        assert result.tokens == reference.tokens, (result.text, reference.text)
    assert sum(result.replays for result in got) >= 1
    assert invariant.gave_up is None


@pytest.mark.parametrize("sampling", [SamplingParams.greedy(), SEEDED], ids=["greedy", "seeded"])
def test_drafted_decode_steps_give_the_text_of_one_token_a_step(invariant: Supervised,
                                                                  sampling: SamplingParams) -> None:
    want = _generate(invariant, kill=False, prompts=GROUNDED, sampling=sampling)
    got = _generate(invariant, kill=False, prompts=GROUNDED, sampling=sampling, draft_max=8)
    for result, reference in zip(got, want, strict=True):
        assert result.error is None, result.error
        assert result.tokens == reference.tokens, (result.text, reference.text)
    assert sum(result.drafts_accepted for result in got) >= MAX_TOKENS // 2, [r.drafts_accepted for r in got]


def test_a_kill_9_in_the_middle_of_drafted_steps_replays_to_the_same_text(invariant: Supervised) -> None:
    want = _generate(invariant, kill=False, prompts=GROUNDED)
    got = _generate(invariant, kill=True, prompts=GROUNDED, draft_max=8, kill_after=4)
    for result, reference in zip(got, want, strict=True):
        assert result.error is None, result.error
        assert result.tokens == reference.tokens, (result.text, reference.text)
    assert sum(result.replays for result in got) >= 1
    assert sum(result.drafts_accepted for result in got) > 0


def test_a_turn_served_from_the_prompt_cache_gives_the_text_the_same_turn_gives_fresh(gemma3_270m_path: Path
                                                                                    ) -> None:
    """`serve --batch-invariant`: a request that continues a kept session (the prompt cache) and the same
    request with `cache_prompt: false` give one text, streamed or not (llama-server's
    test_completion_stream_vs_non_stream on this file). Drafts are on by default in this mode (--draft-max 16):
    a request without them (speculative.n_max 0) gives the text the default gives, whose timings count its
    drafts as llama-server's do."""
    import requests

    from tests.gateway.test_command import serving

    body = {"prompt": "I believe the meaning of life is", "n_predict": 48, "temperature": 0.8, "seed": 42}
    with serving("--model", str(gemma3_270m_path), "--stages", "2", "--ctx-size", "512",
                 "--batch-invariant") as gateway:
        gateway.wait_healthy(120)
        fresh = requests.post(f"{gateway.url}/completion", json=body | {"cache_prompt": False}, timeout=300).json()
        first = requests.post(f"{gateway.url}/completion", json=body, timeout=300).json()
        cached = requests.post(f"{gateway.url}/completion", json=body, timeout=300).json()
        streamed = requests.post(f"{gateway.url}/completion", json=body | {"stream": True}, timeout=300).text
        grounded = {"prompt": GROUNDED[0], "n_predict": 32, "temperature": 0.8, "seed": 42, "cache_prompt": False}
        plain = requests.post(f"{gateway.url}/completion", json=grounded | {"speculative.n_max": 0},
                              timeout=300).json()
        drafted = requests.post(f"{gateway.url}/completion", json=grounded, timeout=300).json()  # serve's 16
        metrics = requests.get(f"{gateway.url}/metrics", timeout=60).text
    counters = {line.split()[0].removeprefix("llamacpp:spec_decode_"): float(line.split()[1])
                for line in metrics.splitlines() if line.startswith("llamacpp:spec_decode_")}
    # every request's drafts, the drafted one's among them, as llama-server counts its own
    assert counters["num_draft_tokens_total"] >= drafted["timings"]["draft_n"] > 0
    assert counters["num_accepted_tokens_total"] >= drafted["timings"]["draft_n_accepted"]
    assert counters["num_drafts_total"] > 0
    assert drafted["content"] == plain["content"]
    assert drafted["timings"]["draft_n_accepted"] > 0 and "draft_n" not in plain["timings"]
    pieces = [json.loads(line.removeprefix("data: ")) for line in streamed.splitlines() if line.startswith("data: ")]
    assert cached["tokens_cached"] > 0, "the second request did not continue the first's kept session"
    assert fresh["content"] == first["content"] == cached["content"]
    assert "".join(piece.get("content", "") for piece in pieces) == fresh["content"]
