"""tools/greedy_llama_cpp.py: llama.cpp's greedy tokens and margins on a small random shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skippy_zmq.testing.random_model import SHAPES, write_random_model
from tests.tools import run_tool


@pytest.mark.slow
def test_the_tool_reports_llama_cpps_tokens_and_margins(tmp_path: Path) -> None:
    path = write_random_model(tmp_path / "m.gguf", SHAPES["llama3-mini"], seed=4)
    done = run_tool("greedy_llama_cpp", str(path), "--tokens", "5", "--n-ctx", "64", "--threads", "1", timeout_s=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["finite"] is True and len(report["tokens"]) == len(report["margins"]) == 5
    assert all(margin >= 0 for margin in report["margins"]) and report["logit_std"] > 0
