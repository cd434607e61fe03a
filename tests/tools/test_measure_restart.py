"""tools/measure_restart.py: a driver restart measured under `up`, CI-sized (docs/PROTOCOL.md §6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.driver.test_restart import RESTART_BUDGET_S
from tests.tools import run_tool


@pytest.mark.slow
def test_the_tool_runs_the_scenario_under_up(tiny_gemma3_path: Path) -> None:
    """The tiny model, two lanes, one thread per stage (the tool's docstring says why)."""
    done = run_tool("measure_restart", "--model", str(tiny_gemma3_path), "--lanes", "2", "--threads", "1", "--json",
                    timeout_s=240)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["status"] == 200 and result["identical"] and result["text"]
    assert result["restart_to_first_completion_s"] < RESTART_BUDGET_S
