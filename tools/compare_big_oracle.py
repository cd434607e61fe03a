"""Greedy tokens of the ggml kernel against llama-server's on the same file, with each step's margin
(docs/BENCHMARKS.md, "The oracle on big shapes"):

    python3 -m tools.compare_big_oracle MODEL.gguf --server-dir LLAMA_CPP/build/bin --prompts 4 --tokens 16

(MODEL.gguf, e.g. `python3 -m tools.write_random_model --shape llama3-8b ...`'s file.) First
llama-server (the build in --server-dir, else $LLAMA_SERVER_DIR, else the one on PATH; BENCHMARKS.md
names the build measured) answers each fixed prompt, tokenized by the file's own tokenizer, on
/completion (greedy, n_probs 2, no prompt cache) and is stopped; then skippy-zmq's runtime runs the
same prompts in this process as `--stages` StageRuntimes (contiguous layer ranges of nearly equal
size, 2 by default) with the ggml kernel: each prompt prefilled in one batch (as llama-server
does with a prompt shorter than its batch), then one decode step per token, each fed
llama-server's token of the step before (so our greedy run up to the first difference, and a
like-for-like step after it). Both keep f16 KV caches; llama-server runs without flash attention
unless told (`--flash-attn`), since the ggml kernel computes attention as llama.cpp does without
it. Prints a readable table to stderr and one JSON line to stdout: per prompt both token lists,
the agreeing prefix, the steps with the same argmax, each step's margin (top-1 minus top-2:
llama-server's logprobs, which differ by the logit difference, and our logits), and every
differing step with both margins.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

from skippy_zmq.launch.topology import free_tcp_ports
from skippy_zmq.runtime.kernels import HEAD_ROUTES
from tools._common import LlamaServer, ToolError, agreeing_prefix, post_json, start, stop, wait_healthy

N_CTX = 512
READY_TIMEOUT_S = 300.0  # a cold 6 GB file is read from disk first
REQUEST_TIMEOUT_S = 600.0  # 16 tokens of an 8B shape on two shared cores
# Fixed prompts, tokenized by the file's own tokenizer (llama.cpp's, with the vocab's BOS): both
# sides get the same ids (llama-server adds nothing to an id list).
PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a village between two rivers, there lived",
    "Translate to German: The weather is nice today, so we walk to the lake. 🌤",
)
MAX_PROMPT_TOKENS = 64  # the longest prompt in any vocabulary's tokens, with room to spare


def prompt_ids(model: str, n_prompts: int) -> list[list[int]]:
    """The first `n_prompts` PROMPTS as the file's tokenizer gives them."""
    from skippy_zmq.tokens.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(model)
    ids = [tokenizer.encode(text) for text in PROMPTS[:n_prompts]]
    tokenizer.close()
    if any(len(one) > MAX_PROMPT_TOKENS for one in ids):
        raise ToolError(f"{model}: a prompt has more than {MAX_PROMPT_TOKENS} tokens: {[len(one) for one in ids]}")
    return ids


def layer_cuts(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges of nearly equal size, one per stage."""
    if not 1 <= n_stages <= n_layer:
        raise ToolError(f"--stages {n_stages}: expected 1 to the file's {n_layer} layers")
    bounds = [round(i * n_layer / n_stages) for i in range(n_stages + 1)]
    return list(itertools.pairwise(bounds))


def _server_greedy(model: str, server: LlamaServer, prompts: Sequence[Sequence[int]], tokens: int, flash_attn: str,
                   swa_full: bool = False) -> tuple[list[dict[str, Any]], float]:
    """Each prompt's greedy tokens and margins from llama-server; the server is stopped on return."""
    (port,) = free_tcp_ports(1)
    # --no-repack: weights in plain CPU buffers; the extra (AMX) ones die on some Intel machines
    # (docs/ARCHITECTURE.md, "Kernels"). f16 KV is llama.cpp's default; named to be sure. Flash
    # attention off by default: the ggml kernel computes attention as llama.cpp does without it
    # (compute/graphs.py), while the CPU flash kernel accumulates f16 values in f16.
    options = ["--no-repack", "-ctk", "f16", "-ctv", "f16", "--no-warmup", "-fa", flash_attn]
    if swa_full:  # sliding layers' cache at the full context, as ours (docs/BENCHMARKS.md, "The oracle on big shapes")
        options.append("--swa-full")
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="compare-big-oracle-") as scratch:
        log = Path(scratch) / "llama-server.log"
        process = start(server.command(model, port, threads=2, ctx_size=N_CTX, parallel=1, options=options),
                        log=log, env=server.environment())
        try:
            started = time.perf_counter()
            wait_healthy(url, process, READY_TIMEOUT_S, name="llama-server", log=log)
            loaded = time.perf_counter() - started
            results = []
            for ids in prompts:
                body = {"prompt": list(ids), "n_predict": tokens, "temperature": 0, "n_probs": 2, "return_tokens": True,
                        "cache_prompt": False}
                status, answer = post_json(url + "/completion", body, REQUEST_TIMEOUT_S)
                if status != 200 or not isinstance(answer, dict):
                    raise ToolError(f"llama-server: {url}/completion answered {status or 'nothing'}: "
                                    f"{str(answer)[:300]}")
                results.append(_server_steps(answer))
            return results, loaded
        finally:
            stop(process, 15)


