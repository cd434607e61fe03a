"""Gemma 3 270M through a real 3-stage pipeline reproduces llama.cpp's greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REFERENCE = Path(__file__).parent / "data" / "llama_cpp" / "gemma3_prompts.json"
GREEDY_TOKENS = 24


@pytest.mark.slow
def test_three_stage_gemma3_reproduces_llama_cpp_greedy_tokens(gemma3_270m_path: Path) -> None:
    reference = json.loads(REFERENCE.read_text())["prompts"]
    prompts = [case["prompt"] for case in reference]
    done = subprocess.run(
        [sys.executable, "-m", "skippy_zmq.cli", "generate", "--model", str(gemma3_270m_path),
         "--stages", "3", "--codec-policy", "auto-lossless-v1", "--temperature", "0",
         "--max-tokens", str(GREEDY_TOKENS), "--json", *prompts],
        capture_output=True, text=True, timeout=1200, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["prompt"] for r in results] == prompts
    for result, case in zip(results, reference, strict=True):
        assert result["prompt_ids"] == case["prompt_ids"], case["prompt"]
        expected = case["greedy_ids_f32"]
        # llama.cpp's run was recorded past EOS; ours stops at EOS (and reports it).
        if 1 in expected:
            expected = expected[: expected.index(1) + 1]
        assert result["tokens"] == expected, case["prompt"]
        assert [s["stage_index"] for s in result["stats"]["stages"]] == [0, 1, 2]
