"""The session options every ONNX Runtime graph of this project shares (docs/ARCHITECTURE.md,
"Kernels"): the float32 products (`kernels`), the head's MatMulNBits (`nbits_head`) and the
logprobs normalizer (`exp_sum`)."""

from __future__ import annotations

from typing import Any


def sleeping_threads(ort: Any, threads: int) -> Any:
    """`ort.SessionOptions` for one graph run on `threads` threads that sleep, not spin, when a run
    ends: spinning threads would take the core from the stage's other work between runs (ggml's
    threads, numpy's) and from other stages sharing the host."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options
