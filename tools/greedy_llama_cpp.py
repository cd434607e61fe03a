"""Greedy tokens of a GGUF in llama.cpp (llama-cpp-python), with each step's margin:
python tools/greedy_llama_cpp.py MODEL.gguf --tokens 8 --n-ctx 256"""

from __future__ import annotations

import json
import time
from typing import Any

import click
import numpy as np

# A fixed prompt of token ids every vocab here holds (the tiny one has about a thousand).
PROMPT = (2, 300, 301, 460, 302, 310, 311, 512)


def _plain_llama(model: str, n_ctx: int, threads: int) -> Any:
    """llama.cpp with CPU weight buffers only (its AMX ones die on some Intel machines;
    docs/ARCHITECTURE.md, "Kernels") and an F32 KV cache."""
    import llama_cpp.llama_cpp as low
    from llama_cpp import Llama

    defaults = low.llama_model_default_params

    def plain_buffers() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = plain_buffers  # Llama() takes no such argument: set the default
    try:
        return Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, type_k=0, type_v=0, verbose=False,
                     logits_all=True)
    finally:
        low.llama_model_default_params = defaults


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--tokens", type=click.IntRange(1, 4096), default=8, show_default=True)
@click.option("--n-ctx", type=click.IntRange(16), default=256, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True)
def main(model: str, tokens: int, n_ctx: int, threads: int) -> None:
    """Load MODEL, run PROMPT and TOKENS greedy steps; print one JSON line (tokens, margins, finite)."""
    started = time.perf_counter()
    llm = _plain_llama(model, n_ctx, threads)
    loaded = time.perf_counter() - started
    llm.eval(list(PROMPT))
    out: list[int] = []
    margins: list[float] = []
    finite = True
    for _ in range(tokens):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        finite = finite and bool(np.isfinite(logits).all())
        top = np.sort(logits)[-2:]
        margins.append(round(float(top[1] - top[0]), 3))
        out.append(int(logits.argmax()))
        llm.eval(out[-1:])
    click.echo(json.dumps({"model": model, "load_s": round(loaded, 2), "tokens": out, "margins": margins,
                           "finite": finite, "logit_std": round(float(logits.std()), 3)}))


if __name__ == "__main__":
    main()
