"""Benchmark the numpy runtime on Gemma 3 270M (and llama.cpp on the same file when present).

    python3 tools/bench_runtime.py [--threads 2] [--out bench_runtime.md]

Each measurement runs in its own subprocess with OPENBLAS_NUM_THREADS / OMP_NUM_THREADS set,
so RSS figures are clean and the thread count is fixed before numpy loads. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_LEN = 32
BATCHES = (1, 4, 8)
THREE_STAGE = ((0, 6), (6, 12), (12, 18))
# A fixed 32-token prompt (BOS + ordinary vocabulary ids) so no tokenizer is needed.
PROMPT_IDS = [2, *range(1000, 1000 + PROMPT_LEN - 1)]
GOAL_DECODE_B1 = 0.3
GOAL_DECODE_B8 = 0.8
GOAL_RSS_FACTOR, GOAL_RSS_EXTRA_MIB = 1.2, 150


def _rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(rest.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def _child_load(model: str, start: int, end: int) -> dict[str, Any]:
    """Load one stage; report load time, RSS and f32 weight size."""
    from skippy_zmq.runtime.stage import StageRuntime

    t0 = time.perf_counter()
    stage = StageRuntime.load(model, start, end, ctx_size=2048)
    load_s = time.perf_counter() - t0
    rss, peak = _rss_mib()
    return {"load_s": load_s, "rss_mib": rss, "peak_mib": peak,
            "weights_mib": stage.weight_bytes() / 2**20}


def _child_speed(model: str, steps: int) -> dict[str, Any]:
    """Whole model: prefill tok/s for the 32-token prompt, decode tok/s at each batch size."""
    import numpy as np

    from skippy_zmq.runtime.stage import StageRuntime

    stage = StageRuntime.load(model, 0, stage_layers(model), ctx_size=2048)
    ids = np.array(PROMPT_IDS, dtype=np.int32)
    prefill = []
    for rep in range(3):
        stage.open_session(rep)
        t0 = time.perf_counter()
        hidden = stage.forward(rep, 0, ids)
        stage.logits(hidden[-1:])
        prefill.append(time.perf_counter() - t0)
        stage.close_session(rep)
    out: dict[str, Any] = {"prefill_tok_s": PROMPT_LEN / min(prefill)}
    for batch in BATCHES:
        sids = list(range(100, 100 + batch))
        last = []
        for sid in sids:
            stage.open_session(sid)
            last.append(stage.forward(sid, 0, ids)[-1])
        hidden = np.array(last)
        tokens = np.argmax(stage.logits(hidden), axis=1).astype(np.int32)
        t0 = 0.0
        for step in range(steps + 1):  # step 0 warms up
            if step == 1:
                t0 = time.perf_counter()
            positions = [stage.session_length(s) for s in sids]
            hidden = stage.forward_batch(sids, positions, tokens)
            tokens = np.argmax(stage.logits(hidden), axis=1).astype(np.int32)
        elapsed = time.perf_counter() - t0
        out[f"decode_b{batch}_tok_s"] = batch * steps / elapsed
        out[f"decode_b{batch}_step_ms"] = elapsed / steps * 1e3
        for sid in sids:
            stage.close_session(sid)
    return out


def stage_layers(model: str) -> int:
    """n_layer of the model."""
    from skippy_zmq.model.gguf_model import read_hparams

    return read_hparams(model).n_layer


def _child_llama(model: str, steps: int, threads: int) -> dict[str, Any]:
    """llama.cpp (llama-cpp-python) on the same file: load, prefill and batch-1 decode."""
    import numpy as np
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    load_s = time.perf_counter() - t0
    rss, peak = _rss_mib()
    prefill = []
    for _ in range(3):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(PROMPT_IDS)
        prefill.append(time.perf_counter() - t0)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    llm.eval([token])  # warm-up step
    t0 = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
    elapsed = time.perf_counter() - t0
    return {"load_s": load_s, "rss_mib": rss, "peak_mib": peak,
            "prefill_tok_s": PROMPT_LEN / min(prefill), "decode_b1_tok_s": steps / elapsed,
            "version": __import__("llama_cpp").__version__}


def _run_child(args: list[str], threads: int) -> dict[str, Any]:
    """Run this script as a child measurement and parse its JSON line."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True,
                          text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child {args} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _model_path(arg: str | None) -> str:
    """The model to benchmark: --model, else Gemma 3 270M assembled into the cache dir."""
    if arg:
        return arg
    from skippy_zmq.model.catalog import ensure_gemma3_270m

    return str(ensure_gemma3_270m())


def _machine() -> str:
    """One paragraph of machine facts."""
    import numpy as np

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    blas = "?"
    try:
        config = np.show_config(mode="dicts")
        blas_info = config["Build Dependencies"]["blas"]
        blas = f"{blas_info.get('name')} {blas_info.get('version')}"
    except (TypeError, KeyError):
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}, "
            f"numpy {np.__version__} ({blas}), load average at start {os.getloadavg()[0]:.2f}")


