"""Logits of the ggml kernel against llama.cpp's on the same file (docs/BENCHMARKS.md,
"Quality against llama.cpp").

    python3 -m tools.compare_logits_llama_cpp ["prompt"]        # each prompt position
    python3 -m tools.compare_logits_llama_cpp --greedy 32        # measure_quality's 12 prompts

The first form prints, for each prompt position, the largest absolute logit difference, both
argmaxes and llama.cpp's top-2 margin. `--greedy N` follows llama.cpp's greedy tokens for N steps
on each of tools/measure_quality.py's prompts (both systems read the same tokens) and prints the
largest logit difference over all the steps and the first step whose argmaxes differ. llama.cpp
runs with CPU buffers only (its AMX ones die on some Intel machines) and an F32 KV cache.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from tools._common import llama_cpp_plain_buffers
from tools.measure_quality import PROMPTS

N_CTX = 512


def _positions(llm: Any, runtime: Any, ids: list[int]) -> None:
    """Each prompt position's logits, both systems."""
    llm.eval(ids)
    reference = np.array(llm.scores[: len(ids)])
    runtime.open_session(1)
    logits = runtime.logits(runtime.forward(1, 0, np.array(ids, np.int32)))
    for i in range(len(ids)):
        first, second = np.sort(reference[i])[-1], np.sort(reference[i])[-2]
        print(f"position {i:3d}: max |difference| {np.abs(logits[i] - reference[i]).max():.4f}, "
              f"argmax {int(logits[i].argmax())} / llama.cpp {int(reference[i].argmax())}, "
              f"llama.cpp margin {first - second:.3f}")


def _greedy(llm: Any, runtime: Any, tokenizer: Any, steps: int) -> None:
    """Teacher-forced on llama.cpp's greedy tokens: the largest difference and the first argmax change."""
    for session, prompt in enumerate(PROMPTS, start=1):
        ids = tokenizer.encode(prompt)
        llm.reset()
        llm.eval(ids)
        runtime.open_session(session)
        logits = runtime.logits(runtime.forward(session, 0, np.array(ids, np.int32))[-1:])[0]
        worst, first_change = 0.0, None
        for step in range(steps):
            reference = np.array(llm.scores[llm.n_tokens - 1])
            worst = max(worst, float(np.abs(reference - logits).max()))
            token = int(reference.argmax())
            if int(logits.argmax()) != token and first_change is None:
                first_change = step
            llm.eval([token])
            logits = runtime.logits(runtime.forward(session, len(ids) + step, np.array([token], np.int32)))[0]
        print(f"{prompt[:32]!r:36} {steps} steps: max |difference| {worst:.6f}, "
              f"first argmax difference {'none' if first_change is None else f'at step {first_change}'}")


def main() -> int:
    """Compare one prompt's positions, or the quality prompts' greedy steps."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt", nargs="?", default="In 1969, the first humans")
    parser.add_argument("--greedy", type=int, default=0, metavar="N", help="steps per quality prompt")
    args = parser.parse_args()
    from skippy_zmq.model.catalog import ensure_gemma3_270m
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime
    from skippy_zmq.tokens.tokenizer import Tokenizer

    path = ensure_gemma3_270m()
    tokenizer = Tokenizer.from_gguf(path)
    llm = llama_cpp_plain_buffers(path, n_ctx=N_CTX)  # CPU buffers, F32 KV cache, 2 threads
    # The float32 oracle keeps f32: llama.cpp runs with an F32 cache here, and plain buffers (no
    # repacked weights): ours repacks nothing either.
    runtime = StageRuntime.load(path, 0, 18, ctx_size=N_CTX, kernel=Kernel("ggml", 2, repack=False),
                                cache_type_k="f32", cache_type_v="f32")
    if args.greedy:
        _greedy(llm, runtime, tokenizer, args.greedy)
    else:
        _positions(llm, runtime, tokenizer.encode(args.prompt))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
