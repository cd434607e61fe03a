"""`bench step`: one stage's (or the whole model's) prefill and decode step in this process.

Loads layers [start, end) as a stage does, then for each session count n: opens n sessions, runs the
first one's prompt (the graphs of a new layout are built on the first count), the same prompt again
(graphs built), the other n - 1 prompts in one pass, then decode steps of all n sessions in one batch
(optionally after an idle gap, as a stage waits in a pipeline while the others compute), with the
head's time apart on the last stage. Inputs are random token ids on the first stage, random
activations elsewhere.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.bench.report import Report, cell, markdown_table

if TYPE_CHECKING:
    from skippy_zmq.runtime.stage import StageRuntime


@attrs.frozen
class StepBench:
    """What `bench step` was asked for."""

    model: Path
    layers: tuple[int, int] | None  # None: every layer
    session_counts: tuple[int, ...]
    prompt: int = 8
    steps: int = 6
    threads: int = 2
    gap_s: float = 0.0
    repack: bool = True
    ctx_size: int = 2048


@attrs.frozen
class StepRow:
    """One session count's times, seconds (decode: medians over the steps)."""

    sessions: int
    prefill_s: float
    prefill_again_s: float
    prefill_others_s: float | None  # None at one session
    decode_s: float  # the layers of one batched step
    head_s: float | None  # None when the stage holds no head

    @property
    def step_s(self) -> float:
        """A whole decode step: the layers and the head."""
        return self.decode_s + (self.head_s or 0.0)

    @property
    def tok_s(self) -> float:
        """Sessions over the step: tokens a second when the stage holds the whole model."""
        return self.sessions / self.step_s

    def as_json(self) -> dict[str, Any]:
        """The row's figures, seconds to the microsecond."""
        return {"sessions": self.sessions, "prefill_s": round(self.prefill_s, 6),
                "prefill_again_s": round(self.prefill_again_s, 6),
                "prefill_others_s": None if self.prefill_others_s is None else round(self.prefill_others_s, 6),
                "decode_s": round(self.decode_s, 6), "head_s": None if self.head_s is None else round(self.head_s, 6),
                "step_s": round(self.step_s, 6), "tok_s": round(self.tok_s, 2)}


def load(options: StepBench, progress: Callable[[str], None]) -> StageRuntime:
    """The stage's runtime on the environment's kernel, with --threads and --repack."""
    from skippy_zmq.model.gguf_model import read_hparams
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    start, end = options.layers if options.layers is not None else (0, read_hparams(options.model).n_layer)
    kernel = attrs.evolve(Kernel.from_environment(), threads=options.threads, repack=options.repack)
    return StageRuntime.load(options.model, start, end, ctx_size=options.ctx_size, progress=progress,
                             kernel=kernel, weight_cache=None)


class _Inputs:
    """Random rows a stage takes: token ids on the first stage, activations elsewhere."""

    def __init__(self, runtime: StageRuntime, seed: int = 0) -> None:
        self.first = runtime.is_first
        self.n_vocab = runtime.hparams.n_vocab
        self.n_embd = runtime.hparams.n_embd
        self.rng = np.random.default_rng(seed)

    def rows(self, n: int) -> npt.NDArray[Any]:
        """`n` rows: (n,) int32 ids, or (n, n_embd) float32 activations."""
        if self.first:
            return self.rng.integers(min(10, self.n_vocab - 1), min(self.n_vocab, 30000), n).astype(np.int32)
        return self.rng.standard_normal((n, self.n_embd)).astype(np.float32)


def _timed(call: Callable[[], object]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def measure(runtime: StageRuntime, sessions: int, options: StepBench, first_id: int, inputs: _Inputs) -> StepRow:
    """One session count's row, sessions `first_id` on; they are closed again."""
    ids = list(range(first_id, first_id + sessions))
    p = options.prompt
    for session in ids:
        runtime.open_session(session)
    try:
        first = inputs.rows(p)
        prefill = _timed(lambda: runtime.forward(ids[0], 0, first))
        runtime.trim_session(ids[0], 0)
        again = _timed(lambda: runtime.forward(ids[0], 0, first))
        others = None
        if sessions > 1:
            rest = inputs.rows(p * (sessions - 1))
            others = _timed(lambda: runtime.forward_many(ids[1:], [0] * (sessions - 1), [p] * (sessions - 1), rest))
        blocks, heads = [], []
        for step in range(options.steps):
            x = inputs.rows(sessions)
            if options.gap_s:
                time.sleep(options.gap_s)
            began = time.perf_counter()
            out = runtime.forward_batch(ids, [p + step] * sessions, x)
            blocks.append(time.perf_counter() - began)
            if runtime.is_last:
                began = time.perf_counter()
                runtime.logits(out)
                heads.append(time.perf_counter() - began)
    finally:
        for session in ids:
            runtime.close_session(session)
    return StepRow(sessions, prefill, again, others, statistics.median(blocks),
                   statistics.median(heads) if heads else None)


def run_step_bench(options: StepBench, report: Report, progress: Callable[[str], None]) -> list[StepRow]:
    """Load the stage, measure every session count; one report row each."""
    runtime = load(options, progress)
    layers = [runtime.layer_start, runtime.layer_end]
    inputs = _Inputs(runtime)
    rows = []
    next_id = 0
    for sessions in options.session_counts:
        progress(f"{sessions} sessions: {options.prompt}-token prompts, {options.steps} decode steps"
                 + (f", {options.gap_s:g} s idle before each" if options.gap_s else ""))
        rows.append(measure(runtime, sessions, options, next_id, inputs))
        next_id += sessions
        report.add({"model": str(options.model), "layers": layers, "kernel": runtime.kernel.name,
                    "threads": options.threads, "repack": options.repack, "prompt": options.prompt,
                    "steps": options.steps, "gap_s": options.gap_s, **rows[-1].as_json()})
    return rows


def step_table(rows: Sequence[StepRow]) -> str:
    """Milliseconds per row; tok/s counts the sessions over a whole step."""
    header = ("sessions", "prompt ms", "again ms", "others' prompts ms", "decode step ms", "head ms", "tok/s")
    return markdown_table(header, [
        (str(r.sessions), cell(r.prefill_s * 1e3), cell(r.prefill_again_s * 1e3),
         cell(None if r.prefill_others_s is None else r.prefill_others_s * 1e3), cell(r.decode_s * 1e3),
         cell(None if r.head_s is None else r.head_s * 1e3), cell(r.tok_s)) for r in rows
    ], "rrrrrrr")
