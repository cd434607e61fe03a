"""Time ggml's products of a file's own matrices, as a stage runs them (docs/BENCHMARKS.md, "A model that
needs the pipeline").

One `MatmulGraphs` per matrix (repacked where the CPU backend repacks it, as stages do by default), each
of the asked row counts multiplied `--repeats` times over every chosen matrix; the least time of a
repeat is printed, in ms, per tensor kind and row count. The library is the package's ggml unless
$SKIPPY_ZMQ_GGML_LIB names another build's, so two builds compare by running this once with each,
taking turns:

    python3 tools/probe_products.py --model FILE --kinds ffn_down,ffn_gate --layers 0 12 --per-kind 4
    SKIPPY_ZMQ_GGML_LIB=/tmp/lsrv/llama_cpp_python-0.3.36/build/bin python3 tools/probe_products.py ...

Q6_K and repacked Q4_K matrices multiply as stages multiply them ($SKIPPY_ZMQ_Q6K and $SKIPPY_ZMQ_Q4K,
docs/ARCHITECTURE.md "The Q6_K product" and "The Q4_K product"), so the package's products and ggml's compare
the same way:

    SKIPPY_ZMQ_Q6K=ggml python3 tools/probe_products.py --model FILE --kinds ffn_down --rows 1,4,8,16,32
    SKIPPY_ZMQ_Q4K=ggml python3 tools/probe_products.py --model FILE --kinds ffn_gate --rows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from skippy_zmq.compute import ggml
from skippy_zmq.model.gguf_model import BlockMatrix, GGUFModel


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--kinds", default="ffn_down,ffn_gate", help="blk.N.KIND.weight kinds, comma-separated")
    parser.add_argument("--layers", type=int, nargs=2, default=(0, 12), metavar=("START", "END"))
    parser.add_argument("--per-kind", type=int, default=4, help="matrices of each kind and type, from START on")
    parser.add_argument("--rows", default="1,4", help="row counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repack", type=int, choices=(0, 1), default=1)
    args = parser.parse_args(argv)
    model = GGUFModel(args.model)
    rows = [int(part) for part in args.rows.split(",") if part.strip()]
    rng = np.random.default_rng(0)
    results: dict[str, float] = {}
    for kind in (part.strip() for part in args.kinds.split(",") if part.strip()):
        by_type: dict[str, list[BlockMatrix]] = {}
        for layer in range(*args.layers):
            name = f"blk.{layer}.{kind}.weight"
            matrix = model.block_matrix(name, model.header.tensor(name).shape)
            chosen = by_type.setdefault(matrix.type_name, [])
            if len(chosen) < args.per_kind:
                chosen.append(matrix)
        for type_name, matrices in sorted(by_type.items()):
            products = [ggml.MatmulGraphs([m], args.threads, m.name, repack=bool(args.repack)) for m in matrices]
            for count in rows:
                x = rng.standard_normal((count, products[0].k)).astype(np.float32)
                for product in products:  # graphs built, pages touched
                    product(x)
                times = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    for product in products:
                        product(x)
                    times.append(time.perf_counter() - started)
                results[f"{kind} {type_name} x{len(matrices)} rows {count}"] = round(1000 * min(times), 2)
    print(json.dumps({"library": os.environ.get(ggml.LIB_ENV, "package"), "q6k": ggml.q6k_described(),
                      "q4k": ggml.q4k_described(), "ms": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
