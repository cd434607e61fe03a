"""Measure the planner's cost table: one decode step per layer and for the output head.

    python3 -m tools.measure_costs [--model PATH] [--kernel onnxruntime] [--batches 8 16] [--steps 20] [--threads 1]

Each layer is loaded as its own one-layer stage (layer 0 takes token ids, so its time includes
the embedding; the others take hidden states); `batch` sessions are prefilled with a short
prompt, then the fastest of `--steps` batched decode steps is kept (interference only adds time). The head is the final
stage's output norm, head matmul and greedy sampling of every row. The output is a Python row
for `MEASURED` in skippy_zmq/launch/planner.py, plus the splits the planner then picks. `skippy-zmq plan`
uses that table for the float32 kernels (`--kernel`, default onnxruntime: the one the table holds); a
quantized kernel's costs are the file's bytes. Not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skippy_zmq.runtime.kernels import Kernel


def _fastest_ms(samples: list[float]) -> float:
    """The fastest step in ms: other work on the machine only ever adds time."""
    return round(min(samples) * 1e3, 2)


def _layer_ms(model: str, kernel: Kernel, il: int, batch: int, steps: int, prompt: int) -> float:
    """Fastest ms of one decode step of `batch` sessions through layer `il` alone."""
    import numpy as np

    from skippy_zmq.runtime.stage import StageRuntime

    stage = StageRuntime.load(model, il, il + 1, ctx_size=prompt + steps + 8, kernel=kernel)
    rng = np.random.default_rng(il)
    n_embd = stage.hparams.n_embd

    def inputs(rows: int) -> np.ndarray:
        if stage.is_first:
            return rng.integers(1000, 2000, size=rows).astype(np.int32)
        return rng.standard_normal((rows, n_embd)).astype(np.float32)

    sids = list(range(batch))
    for sid in sids:
        stage.open_session(sid)
        stage.forward(sid, 0, inputs(prompt))
    samples = []
    for step in range(steps + 1):
        x = inputs(batch)
        t0 = time.perf_counter()
        stage.forward_batch(sids, [prompt + step] * batch, x)
        if step:  # step 0 warms caches up
            samples.append(time.perf_counter() - t0)
    return _fastest_ms(samples)


def _head_ms(model: str, kernel: Kernel, batch: int, steps: int) -> float:
    """Fastest ms of the final stage's logits and greedy sampling of `batch` rows."""
    import numpy as np

    from skippy_zmq.runtime.stage import StageRuntime
    from skippy_zmq.tokens.sampling import Sampler, SamplingParams

    hp_layers = StageRuntime.load(model, 0, 1, ctx_size=8, kernel=kernel).hparams.n_layer
    stage = StageRuntime.load(model, hp_layers - 1, hp_layers, ctx_size=8, kernel=kernel)
    rng = np.random.default_rng(0)
    samplers = [Sampler(SamplingParams.greedy()) for _ in range(batch)]
    samples = []
    for step in range(steps + 1):
        hidden = rng.standard_normal((batch, stage.hparams.n_embd)).astype(np.float32)
        t0 = time.perf_counter()
        logits = stage.logits(hidden)
        for row, sampler in enumerate(samplers):
            sampler.sample(logits[row], [])
        if step:
            samples.append(time.perf_counter() - t0)
    return _fastest_ms(samples)


def main() -> None:
    """Measure, print the table row and the resulting plans."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: Gemma 3 270M Q4_K_M)")
    parser.add_argument("--kernel", default="onnxruntime", help="a float32 kernel (runtime/kernels.py)")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=32, help="positions held before decoding")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads")
    args = parser.parse_args()
    # Before numpy loads: OpenBLAS reads its thread count once.
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(args.threads)

    from skippy_zmq.launch.planner import CostKey, CostModel, MeasuredCosts, plan_stages
    from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS, resolve_model
    from skippy_zmq.model.gguf_model import read_hparams
    from skippy_zmq.runtime.kernels import Kernel

    model = str(resolve_model(args.model or GEMMA3_270M_ALIAS))
    hp = read_hparams(model)
    kernel = Kernel.from_environment(args.kernel)  # $OPENBLAS_NUM_THREADS threads: --threads, set above
    command = (f"python3 -m tools.measure_costs --kernel {args.kernel} --batches {' '.join(map(str, args.batches))} "
               f"--steps {args.steps} --prompt {args.prompt} --threads {args.threads}")
    rows = []
    for batch in args.batches:
        layers = tuple(_layer_ms(model, kernel, il, batch, args.steps, args.prompt) for il in range(hp.n_layer))
        head = _head_ms(model, kernel, batch, args.steps)
        rows.append(MeasuredCosts(batch=batch, layer_ms=layers, head_ms=head, command=command))
        print(f"batch {batch}: layers {sum(layers):.1f} ms ({layers}), head {head:.1f} ms",
              file=sys.stderr)
    print(f"    {CostKey.of(hp)!r}: (")
    for row in rows:
        print(f"        {row!r},")
    print("    ),")
    for row in rows:
        costs = CostModel(layer_costs=row.layer_ms, head_cost=row.head_ms,
                          source=f"measured at batch {row.batch}", unit="ms")
        for n_stages in (2, 3):
            print(plan_stages(costs, n_stages).describe())


if __name__ == "__main__":
    main()
