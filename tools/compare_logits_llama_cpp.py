"""Per-position logits of the ggml kernel against llama.cpp's on the same file (docs/BENCHMARKS.md,
"The ggml kernel: quality").

    python3 tools/compare_logits_llama_cpp.py ["prompt"]

Prints, for each prompt position, the largest absolute logit difference, both argmaxes and
llama.cpp's top-2 margin. llama.cpp runs with CPU buffers only (its AMX ones die on some Intel
machines) and an F32 KV cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_quality import llama_cpp_plain_buffers  # a sibling tool, found through the path above


def main() -> int:
    """Compare one prompt's logits position by position."""
    from skippy_zmq.runtime.catalog import ensure_gemma3_270m
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime
    from skippy_zmq.runtime.tokenizer import Tokenizer

    path = ensure_gemma3_270m()
    ids = Tokenizer.from_gguf(path).encode(sys.argv[1] if len(sys.argv) > 1 else "In 1969, the first humans")
    llm = llama_cpp_plain_buffers(path, n_ctx=256)  # CPU buffers, F32 KV cache, 2 threads
    llm.eval(ids)
    reference = np.array(llm.scores[: len(ids)])
    runtime = StageRuntime.load(path, 0, 18, ctx_size=256, kernel=Kernel("ggml", 2))
    runtime.open_session(1)
    logits = runtime.logits(runtime.forward(1, 0, np.array(ids, np.int32)))
    for i in range(len(ids)):
        first, second = np.sort(reference[i])[-1], np.sort(reference[i])[-2]
        print(f"position {i:3d}: max |difference| {np.abs(logits[i] - reference[i]).max():.4f}, "
              f"argmax {int(logits[i].argmax())} / llama.cpp {int(reference[i].argmax())}, "
              f"llama.cpp margin {first - second:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