def _server_steps(answer: dict[str, Any]) -> dict[str, Any]:
    """Tokens, margins and timings of one /completion answer: every generated id (`tokens`), each with
    its margin from completion_probabilities where that list has its entry. llama-server leaves out
    the entry of a token whose piece ends inside a UTF-8 character, so the ids come from `tokens`."""
    steps = answer.get("completion_probabilities")
    if not isinstance(steps, list):
        raise click.ClickException(f"llama-server: no completion_probabilities in its answer {str(answer)[:300]}")
    probs: list[tuple[int, float | None]] = []
    for i, step in enumerate(steps):
        try:
            top = step["top_logprobs"]
            margin = round(float(top[0]["logprob"]) - float(top[1]["logprob"]), 3) if len(top) > 1 else None
            probs.append((int(step["id"]), margin))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise click.ClickException(f"llama-server: completion_probabilities[{i}] = {str(step)[:200]} lacks "
                                       f"{exc}; expected an id and top_logprobs with logprobs") from None
    given = answer.get("tokens")
    out = [int(t) for t in given] if isinstance(given, list) and given else [token for token, _ in probs]
    margins: list[float | None] = []
    entry = 0
    for token in out:
        if entry < len(probs) and probs[entry][0] == token:
            margins.append(probs[entry][1])
            entry += 1
        else:
            margins.append(None)
    timings = answer.get("timings", {})
    return {"tokens": out, "margins": margins, "stop_type": answer.get("stop_type"),
            "prompt_ms": timings.get("prompt_ms"), "predicted_ms": timings.get("predicted_ms")}


def _ours_greedy(model: str, prompts: Sequence[Sequence[int]], server: Sequence[Sequence[int]], n_stages: int,
                 head: str = "auto") -> tuple[list[dict[str, Any]], float]:
    """Each prompt's greedy tokens and logit margins from `n_stages` in-process StageRuntimes (ggml kernel),
    each step fed llama-server's token of the step before: the same as our own greedy run up to
    the first difference, and after it still a comparison of the two on one history."""
    from skippy_zmq.model.gguf_model import ModelHParams
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    started = time.perf_counter()
    cuts = layer_cuts(ModelHParams.from_gguf(model).n_layer, n_stages)
    # Plain buffers, as llama-server's --no-repack: repacked matrices add in the interleaved kernels'
    # order, llama.cpp's default path's, which that server cannot run here.
    kernel = Kernel("ggml", 2, repack=False, head=head)
    stages = [StageRuntime.load(model, start, end, ctx_size=N_CTX, kernel=kernel) for start, end in cuts]
    loaded = time.perf_counter() - started
    results = []
    for session, (ids, followed) in enumerate(zip(prompts, server, strict=True), start=1):
        for stage in stages:
            stage.open_session(session)
        step_started = time.perf_counter()
        rows = np.array(ids, dtype=np.int32)
        pos, out, margins = 0, [], []
        for step in range(len(followed)):
            hidden = rows
            for stage in stages:
                hidden = stage.forward(session, pos, hidden)  # ids in, then (T, n_embd)
            logits = stages[-1].logits(hidden[-1:])[0]  # (n_vocab,)
            top = np.sort(logits)[-2:]
            margins.append(round(float(top[1] - top[0]), 3))
            out.append(int(logits.argmax()))
            pos += rows.shape[0]
            rows = np.array(followed[step : step + 1], dtype=np.int32)
        for stage in stages:
            stage.close_session(session)
        results.append({"tokens": out, "margins": margins, "seconds": round(time.perf_counter() - step_started, 2)})
    return results, loaded


