"""The final stage's head, ggml's product against MatMulNBits', on one model's own head matrix
(docs/BENCHMARKS.md, "The head by MatMulNBits").

    python3 tools/probe_head.py [--model GGUF] [--threads 2] [--rows 1 4 8 16 32]

Both heads are bound in this process (compute/graphs.NormedHead, with and without
compute/nbits_head.NbitsHead), then each row count is timed interleaved (ggml, nbits, ggml, ...),
medians in ms per call into the head's own buffer (`reuse`, as the final stage calls it). Also
printed per row count: the largest difference of the two heads' logits relative to the largest
logit, and how often their argmax agrees.

    python3 tools/probe_head.py --memory nbits      # or ggml

binds one head alone instead (both would share the file's pages in one process): the seconds it
took and the process's RSS before and after it and its first 16-row product.
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
    parser.add_argument("--memory", choices=["ggml", "nbits"], default=None,
                        help="bind this head alone and report its time and resident memory")
    args = parser.parse_args()
    if args.memory is not None:
        return _memory(args.model, args.memory, args.threads)
    from skippy_zmq.compute.graphs import NormedHead
    from skippy_zmq.compute.nbits_head import NbitsHead
    from skippy_zmq.model.catalog import ensure_gemma3_270m
    from skippy_zmq.model.gguf_model import GGUFModel, head_tensor_name

    model = GGUFModel(args.model or ensure_gemma3_270m())
    hp = model.hparams
    name = head_tensor_name(model.header)
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


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def _memory(path: str | None, label: str, threads: int) -> int:
    """One head alone: seconds to bind it (imports of its libraries included) and RSS around it."""
    from skippy_zmq.compute import ggml
    from skippy_zmq.model.catalog import ensure_gemma3_270m
    from skippy_zmq.model.gguf_model import GGUFModel, head_tensor_name

    model = GGUFModel(path or ensure_gemma3_270m())
    hp = model.hparams
    name = head_tensor_name(model.header)
    ggml.Library.get()  # loaded before the first reading: both heads run the norm in ggml
    before = _rss_mib()
    started = time.perf_counter()
    from skippy_zmq.compute.graphs import NormedHead
    from skippy_zmq.compute.nbits_head import NbitsHead

    nbits = NbitsHead(model.block_matrix(name, (hp.n_vocab, hp.n_embd)), threads, str(model.path)) \
        if label == "nbits" else None
    head = NormedHead(model, name, threads, True, nbits=nbits)
    bound_s = time.perf_counter() - started
    head(np.random.default_rng(0).standard_normal((16, hp.n_embd)).astype(np.float32), reuse=True)
    print(f"{label} head {name} ({model.tensor_type_name(name)}): bound in {bound_s:.2f} s; RSS {before:.0f} MiB "
          f"before, {_rss_mib():.0f} MiB after a 16-row product (+{_rss_mib() - before:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
