"""Where one session's decode step spends its time, in one process (docs/BENCHMARKS.md).

    python3 tools/profile_decode.py [--kernel ggml] [--threads 2] [--steps 30] [--cache-type f16]
    python3 tools/profile_decode.py --sessions 16 [--steps 10]

Loads every layer of Gemma 3 270M with the kernel, decodes greedily after a 10-token prompt,
prints the mean time per token, then the top functions of a cProfile run over as many steps.
With `--sessions N`: the blocks' time of a decode pass over N sessions (one row each, one
batch) against a pass of N rows of one session, the head's time for N rows, and a pass of N - 1
decode rows with a new session's prompt beside them. `--cache-type`
is the KV cache type of keys and values (f16, the runtime's default, or f32).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def main() -> int:
    """Time and profile the decode loop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="ggml")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sessions", type=int, default=0, help="compare a batch of N sessions with N rows")
    parser.add_argument("--cache-type", default="f16", choices=("f32", "f16"), help="KV cache type of keys and values")
    parser.add_argument("--prompt", type=int, default=10, help="prompt tokens before the timed steps")
    args = parser.parse_args()
    from skippy_zmq.model.catalog import ensure_gemma3_270m
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    runtime = StageRuntime.load(ensure_gemma3_270m(), 0, 18, ctx_size=max(512, args.prompt + 2 * args.steps + 8),
                                kernel=Kernel(args.kernel, args.threads), cache_type_k=args.cache_type,
                                cache_type_v=args.cache_type)
    if args.sessions:
        return _sessions_against_rows(runtime, args.sessions, args.steps)
    runtime.open_session(1)
    prompt = 2 + np.arange(args.prompt, dtype=np.int32) % 1000
    state = {"hidden": runtime.forward(1, 0, prompt), "pos": args.prompt}

    def step() -> None:
        token = int(np.argmax(runtime.logits(state["hidden"][-1:])[0]))
        state["hidden"] = runtime.forward(1, state["pos"], np.array([token], np.int32))
        state["pos"] += 1

    for _ in range(5):
        step()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    print(f"kernel {args.kernel}, {args.threads} threads, {args.cache_type} KV cache, {args.prompt}-token prompt: "
          f"{(time.perf_counter() - started) / args.steps * 1e3:.1f} ms a token")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        step()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(10)
    return 0


def _mean_ms(run: Callable[[], object], steps: int) -> float:
    run()
    started = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - started) / steps * 1e3


def _sessions_against_rows(runtime: Any, n: int, steps: int) -> int:
    """Blocks: a decode batch of n sessions against n rows of one session; the head for n rows."""
    prompt = np.arange(2, 12, dtype=np.int32)
    for session in range(n + 1):
        runtime.open_session(session)
        runtime.forward(session, 0, prompt)
    tokens = np.full(n, 300, np.int32)
    state = {"pos": len(prompt), "hidden": np.empty(0)}

    def batch() -> None:
        state["hidden"] = runtime.forward_batch(list(range(n)), [state["pos"]] * n, tokens)
        state["pos"] += 1

    def rows() -> None:
        runtime.trim_session(n, len(prompt))
        runtime.forward(n, len(prompt), tokens)

    sessions_ms, rows_ms = _mean_ms(batch, steps), _mean_ms(rows, steps)
    head_ms = _mean_ms(lambda: runtime.logits(state["hidden"]), steps)
    print(f"blocks: {n} sessions x 1 row {sessions_ms:.1f} ms, 1 session x {n} rows {rows_ms:.1f} ms "
          f"({sessions_ms / rows_ms:.2f}x); head, {n} rows: {head_ms:.1f} ms")
    _joining_prompt(runtime, n, prompt, state, steps)
    return 0


def _joining_prompt(runtime: Any, n: int, prompt: Any, state: dict[str, Any], steps: int) -> None:
    """A pass of n - 1 decode rows and a new session's prompt (a new layout each time, as when a
    request joins running ones), with the time spent building its graph."""
    from skippy_zmq.compute import graphs

    built: list[float] = []
    build = graphs._LayoutGraphs.__init__

    def timed(self: Any, *args: Any) -> None:
        started = time.perf_counter()
        build(self, *args)
        built.append(time.perf_counter() - started)

    graphs._LayoutGraphs.__init__ = timed  # type: ignore[method-assign]
    passes = []
    for trial in range(steps):
        session = 1000 + trial
        runtime.open_session(session)
        ids = [*range(n - 1), session]
        started = time.perf_counter()
        runtime.forward_many(ids, [state["pos"]] * (n - 1) + [0], [1] * (n - 1) + [len(prompt)],
                             np.concatenate([np.full(n - 1, 300, np.int32), prompt]))
        passes.append(time.perf_counter() - started)
        runtime.close_session(session)
        runtime.forward(n - 1, state["pos"], np.array([300], np.int32))  # the one left out catches up
        state["pos"] += 1
    graphs._LayoutGraphs.__init__ = build  # type: ignore[method-assign]
    print(f"blocks: {n - 1} sessions x 1 row and a new {len(prompt)}-token prompt "
          f"{statistics.median(passes) * 1e3:.1f} ms, of which building its graph "
          f"{statistics.median(built) * 1e3:.1f} ms (medians of {steps})")


if __name__ == "__main__":
    raise SystemExit(main())
