"""Fixtures the gateway's tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_path: Path) -> Iterator[Any]:
    """Two running stages of the tiny Gemma 3 (context 1024, 8 lanes each): the `LocalPipeline` behind
    `tiny_serve`, for tests that stop one of its processes (each must leave it running again)."""
    from tests.conftest import TINY_GEMMA3_LAYERS
    from tests.pipeline_helpers import running, write_topology

    topology = write_topology(tmp_path_factory.mktemp("tiny-serve"), tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2,
                              ctx_size=1024)
    with running(topology) as pipeline:
        yield pipeline


@pytest.fixture(scope="session")
def tiny_serve(tiny_pipeline: Any) -> Iterator[Any]:
    """A real `serve --reranking --tags chat,small --prefill-chunk 16` over two stages of the tiny Gemma 3
    (context 1024), healthy; shared by the translated routes', /rerank's, the progress reports' and the web
    page's end-to-end tests (a prompt of more than 16 tokens runs in several chunks)."""
    from tests.gateway.test_command import serving

    options = ("--reranking", "--tags", "chat,small", "--prefill-chunk", "16")
    with serving("--topology", str(tiny_pipeline.topology_path), *options) as gateway:
        gateway.wait_healthy()
        yield gateway
