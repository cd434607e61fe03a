"""Tests of skippy_zmq.ort_options: the shared ONNX Runtime session options."""

from __future__ import annotations

import pytest

from skippy_zmq import ort_options


@pytest.mark.parametrize("threads", [1, 2])
def test_the_options_run_one_graph_on_the_given_threads_which_never_spin(threads: int) -> None:
    ort = pytest.importorskip("onnxruntime")
    options = ort_options.sleeping_threads(ort, threads)
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (threads, 1)
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
