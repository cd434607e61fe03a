"""One decode step of the whole model in one process: layers and head, at a batch of B sessions.

    python3 tools/bench_step.py --threads 2 --batch 16 [--kernel onnxruntime|numpy]

The runtime's own ceiling for a serving benchmark at that many clients (docs/BENCHMARKS.md).
`--kernel` sets $SKIPPY_ZMQ_KERNEL (skippy_zmq/runtime/kernels.py) for this run.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    """Time `forward_batch` and `logits` + argmax over 10 steps after 2 warm-up steps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="BLAS threads")
    parser.add_argument("--batch", type=int, default=16, help="sessions per step")
    parser.add_argument("--kernel", default=None, help="matrix kernel (default: $SKIPPY_ZMQ_KERNEL, else onnxruntime)")
    args = parser.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # before numpy loads
    if args.kernel is not None:
        os.environ["SKIPPY_ZMQ_KERNEL"] = args.kernel
    import numpy as np

    from skippy_zmq.model.catalog import ensure_gemma3_270m
    from skippy_zmq.runtime.stage import StageRuntime

    runtime = StageRuntime.load(ensure_gemma3_270m(), 0, 18, ctx_size=512)
    sessions = list(range(args.batch))
    for session in sessions:
        runtime.open_session(session)
        runtime.forward(session, 0, np.array([2, 100, 200, 300], np.int32))
    tokens = np.full(args.batch, 500, np.int32)
    layers, head = [], []
    for step in range(12):
        started = time.perf_counter()
        hidden = runtime.forward_batch(sessions, [4 + step] * args.batch, tokens)
        middle = time.perf_counter()
        runtime.logits(hidden).argmax(axis=1)
        layers.append(middle - started)
        head.append(time.perf_counter() - middle)
    layers_ms, head_ms = np.median(layers[2:]) * 1000, np.median(head[2:]) * 1000
    kernel = runtime.kernel.name
    print(f"{kernel} threads {args.threads} batch {args.batch}: layers {layers_ms:.1f} ms, head {head_ms:.1f} ms, "
          f"{args.batch / (layers_ms + head_ms) * 1000:.1f} tok/s")


if __name__ == "__main__":
    main()
