"""Embeddings of the runtime against llama.cpp's on the same file (docs/PROTOCOL.md §7,
"Session forks and embeddings").

    python3 -m tools.compare_embeddings                      # packaged Gemma 3 270M Q4_K_M, ggml kernel
    python3 -m tools.compare_embeddings --f32                # its F32-dequantized copy
    python3 -m tools.compare_embeddings --f32 --kernel onnxruntime --min-cosine 0.999
    python3 -m tools.compare_embeddings --model tiny.gguf --json

llama.cpp (llama-cpp-python, `embedding=True`, `pooling_type` mean or last, CPU buffers only, an F32
KV cache) embeds each prompt; the runtime runs the same token ids through one stage of every layer
(F32 KV cache; the ggml kernel without repacking, so that both read the file's bytes), takes the
output-normed rows (`StageRuntime.normed`) and pools them with `PooledRows`, once from the whole
prompt and once from two prefill chunks. For each prompt and pooling it prints the cosine of the
whole-prompt vector and of the chunked one against llama.cpp's, and the cosine of chunked against
whole. `--min-cosine` exits 1 when a cosine against llama.cpp is below it; `--json` prints the
rows as one JSON document instead. The F32 copy is written once into $SKIPPY_ZMQ_CACHE
(~/.cache/skippy-zmq), where tools/record_llama_reference.py writes it too. Needs llama-cpp-python.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from skippy_zmq.model.gguf_model import GGUFModel
from skippy_zmq.runtime.kernels import Kernel
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.tokens.pooling import PooledRows, Pooling
from tools._common import f32_copy, llama_cpp_plain_buffers
from tools.record_llama_reference import PROMPTS

N_CTX = 512
KERNELS = ("ggml", "onnxruntime", "numpy")
EXTRA_PROMPTS = (
    "Embeddings map a text to one vector: texts that mean similar things should land close together, "
    "whatever words they use, and a search engine can then rank documents by the cosine of the angle "
    "between a query's vector and theirs.",
)


EMBEDDING_POOLINGS = (Pooling.MEAN, Pooling.LAST)
"""The poolings compared (rank pooling scores prompts for /rerank: tests/tokens/test_pooling.py compares it)."""


def llama_cpp_embedder(path: Path, pooling: Pooling, threads: int) -> Any:
    """llama.cpp embedding `path`'s prompts with `pooling`, CPU weight buffers only, an F32 KV cache."""
    import llama_cpp

    pooling_type = {Pooling.MEAN: llama_cpp.LLAMA_POOLING_TYPE_MEAN, Pooling.LAST: llama_cpp.LLAMA_POOLING_TYPE_LAST}
    # logits_all (the default there) marks every position an output, as embed() does: pooling reads them all.
    return llama_cpp_plain_buffers(path, N_CTX, threads, n_batch=N_CTX, n_ubatch=N_CTX, embedding=True,
                                   pooling_type=pooling_type[pooling])


def llama_cpp_embedding(llm: Any, ids: Sequence[int]) -> npt.NDArray[np.float32]:
    """llama.cpp's pooled embedding (n_embd,) of one prompt's ids, L2-normalized as embed(normalize=True)."""
    import llama_cpp.llama_cpp as low

    llm.reset()
    llm.eval(list(ids))
    pooled = np.array(low.llama_get_embeddings_seq(llm.ctx, 0)[: llm.n_embd()], dtype=np.float64)
    return (pooled / np.linalg.norm(pooled)).astype(np.float32)


def runtime_embedding(runtime: StageRuntime, ids: Sequence[int], pooling: Pooling, chunks: int
                      ) -> npt.NDArray[np.float32]:
    """The runtime's pooled, L2-normalized embedding (n_embd,) of one prompt prefilled in `chunks` chunks."""
    session = max(runtime.session_ids(), default=0) + 1
    runtime.open_session(session)
    try:
        pooled = PooledRows(pooling, runtime.hparams.n_embd)
        position = 0
        for part in np.array_split(np.array(ids, dtype=np.int32), chunks):
            pooled.add(runtime.normed(runtime.forward(session, position, part)))  # (T, n_embd) each
            position += len(part)
        return pooled.vector()
    finally:
        runtime.close_session(session)


def _cosine(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def compare(path: Path, kernel: Kernel, prompts: Sequence[str], threads: int) -> list[dict[str, Any]]:
    """One row per prompt and pooling: token count and the three cosines."""
    runtime = StageRuntime.load(path, 0, GGUFModel(path).hparams.n_layer, ctx_size=N_CTX, kernel=kernel,
                                weight_cache=None, cache_type_k="f32", cache_type_v="f32")
    rows: list[dict[str, Any]] = []
    for pooling in EMBEDDING_POOLINGS:
        llm = llama_cpp_embedder(path, pooling, threads)
        try:
            for prompt in prompts:
                ids = [int(i) for i in llm.tokenize(prompt.encode(), add_bos=True, special=False)]
                reference = llama_cpp_embedding(llm, ids)
                whole = runtime_embedding(runtime, ids, pooling, 1)
                chunked = runtime_embedding(runtime, ids, pooling, 2)
                rows.append({"prompt": prompt, "tokens": len(ids), "pooling": pooling.name.lower(),
                             "cosine": _cosine(whole, reference), "cosine_chunked": _cosine(chunked, reference),
                             "chunked_vs_whole": _cosine(chunked, whole)})
        finally:
            llm.close()
    return rows


def _model_path(model: Path | None, f32: bool) -> Path:
    """The file to compare on: --model, else the packaged Gemma 3 270M; with --f32 its F32 copy."""
    if model is None:
        from skippy_zmq.model.catalog import ensure_gemma3_270m

        model = ensure_gemma3_270m()
    return f32_copy(model) if f32 else model


def main(argv: Sequence[str] | None = None) -> int:
    """Print the cosines; 1 when one is below --min-cosine."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: packaged Gemma 3 270M)")
    parser.add_argument("--f32", action="store_true", help="compare on the model's F32-dequantized copy")
    parser.add_argument("--kernel", choices=KERNELS, default="ggml")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; default: 7)")
    parser.add_argument("--min-cosine", type=float, default=None)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    path = _model_path(args.model, args.f32)
    kernel = Kernel(args.kernel, args.threads, repack=False)
    rows = compare(path, kernel, args.prompt or (*PROMPTS, *EXTRA_PROMPTS), args.threads)
    if args.json:
        print(json.dumps({"model": str(path), "kernel": args.kernel, "rows": rows}, indent=1))
    else:
        print(f"{path.name}, kernel {args.kernel} (no repacking), F32 KV cache on both sides")
        print(f"{'pooling':7} {'tokens':>6} {'cosine':>10} {'2 chunks':>10} {'chunks/whole':>12}  prompt")
        for row in rows:
            print(f"{row['pooling']:7} {row['tokens']:6d} {row['cosine']:10.7f} {row['cosine_chunked']:10.7f} "
                  f"{row['chunked_vs_whole']:12.8f}  {row['prompt'][:40]!r}")
        for pooling in EMBEDDING_POOLINGS:
            mine = [row for row in rows if row["pooling"] == pooling.name.lower()]
            print(f"lowest, {pooling.name.lower()}: cosine {min(row['cosine'] for row in mine):.9f}, "
                  f"2 chunks {min(row['cosine_chunked'] for row in mine):.9f}")
    worst = min(min(row["cosine"], row["cosine_chunked"]) for row in rows)
    if args.min_cosine is not None and worst < args.min_cosine:
        print(f"lowest cosine {worst:.6f} is below --min-cosine {args.min_cosine}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
