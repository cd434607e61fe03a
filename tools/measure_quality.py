"""How close each kernel's numbers stay to the F32 reference, against llama.cpp's own (docs/BENCHMARKS.md,
"Quality against llama.cpp").

    python3 -m tools.measure_quality [--out results.json]

The reference is llama.cpp (llama-cpp-python, F32 KV cache, 2 threads) on the F32 file: the packaged
Gemma 3 270M Q4_K_M with every tensor dequantized (`_common.write_f32_copy`, into a scratch directory). Then
llama.cpp on the file as it is, and skippy-zmq's runtime with each kernel on the file as it is, are
measured against that reference in two ways:

1. greedy: 12 prompts x 32 greedy tokens each; a prompt's agreeing prefix is how many tokens match
   the reference's before the first difference (32 when all do), and the figure is the mean;
2. teacher-forced top-1: over the committed text tools/data/quality_text.md (this project's own
   prose, at least 2,000 tokens), the share of positions whose most likely next token is the
   reference's, every model reading the same text.

Needs the model extra (llama-cpp-python) and about 8 GB of memory for the reference's logits.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tools._common import agreeing_prefix, llama_cpp_plain_buffers, write_f32_copy
from tools.record_llama_reference import PROMPTS as REFERENCE_PROMPTS

TEXT = Path(__file__).resolve().parent / "data" / "quality_text.md"
PROMPTS = (*REFERENCE_PROMPTS, "The history of the printing press begins", "To make a cup of tea, first",
           "In 1969, the first humans", "import numpy as np\n\ndef", "The mitochondria is", "Dear hiring manager,")
N_GREEDY = 32
CHUNK = 256  # rows of the runtime's forward pass in teacher forcing (logits of 256 rows: 256 MiB)

Greedy = Callable[[Sequence[int], int], list[int]]
TopOne = Callable[[Sequence[int]], npt.NDArray[np.int64]]


def llama_cpp_runs(path: Path, n_ctx: int) -> tuple[Greedy, TopOne]:
    """Greedy continuation and teacher-forced argmax by llama.cpp on `path`."""
    llm = llama_cpp_plain_buffers(path, n_ctx)

    def greedy(prompt: Sequence[int], n_new: int) -> list[int]:
        llm.reset()
        llm.eval(list(prompt))
        out: list[int] = []
        for _ in range(n_new):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([out[-1]])
        return out

    def top_one(ids: Sequence[int]) -> npt.NDArray[np.int64]:
        llm.reset()
        llm.eval(list(ids))
        return np.asarray(np.argmax(llm.scores[: len(ids)], axis=1), dtype=np.int64)

    return greedy, top_one


def runtime_runs(path: Path, kernel_spec: str, n_ctx: int) -> tuple[Greedy, TopOne]:
    """The same two by skippy-zmq's runtime (one stage, every layer) with `kernel_spec`: a kernel's name,
    or `ggml:HEAD` with the head's product by HEAD (`ggml`, or `nbits`: MatMulNBits, the default)."""
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    # The float32 oracle keeps f32: the reference is llama.cpp with an F32 cache, and plain buffers
    # (no repacked weights), which its runs here use.
    kernel_name, _, head = kernel_spec.partition(":")
    runtime = StageRuntime.load(path, 0, 18, ctx_size=n_ctx,
                                kernel=Kernel(kernel_name, 2, repack=False, head=head or "auto"),
                                cache_type_k="f32", cache_type_v="f32")
    session = iter(range(1, 1 << 30))

    def greedy(prompt: Sequence[int], n_new: int) -> list[int]:
        sid = next(session)
        runtime.open_session(sid)
        hidden = runtime.forward(sid, 0, np.asarray(prompt, np.int32))
        out: list[int] = []
        for i in range(n_new):
            out.append(int(np.argmax(runtime.logits(hidden[-1:])[0])))
            hidden = runtime.forward(sid, len(prompt) + i, np.asarray(out[-1:], np.int32))
        runtime.close_session(sid)
        return out

    def top_one(ids: Sequence[int]) -> npt.NDArray[np.int64]:
        sid = next(session)
        runtime.open_session(sid)
        tops = []
        for start in range(0, len(ids), CHUNK):
            hidden = runtime.forward(sid, start, np.asarray(ids[start:start + CHUNK], np.int32))
            tops.append(np.argmax(runtime.logits(hidden), axis=1))
        runtime.close_session(sid)
        return np.concatenate(tops).astype(np.int64)

    return greedy, top_one


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every system against the F32 reference; print a table, write JSON with --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kernels", nargs="+", default=["ggml:nbits", "ggml:ggml", "onnxruntime"],
                        help="kernels to measure; ggml:HEAD names who multiplies by the head (nbits or ggml)")
    args = parser.parse_args(argv)
    from skippy_zmq.model.catalog import ensure_gemma3_270m
    from skippy_zmq.tokens.tokenizer import Tokenizer

    path = ensure_gemma3_270m()
    tokenizer = Tokenizer.from_gguf(path)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    text_ids = tokenizer.encode(TEXT.read_text())
    if len(text_ids) < 2000:
        raise SystemExit(f"{TEXT} has {len(text_ids)} tokens; the measure needs at least 2,000")
    n_ctx = len(text_ids) + 8
    with tempfile.TemporaryDirectory() as scratch:
        f32 = Path(scratch) / "gemma3-270m-f32.gguf"
        write_f32_copy(path, f32)
        systems: dict[str, tuple[Greedy, TopOne]] = {"llama.cpp F32 (reference)": llama_cpp_runs(f32, n_ctx)}
        reference_greedy = [systems["llama.cpp F32 (reference)"][0](p, N_GREEDY) for p in prompts]
        reference_top = systems["llama.cpp F32 (reference)"][1](text_ids)
        del systems
        candidates: dict[str, Callable[[], tuple[Greedy, TopOne]]] = {
            "llama.cpp, file as is": lambda: llama_cpp_runs(path, n_ctx),
            **{f"skippy-zmq {k} kernel": (lambda k=k: runtime_runs(path, k, n_ctx)) for k in args.kernels},
        }
        results: dict[str, Any] = {"text_tokens": len(text_ids), "prompts": len(prompts), "greedy_tokens": N_GREEDY}
        for name, make in candidates.items():
            started = time.monotonic()
            greedy, top_one = make()
            prefixes = [agreeing_prefix(greedy(p, N_GREEDY), ref) for p, ref in zip(prompts, reference_greedy,
                                                                                    strict=True)]
            top = top_one(text_ids)
            agree = float(np.mean(top == reference_top))
            results[name] = {"mean_agreeing_prefix": float(np.mean(prefixes)), "prefixes": prefixes,
                             "top1_agreement": agree, "seconds": round(time.monotonic() - started, 1)}
            print(f"{name:32s} mean agreeing prefix {np.mean(prefixes):5.2f} of {N_GREEDY} "
                  f"(per prompt {prefixes}); teacher-forced top-1 {100 * agree:.2f} % of {len(text_ids)}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
