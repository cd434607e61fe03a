"""The shared defaults: plain values that the command line reads before numpy loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_zmq import defaults
from skippy_zmq.compute.kv_cache import CACHE_TYPES

SOURCE = Path(defaults.__file__)


def test_the_module_imports_nothing_but_annotations() -> None:
    imported = [node for node in ast.walk(ast.parse(SOURCE.read_text())) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert [(node.module, [a.name for a in node.names]) for node in imported if isinstance(node, ast.ImportFrom)] == [
        ("__future__", ["annotations"])]
    assert not [node for node in imported if isinstance(node, ast.Import)]


@pytest.mark.slow
def test_reading_the_defaults_loads_no_numpy() -> None:
    # the package's __init__ exports Client, which must not load numpy either (worker --threads pins BLAS first)
    code = "import sys, skippy_zmq.defaults; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_the_defaults_are_usable_values() -> None:
    assert defaults.CACHE_TYPE in defaults.CACHE_TYPE_NAMES == tuple(CACHE_TYPES)
    assert defaults.CTX_SIZE > 0 and defaults.MAX_CLIENT_REQUESTS > 0
    assert 0 < defaults.GATHER_MAX_S < 1 and 0 < defaults.REST_OF_PASS_S < 1
    assert defaults.READY_TIMEOUT_S > 0 and defaults.RECOVERY_TIMEOUT_S >= 0
