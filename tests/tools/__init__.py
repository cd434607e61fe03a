"""Tests of tools/, one file per tool: a tool is imported as the package `tools` (`from tools import
chaos`; the repository's root is on sys.path under pytest, and this folder is `tests.tools`), or run
as `python3 -m tools.NAME` from that root by `run_tool`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_tool(name: str, *args: str, timeout_s: float, env: Mapping[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    """`python3 -m tools.NAME ARGS` from the repository's root, so the tool and the processes it starts
    import this checkout's package; its output captured as text, its run bounded by `timeout_s`."""
    return subprocess.run([sys.executable, "-m", f"tools.{name}", *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False, cwd=REPO, env=None if env is None else dict(env))
