"""Where one session's decode step spends its time, in one process (docs/BENCHMARKS.md).

    python3 tools/profile_decode.py [--kernel ggml] [--threads 2] [--steps 30]

Loads every layer of Gemma 3 270M with the kernel, decodes greedily after a 10-token prompt,
prints the mean time per token, then the top functions of a cProfile run over as many steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np


def main() -> int:
    """Time and profile the decode loop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="ggml")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    from skippy_zmq.runtime.catalog import ensure_gemma3_270m
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    runtime = StageRuntime.load(ensure_gemma3_270m(), 0, 18, ctx_size=512, kernel=Kernel(args.kernel, args.threads))
    runtime.open_session(1)
    state = {"hidden": runtime.forward(1, 0, np.arange(2, 12, dtype=np.int32)), "pos": 10}

    def step() -> None:
        token = int(np.argmax(runtime.logits(state["hidden"][-1:])[0]))
        state["hidden"] = runtime.forward(1, state["pos"], np.array([token], np.int32))
        state["pos"] += 1

    for _ in range(5):
        step()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    print(f"kernel {args.kernel}, {args.threads} threads: {(time.perf_counter() - started) / args.steps * 1e3:.1f} ms"
          " a token")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        step()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
