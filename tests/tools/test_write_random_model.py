"""tools/write_random_model.py: the command line of skippy_zmq.testing.random_model's writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippy_zmq.model.gguf_file import read_header
from tests.tools import run_tool


@pytest.mark.slow
def test_the_tool_writes_a_shape_with_a_copied_tokenizer(tmp_path: Path, tiny_gemma3_path: Path) -> None:
    out = tmp_path / "tool.gguf"
    done = run_tool("write_random_model", "--shape", "gemma3-mini", "--tokenizer-from", str(tiny_gemma3_path),
                    "--rope-scaling", "linear:4", "--seed", "5", str(out), timeout_s=120)
    assert done.returncode == 0, done.stderr
    assert "wrote blk.5.ffn_down" in done.stderr and f"wrote {out}" in done.stdout
    meta = read_header(out).metadata
    assert meta["gemma3.rope.scaling.factor"] == 4.0 and meta["general.name"].startswith("gemma3-mini-shaped, gemma3")
    bad = run_tool("write_random_model", "--shape", "gemma3-mini", "--rope-scaling", "dynamic:2",
                   str(tmp_path / "bad.gguf"), timeout_s=120)
    assert bad.returncode == 1 and "expected 'none', 'linear:FACTOR'" in bad.stderr


@pytest.mark.slow
def test_the_tool_writes_the_mix_asked_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    out = tmp_path / "q8.gguf"
    done = run_tool("write_random_model", "--shape", "llama3-mini", "--mix", "Q8_0", str(out), timeout_s=120)
    assert done.returncode == 0, done.stderr
    header = read_header(out)
    assert header.metadata["general.file_type"] == 7  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q8_0
    assert header.tensors["blk.0.attn_q.weight"].ggml_type == 8  # Q8_0
    bad = run_tool("write_random_model", "--shape", "llama3-mini", "--mix", "Q5", str(tmp_path / "bad.gguf"),
                   timeout_s=120)
    assert bad.returncode == 2 and "'Q5' is not one of" in bad.stderr
