"""tools/write_tiny_model.py: the command line of skippy_zmq.testing.tiny's writer."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tests.tools import run_tool


@pytest.mark.slow
def test_the_tool_writes_a_model(tmp_path: Path) -> None:
    out = tmp_path / "tool.gguf"
    done = run_tool("write_tiny_model", str(out), "--arch", "gemma3", "--n-layer", "6", "--sliding-window", "4",
                    timeout_s=120)
    assert done.returncode == 0, done.stderr
    fields = {k: f.contents() for k, f in gguf.GGUFReader(out).fields.items()}
    assert fields["gemma3.block_count"] == 6 and fields["gemma3.attention.sliding_window"] == 4
