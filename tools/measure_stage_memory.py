"""A stage's resident memory against the planner's estimate (docs/ARCHITECTURE.md, "Memory-aware planning").

    python3 tools/measure_stage_memory.py --tiny
    python3 tools/measure_stage_memory.py --model MODEL.gguf --layers 0 12 --ctx-size 2048 --lanes 4

In this process, as a stage worker has it: imports the worker's modules (pyzmq, numpy, the
runtime), loads layers [A, B) with the default kernel, fills `--lanes` sessions with a
`--prompt` token prompt each, and prints one JSON line: VmRSS after the imports, after the load
and after the prompts, beside launch/memory.py's estimate of the same stage. `--tiny` runs a
2-layer random Gemma 3 (the figure behind RUNTIME_BYTES).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path


def rss_mib() -> float:
    """This process's VmRSS, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a GGUF file (else --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer random Gemma 3 written to a temporary file")
    parser.add_argument("--layers", type=int, nargs=2, metavar=("START", "END"), help="default: every layer")
    parser.add_argument("--ctx-size", type=int, default=2048)
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=198, help="prompt tokens per session")
    args = parser.parse_args(argv)
    if (args.model is None) == (not args.tiny):
        parser.error("give --model or --tiny")

    import numpy as np
    import zmq  # noqa: F401  # a worker's imports, counted in the baseline

    import skippy_zmq.stage.worker  # noqa: F401
    from skippy_zmq.launch.memory import MemoryModel
    from skippy_zmq.model.gguf_file import read_header
    from skippy_zmq.model.gguf_model import read_hparams
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime
    from skippy_zmq.testing.tiny import write_tiny_model

    after_imports = rss_mib()
    path = args.model
    if args.tiny:
        path = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny.gguf", arch="gemma3", n_layer=2, seed=1)
    hp = read_hparams(path)
    start, end = args.layers if args.layers else (0, hp.n_layer)
    kernel = Kernel.from_environment()
    runtime = StageRuntime.load(path, start, end, ctx_size=args.ctx_size, kernel=kernel, weight_cache=None)
    after_load = rss_mib()
    rng = np.random.default_rng(0)
    for session in range(args.lanes):
        runtime.open_session(session)
        tokens = rng.integers(10, min(hp.n_vocab, 30000), args.prompt).astype(np.int32)
        inputs = tokens if start == 0 else rng.standard_normal((args.prompt, hp.n_embd)).astype(np.float32)
        out = runtime.forward(session, 0, inputs)
        if end == hp.n_layer:
            runtime.logits(out[-1:])
    memory = MemoryModel.of_model(read_header(path), hp, quantized=kernel.quantized, ctx_size=args.ctx_size,
                                  lanes=args.lanes,
                                  head_by_nbits=lambda t: kernel.head_by_nbits(t, str(path))).stage(start, end)
    print(json.dumps({
        "model": str(path), "layers": [start, end], "kernel": kernel.name, "ctx_size": args.ctx_size,
        "lanes": args.lanes, "prompt": args.prompt, "rss_mib_after_imports": round(after_imports, 1),
        "rss_mib_after_load": round(after_load, 1), "rss_mib_after_prompts": round(rss_mib(), 1),
        "estimate_mib": round(memory.total / 2**20, 1), "estimate": memory.describe(),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