def _differences(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every step whose argmaxes differ: prompt, step, both tokens and both margins there."""
    found = []
    for i, row in enumerate(rows):
        server, ours = row["server"], row["ours"]
        for step, (a, b) in enumerate(zip(server["tokens"], ours["tokens"], strict=True)):
            if a != b:
                found.append({"prompt": i, "step": step, "server": a, "ours": b,
                              "server_margin": server["margins"][step], "ours_margin": ours["margins"][step]})
    return found


def _table(rows: list[dict[str, Any]]) -> str:
    """The readable form: per prompt, both token lists and margins step by step."""
    lines = []
    for i, row in enumerate(rows):
        lines.append(f"prompt {i} ({row['prompt_len']} ids): agreeing prefix {row['agree']}/{row['tokens']}, "
                     f"same argmax on {row['same_steps']} steps of llama-server's history")
        lines.append(f"  {'step':>4} {'llama-server':>12} {'margin':>8} {'ours':>8} {'margin':>8}")
        server, ours = row["server"], row["ours"]
        for step in range(max(len(server["tokens"]), len(ours["tokens"]))):
            s_tok = server["tokens"][step] if step < len(server["tokens"]) else "-"
            s_mar = server["margins"][step] if step < len(server["margins"]) else "-"
            o_tok = ours["tokens"][step] if step < len(ours["tokens"]) else "-"
            o_mar = ours["margins"][step] if step < len(ours["margins"]) else "-"
            mark = "" if s_tok == o_tok else "  <- differ"
            lines.append(f"  {step:>4} {s_tok!s:>12} {s_mar!s:>8} {o_tok!s:>8} {o_mar!s:>8}{mark}")
    return "\n".join(lines)


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompts", "n_prompts", type=click.IntRange(1, len(PROMPTS)), default=len(PROMPTS),
              show_default=True, help="how many of the fixed prompts")
@click.option("--tokens", type=click.IntRange(1, N_CTX - MAX_PROMPT_TOKENS), default=16, show_default=True)
@click.option("--stages", "stage_counts", type=click.IntRange(1, 8), multiple=True, default=(2,), show_default=True,
              help="our side cut into this many contiguous layer ranges, one StageRuntime each; repeat the option "
                   "to run several cuts against one llama-server run")
@click.option("--head", type=click.Choice(list(HEAD_ROUTES)), default="auto", show_default=True,
              help="our head's product, as $SKIPPY_ZMQ_HEAD chooses it for serve (auto: MatMulNBits where it runs)")
@click.option("--server-dir", default=None, show_default="$LLAMA_SERVER_DIR, else llama-server on PATH",
              help="the directory of a llama-server build (the binary and its shared libraries)")
@click.option("--flash-attn", type=click.Choice(["off", "on", "auto"]), default="off", show_default=True,
              help="llama-server's -fa (its own default is auto)")
@click.option("--swa-full", is_flag=True,
              help="llama-server's --swa-full: its sliding layers' cache at the full context")
def main(model: str, n_prompts: int, tokens: int, stage_counts: tuple[int, ...], head: str, server_dir: str | None,
         flash_attn: str, swa_full: bool) -> None:
    """Run llama-server, then our runtime, on the same prompts of MODEL; compare their greedy tokens."""
    import skippy_zmq
    from skippy_zmq.errors import SkippyError

    llama_server = LlamaServer.find(server_dir)
    try:
        prompts = prompt_ids(model, n_prompts)
    except SkippyError as exc:
        raise click.ClickException(str(exc)) from None
    server, server_load = _server_greedy(model, llama_server, prompts, tokens, flash_attn, swa_full)
    for n_stages in stage_counts:
        try:
            ours, ours_load = _ours_greedy(model, prompts, [r["tokens"] for r in server], n_stages, head)
        except SkippyError as exc:
            raise click.ClickException(str(exc)) from None
        _report(model, prompts, tokens, n_stages, server, ours, {
            "model": model, "prompts": n_prompts, "tokens": tokens, "flash_attn": flash_attn, "swa_full": swa_full,
            "server_load_s": round(server_load, 2), "ours_load_s": round(ours_load, 2),
            "ours": f"{n_stages} in-process StageRuntimes, ggml kernel, 2 threads, f16 KV", "stages": n_stages,
            "head": head,
            "package": str(Path(skippy_zmq.__file__).parent)})


def _report(model: str, prompts: Sequence[Sequence[int]], tokens: int, n_stages: int,
            server: Sequence[dict[str, Any]], ours: Sequence[dict[str, Any]], head: dict[str, Any]) -> None:
    """The table of one cut to stderr, its JSON line to stdout."""
    rows: list[dict[str, Any]] = []
    for ids, s, o in zip(prompts, server, ours, strict=True):
        same = sum(a == b for a, b in zip(s["tokens"], o["tokens"], strict=True))
        rows.append({"prompt_len": len(ids), "tokens": tokens, "agree": agreeing_prefix(s["tokens"], o["tokens"]),
                     "same_steps": same, "server": s, "ours": o})
    click.echo(f"{model}, {n_stages} stage(s):", err=True)
    click.echo(_table(rows), err=True)
    margins = [m for r in rows for m in r["server"]["margins"] if m is not None]
    ours_margins = [m for r in rows for m in r["ours"]["margins"]]
    click.echo(json.dumps({
        **head,
        "agree": [r["agree"] for r in rows], "all_agree": all(r["agree"] == tokens for r in rows),
        "server_margin_min": min(margins, default=None), "server_margin_max": max(margins, default=None),
        "ours_margin_min": min(ours_margins, default=None), "ours_margin_max": max(ours_margins, default=None),
        "differences": _differences(rows), "rows": rows,
    }))


if __name__ == "__main__":
    main()
