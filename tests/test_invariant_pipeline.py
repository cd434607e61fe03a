"""The batch-invariant mode end to end (docs/ARCHITECTURE.md, "Batch-invariant mode"): Gemma 3 270M over two
real stage processes started with it; a seeded generation killed (-9) mid-way at a stage replays to the very
text an uninterrupted run gives, alone or with micro-batches, and a turn served from the prompt cache gives the
text the same turn gives fresh, where llama.cpp's kernels give other texts (checked by hand: without the mode
the micro-batch replay and the cached turn differ)."""

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


def _generate(supervised: Supervised, *, kill: bool, micro_batches: int = 1) -> list[GenerationResult]:
    topology = supervised.pipeline.topology
    pieces, killed = 0, []

    def on_text(_index: int, _piece: str) -> None:
        nonlocal pieces
        pieces += 1
        if kill and pieces == KILL_AFTER:
            os.kill(supervised.pid(0), signal.SIGKILL)
            killed.append(pieces)

    requests = [GenerationRequest(prompt=prompt, max_tokens=MAX_TOKENS, sampling=SEEDED) for prompt in PROMPTS]
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


def test_a_turn_served_from_the_prompt_cache_gives_the_text_the_same_turn_gives_fresh(gemma3_270m_path: Path
                                                                                    ) -> None:
    """`serve --batch-invariant`: a request that continues a kept session (the prompt cache) and the same
    request with `cache_prompt: false` give one text, streamed or not (llama-server's
    test_completion_stream_vs_non_stream on this file)."""
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
    pieces = [json.loads(line.removeprefix("data: ")) for line in streamed.splitlines() if line.startswith("data: ")]
    assert cached["tokens_cached"] > 0, "the second request did not continue the first's kept session"
    assert fresh["content"] == first["content"] == cached["content"]
    assert "".join(piece.get("content", "") for piece in pieces) == fresh["content"]
