"""Greedy tokens of a GGUF in llama.cpp (llama-cpp-python), with each step's margin:
python3 -m tools.greedy_llama_cpp MODEL.gguf --tokens 8 --n-ctx 256"""

from __future__ import annotations

import json
import time

import click
import numpy as np

from tools._common import llama_cpp_plain_buffers

# A fixed prompt of token ids every vocab here holds (the tiny one has about a thousand).
PROMPT = (2, 300, 301, 460, 302, 310, 311, 512)


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--tokens", type=click.IntRange(1, 4096), default=8, show_default=True)
@click.option("--n-ctx", type=click.IntRange(16), default=256, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True)
def main(model: str, tokens: int, n_ctx: int, threads: int) -> None:
    """Load MODEL, run PROMPT and TOKENS greedy steps; print one JSON line (tokens, margins, finite)."""
    started = time.perf_counter()
    llm = llama_cpp_plain_buffers(model, n_ctx, threads)  # CPU buffers, F32 KV cache
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
