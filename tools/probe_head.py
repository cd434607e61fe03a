"""The final stage's head, ggml's product against MatMulNBits', on one model's own head matrix
(docs/BENCHMARKS.md, "The head by MatMulNBits").

    python3 tools/probe_head.py [--model GGUF] [--threads 2] [--rows 1 4 8 16 32]

Both heads are bound in this process (runtime/ggml_blocks.NormedHead, with and without
runtime/nbits_head.NbitsHead), then each row count is timed interleaved (ggml, nbits, ggml, ...),
medians in ms per call into the head's own buffer (`reuse`, as the final stage calls it). Also
printed per row count: the largest difference of the two heads' logits relative to the largest
logit, and how often their argmax agrees. (Memory: both heads share the file's pages here, so it is
measured per serve instead, tools/measure_serve_memory.py.)
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> int:
    """Bind both heads, time them interleaved, print one line per row count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the packaged Gemma 3 270M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    from skippy_zmq.runtime.catalog import ensure_gemma3_270m
    from skippy_zmq.runtime.ggml_blocks import NormedHead
    from skippy_zmq.runtime.model import GGUFModel
    from skippy_zmq.runtime.nbits_head import NbitsHead

    model = GGUFModel(args.model or ensure_gemma3_270m())
    hp = model.hparams
    name = "output.weight" if model.has_tensor("output.weight") else "token_embd.weight"
    rng = np.random.default_rng(0)
    heads: dict[str, NormedHead] = {}
    for label in ("ggml", "nbits"):
        nbits = NbitsHead(model.block_matrix(name, (hp.n_vocab, hp.n_embd)), args.threads, str(model.path)) \
            if label == "nbits" else None
        heads[label] = NormedHead(model, name, args.threads, True, nbits=nbits)
    print(f"{name} ({model.tensor_type_name(name)}, {hp.n_vocab} x {hp.n_embd}), {args.threads} threads")
    for rows in args.rows:
        x = rng.standard_normal((rows, hp.n_embd)).astype(np.float32)
        a, b = heads["ggml"](x), heads["nbits"](x)
        gap = float(np.abs(a - b).max() / np.abs(a).max())
        agree = float(np.mean(a.argmax(axis=1) == b.argmax(axis=1)))
        times: dict[str, list[float]] = {k: [] for k in heads}
        for _ in range(args.repeats):
            for label, head in heads.items():
                started = time.perf_counter()
                head(x, reuse=True)
                times[label].append(time.perf_counter() - started)
        cells = "  ".join(f"{k} {np.median(v) * 1e3:7.1f} ms" for k, v in times.items())
        ratio = np.median(times["nbits"]) / np.median(times["ggml"])
        print(f"rows {rows:3d}  {cells}  nbits/ggml {ratio:.2f}  largest difference {gap:.1e} of the largest "
              f"logit, argmax agrees {agree:.0%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