def main() -> None:
    """Run every measurement and write the markdown report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per batch")
    parser.add_argument("--out", default="bench_runtime.md", help="markdown report (default: ./bench_runtime.md)")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--child", choices=["load", "speed", "llama"], help=argparse.SUPPRESS)
    parser.add_argument("--range", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = _model_path(args.model)

    if args.child == "load":
        print(json.dumps(_child_load(model, *args.range)))
        return
    if args.child == "speed":
        print(json.dumps(_child_speed(model, args.steps)))
        return
    if args.child == "llama":
        print(json.dumps(_child_llama(model, args.steps, args.threads)))
        return

    machine = _machine()
    n_layer = stage_layers(model)
    common = ["--model", model, "--steps", str(args.steps), "--threads", str(args.threads)]
    loads = {}
    for start, end in (*THREE_STAGE, (0, n_layer)):
        print(f"loading [{start}, {end}) ...", file=sys.stderr, flush=True)
        loads[(start, end)] = _run_child([*common, "--child", "load", "--range", str(start),
                                          str(end)], args.threads)
    print("measuring speed ...", file=sys.stderr, flush=True)
    speed = _run_child([*common, "--child", "speed"], args.threads)
    llama: dict[str, Any] | None = None
    llama_note = ""
    if not args.no_llama:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            llama_note = "llama-cpp-python is not importable; no llama.cpp figures."
        else:
            print("measuring llama.cpp ...", file=sys.stderr, flush=True)
            llama = _run_child([*common, "--child", "llama"], args.threads)

    lines = [f"## Runtime benchmark: Gemma 3 270M Q4_K_M, {args.threads} threads", "",
             "| stage layers | load s | f32 weights MiB | RSS after load MiB | peak RSS MiB "
             "| RSS goal MiB | RSS goal met |", "|---|---|---|---|---|---|---|"]
    for (start, end), r in loads.items():
        goal = GOAL_RSS_FACTOR * r["weights_mib"] + GOAL_RSS_EXTRA_MIB
        lines.append(f"| [{start}, {end}) | {r['load_s']:.1f} | {r['weights_mib']:.0f} | "
                     f"{r['rss_mib']:.0f} | {r['peak_mib']:.0f} | {goal:.0f} | "
                     f"{'yes' if r['rss_mib'] <= goal else 'NO'} |")
    lines += ["", "| measure | skippy-zmq numpy | llama.cpp |", "|---|---|---|"]

    def fmt(key: str, source: dict[str, Any] | None) -> str:
        return f"{source[key]:.1f}" if source and key in source else "-"

    lines.append(f"| load s (whole model) | {loads[(0, n_layer)]['load_s']:.1f} | "
                 f"{fmt('load_s', llama)} |")
    lines.append(f"| RSS after load MiB (whole model) | {loads[(0, n_layer)]['rss_mib']:.0f} | "
                 f"{fmt('rss_mib', llama)} |")
    lines.append(f"| prefill tok/s ({PROMPT_LEN}-token prompt) | {fmt('prefill_tok_s', speed)} | "
                 f"{fmt('prefill_tok_s', llama)} |")
    for batch in BATCHES:
        lines.append(f"| decode tok/s, batch {batch} (aggregate) | "
                     f"{fmt(f'decode_b{batch}_tok_s', speed)} | "
                     f"{fmt('decode_b1_tok_s', llama) if batch == 1 else '-'} |")
    lines.append("")
    if llama:
        ref = llama["decode_b1_tok_s"]
        b1, b8 = speed["decode_b1_tok_s"], speed["decode_b8_tok_s"]
        lines.append(f"- decode batch 1 = {b1 / ref:.2f}x llama.cpp (goal >= {GOAL_DECODE_B1}x): "
                     f"{'met' if b1 >= GOAL_DECODE_B1 * ref else 'NOT met'}")
        lines.append(f"- aggregate decode batch 8 = {b8 / ref:.2f}x llama.cpp batch 1 (goal >= "
                     f"{GOAL_DECODE_B8}x): {'met' if b8 >= GOAL_DECODE_B8 * ref else 'NOT met'}")
        lines.append(f"- llama-cpp-python {llama['version']}, n_threads={args.threads}")
    else:
        lines.append(f"- {llama_note or 'llama.cpp skipped (--no-llama)'}")
    rss_ok = all(r["rss_mib"] <= GOAL_RSS_FACTOR * r["weights_mib"] + GOAL_RSS_EXTRA_MIB
                 for r in loads.values())
    lines.append(f"- RSS after load <= 1.2x f32 weights + 150 MiB for every stage: "
                 f"{'met' if rss_ok else 'NOT met'}")
    lines += ["", f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`  ",
              f"Machine: {machine}; load average at end {os.getloadavg()[0]:.2f}  ",
              f"Date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", ""]
    report = "\n".join(lines)
    print(report)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
