"""Gemma 3 270M through a real 3-stage pipeline reproduces llama.cpp's greedy tokens: on the
float32 kernel those of llama.cpp's F32 reference, on the ggml kernel those of llama.cpp on the
same file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REFERENCE = Path(__file__).parent / "data" / "llama_cpp" / "gemma3_prompts.json"
GREEDY_TOKENS = 24


@pytest.mark.slow
def test_three_stage_gemma3_reproduces_llama_cpp_greedy_tokens(gemma3_270m_path: Path) -> None:
    reference = json.loads(REFERENCE.read_text())["prompts"]
    prompts = [case["prompt"] for case in reference]
    results = _generate(gemma3_270m_path, prompts, "onnxruntime")
    for result, case in zip(results, reference, strict=True):
        assert result["prompt_ids"] == case["prompt_ids"], case["prompt"]
        expected = case["greedy_ids_f32"]
        # llama.cpp's run was recorded past EOS; ours stops at EOS (and reports it).
        if 1 in expected:
            expected = expected[: expected.index(1) + 1]
        assert result["tokens"] == expected, case["prompt"]
        assert [s["stage_index"] for s in result["stats"]["stages"]] == [0, 1, 2]


def _generate(model: Path, prompts: list[str], kernel: str) -> list[dict[str, Any]]:
    """`skippy-zmq generate --stages 3` on `kernel`, greedy, one JSON result per prompt."""
    done = subprocess.run(
        [sys.executable, "-m", "skippy_zmq.cli", "generate", "--model", str(model),
         "--stages", "3", "--codec-policy", "auto-lossless-v1", "--temperature", "0",
         # The float32 oracle tests keep f32: the references ran llama.cpp with an F32 cache.
         "--cache-type-k", "f32", "--cache-type-v", "f32",
         "--max-tokens", str(GREEDY_TOKENS), "--json", *prompts],
        capture_output=True, text=True, timeout=1200, check=False,
        # ...and the bit-exact comparison plain buffers: llama.cpp's oracle runs without repacked weights.
        env={**os.environ, "SKIPPY_ZMQ_KERNEL": kernel, "SKIPPY_ZMQ_REPACK": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["prompt"] for r in results] == prompts
    return results


@pytest.mark.slow
def test_three_stage_gemma3_on_ggml_gives_llama_cpps_tokens_on_the_same_file(gemma3_270m_path: Path) -> None:
    # The ggml kernel computes llama.cpp's graph from the same blocks (docs/ARCHITECTURE.md,
    # "Kernels"): three stages give llama.cpp's own greedy tokens on the Q4_K_M file.
    from tests.pipeline_helpers import plain_llama

    # One prompt per run: sessions decoded in one batch go through products of more rows, whose
    # last bits differ (in llama.cpp too, between its batch sizes), and llama.cpp runs them alone.
    prompts = [case["prompt"] for case in json.loads(REFERENCE.read_text())["prompts"]][:3]
    results = [_generate(gemma3_270m_path, [prompt], "ggml")[0] for prompt in prompts]
    llm = plain_llama(gemma3_270m_path, n_ctx=512, n_threads=2)
    for result in results:
        llm.reset()
        expected = []
        for token in llm.generate(result["prompt_ids"], temp=0.0, reset=True):
            expected.append(int(token))
            if token == 1 or len(expected) == GREEDY_TOKENS:
                break
        assert result["tokens"] == expected, result["prompt"]
