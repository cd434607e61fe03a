"""One stage's prefill and decode times in this process, on any GGUF (docs/BENCHMARKS.md,
"A model that needs the pipeline").

    python3 tools/profile_stage.py --model MODEL.gguf --layers 0 13 --sessions 4 --repack 1

Loads layers [A, B) with the ggml kernel (`--threads`, `--repack`), prefills `--sessions`
sessions with a `--prompt`-token prompt each, one pass per session (random token ids on the
first stage, random activations elsewhere), then runs `--steps` decode steps of all sessions in
one batch. Prints one JSON line: the first session's prefill (its layout new, graphs built), the
same prefill again on graphs already built, the other sessions' prompts in one pass, and the
median decode step with the head's share on the last stage. With `--waves N`, then N pairs of
waves of new sessions (each: `--sessions` - 1 sessions opened, their prompts in one pass, 8
decode steps, closed), alternating a pool whose free slots gave their pages back (`cold`, as
before warm slots) with one whose slots kept them (`warm`, compute/kv_cache.py `SlotPool`); it
adds the median wave of each. With `--gap S`, the process sleeps S seconds before each decode step,
as a pipeline's stage waits while the others compute (docs/BENCHMARKS.md, "Huge pages").

    python3 tools/profile_stage.py --model MODEL.gguf --layers 0 18 --sessions 16 --prompt 10 --waves 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--layers", type=int, nargs=2, metavar=("START", "END"), required=True)
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens per session")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repack", type=int, choices=(0, 1), default=1)
    parser.add_argument("--ctx-size", type=int, default=2048)
    parser.add_argument("--waves", type=int, default=0, help="cold/warm pairs of waves of new sessions")
    parser.add_argument("--gap", type=float, default=0.0, help="seconds idle before each decode step")
    args = parser.parse_args(argv)

    import numpy as np

    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    start, end = args.layers
    runtime = StageRuntime.load(args.model, start, end, ctx_size=args.ctx_size,
                                kernel=Kernel("ggml", threads=args.threads, repack=bool(args.repack)),
                                weight_cache=None)
    hp = runtime.hparams
    rng = np.random.default_rng(0)

    def rows(n: int) -> np.ndarray:
        if start == 0:
            return rng.integers(10, min(hp.n_vocab, 30000), n).astype(np.int32)
        return rng.standard_normal((n, hp.n_embd)).astype(np.float32)

    def timed(call: object) -> float:
        began = time.perf_counter()
        call()  # type: ignore[operator]
        return time.perf_counter() - began

    n, p = args.sessions, args.prompt
    for session in range(n):
        runtime.open_session(session)
    first = rows(p)
    new_layout = timed(lambda: runtime.forward(0, 0, first))
    runtime.trim_session(0, 0)
    same_layout = timed(lambda: runtime.forward(0, 0, first))
    others = timed(lambda: runtime.forward_many(list(range(1, n)), [0] * (n - 1), [p] * (n - 1),
                                                rows(p * (n - 1)))) if n > 1 else 0.0
    blocks, heads = [], []
    for step in range(args.steps):
        x = rows(n)
        if args.gap:
            time.sleep(args.gap)
        began = time.perf_counter()
        out = runtime.forward_batch(list(range(n)), [p + step] * n, x)
        blocks.append(time.perf_counter() - began)
        if end == hp.n_layer:
            heads.append(timed(lambda out=out: runtime.logits(out)))
    waves: dict[str, list[float]] = {"cold": [], "warm": []}
    next_id = n
    for _ in range(args.waves):
        for kind in ("cold", "warm"):
            ids = list(range(next_id, next_id + n - 1))
            next_id += n - 1
            if kind == "cold":
                runtime.release_free_caches()
            for session in ids:
                runtime.open_session(session)
            began = time.perf_counter()
            runtime.forward_many(ids, [0] * len(ids), [p] * len(ids), rows(p * len(ids)))
            for step in range(8):
                runtime.forward_batch(ids, [p + step] * len(ids), rows(len(ids)))
            waves[kind].append(time.perf_counter() - began)
            for session in ids:
                runtime.close_session(session)
    extra = {f"wave_{kind}_s": round(statistics.median(times), 3) for kind, times in waves.items() if times}
    print(json.dumps({
        **extra,
        "model": str(args.model), "layers": [start, end], "sessions": n, "prompt": p, "threads": args.threads,
        "repack": bool(args.repack), "gap_s": args.gap, "prefill_new_layout_s": round(new_layout, 3),
        "prefill_same_layout_s": round(same_layout, 3), "prefill_others_one_pass_s": round(others, 3),
        "decode_step_s": round(statistics.median(blocks), 3),
        "head_s": round(statistics.median(heads), 3) if heads else None,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
