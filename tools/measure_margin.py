"""How far logits move with how a row is computed: batched or alone, prefill or decode.

    python3 tools/measure_margin.py [--kernel onnxruntime|numpy] [--sessions 16] [--steps 8]

Gemma 3 270M, one process: `--sessions` prompts are prefilled, then decoded greedily for
`--steps` steps three ways: all sessions in one batch, each session alone, and each token
as a one-row prefill of the final position (as a replay computes it). Prints the largest
absolute logit difference between the ways and the smallest top-2 margin seen. A greedy
token can differ between the ways only where its top-2 margin is below that difference
(docs/PROTOCOL.md §7, "Batched and alone").
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    """Decode the same sessions batched, alone and by replayed prefill; compare the logits."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="onnxruntime", help="matrix kernel (runtime/kernels.py)")
    parser.add_argument("--threads", type=int, default=2, help="threads per product")
    parser.add_argument("--sessions", type=int, default=16, help="sessions decoded together")
    parser.add_argument("--steps", type=int, default=8, help="greedy decode steps")
    args = parser.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # before numpy loads
    import numpy as np

    from skippy_zmq.model.catalog import ensure_gemma3_270m
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    runtime = StageRuntime.load(ensure_gemma3_270m(), 0, 18, ctx_size=128,
                                kernel=Kernel(args.kernel, args.threads))
    rng = np.random.default_rng(0)
    prompts = [np.concatenate([[2], rng.integers(200, 20000, size=int(rng.integers(4, 20)))]).astype(np.int32)
               for _ in range(args.sessions)]
    ids = list(range(args.sessions))
    batched_ids = [1000 + i for i in ids]
    tokens: list[list[int]] = []
    for i, prompt in zip(ids, prompts, strict=True):
        for session in (i, 1000 + i):
            runtime.open_session(session)
            logits = runtime.logits(runtime.forward(session, 0, prompt)[-1:])
        tokens.append([int(logits.argmax())])
    batch_vs_alone = prefill_vs_decode = 0.0
    margin = float("inf")
    for _ in range(args.steps):
        step = np.array([t[-1] for t in tokens], dtype=np.int32)
        positions = [len(p) + len(t) - 1 for p, t in zip(prompts, tokens, strict=True)]
        batched = runtime.logits(runtime.forward_batch(batched_ids, positions, step))
        for row, i in enumerate(ids):
            alone = runtime.logits(runtime.forward(i, positions[row], step[row:row + 1]))[0]
            replay_id = 5000 + i
            runtime.open_session(replay_id)
            history = np.concatenate([prompts[row], np.array(tokens[row], dtype=np.int32)])
            replayed = runtime.logits(runtime.forward(replay_id, 0, history)[-1:])[0]
            runtime.close_session(replay_id)
            batch_vs_alone = max(batch_vs_alone, float(np.abs(batched[row] - alone).max()))
            prefill_vs_decode = max(prefill_vs_decode, float(np.abs(replayed - alone).max()))
            top2 = np.sort(alone)[-2:]
            margin = min(margin, float(top2[1] - top2[0]))
            tokens[row].append(int(alone.argmax()))
    print(f"kernel {args.kernel}, {args.sessions} sessions x {args.steps} steps: max |logit difference| "
          f"batched vs alone {batch_vs_alone:.3g}, replayed prefill vs decode {prefill_vs_decode:.3g}; "
          f"smallest top-2 margin seen {margin:.3g}")


if __name__ == "__main__":
    main()
