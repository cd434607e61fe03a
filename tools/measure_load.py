"""Load one stage of Gemma 3 270M and report its load time, resident memory and peak.

    python3 tools/measure_load.py --layers 17 18 [--kernel onnxruntime|numpy] [--cold] [--no-slices]
        [--check-tensors]

`--cold` loads with an empty weight cache in a temporary directory (the first start of a
stage: dequantize, write the cache, bind); otherwise the usual cache is used (warm when an
earlier run filled it). `--no-slices` binds even the head whole, as before ColumnSplit
(skippy_zmq/runtime/kernels.py). A second line says what the weight cache did: arrays mapped and
written, and the time spent checking their digests. `--check-tensors` first scans the stage's
tensors as `worker --check-tensors` does (model/tensor_check.py) and prints what it took.
Peak is the process's maximum resident set (`ru_maxrss`), which, unlike a cgroup's figure,
leaves out the page cache.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path


def main() -> None:
    """Load the stage once in this process and print one line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs=2, metavar=("START", "END"), required=True)
    parser.add_argument("--kernel", default="onnxruntime", help="matrix kernel (skippy_zmq/runtime/kernels.py)")
    parser.add_argument("--threads", type=int, default=1, help="threads per product")
    parser.add_argument("--cold", action="store_true", help="start from an empty weight cache")
    parser.add_argument("--no-slices", action="store_true", help="bind every matrix whole (onnxruntime)")
    parser.add_argument("--check-tensors", action="store_true", help="scan the stage's tensors first, timed")
    args = parser.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # before numpy loads
    from skippy_zmq.float32.weight_cache import WeightCache
    from skippy_zmq.model.catalog import ensure_gemma3_270m
    from skippy_zmq.model.gguf_model import ModelHParams
    from skippy_zmq.model.tensor_check import check_stage_tensors
    from skippy_zmq.runtime import kernels
    from skippy_zmq.runtime.kernels import Kernel
    from skippy_zmq.runtime.stage import StageRuntime

    if args.no_slices:
        kernels.SLICE_BYTES = 1 << 62
    model = ensure_gemma3_270m()
    start, end = args.layers
    if args.check_tensors:
        began = time.perf_counter()
        report = check_stage_tensors(model, start, end, ModelHParams.from_gguf(model).n_layer)
        print(f"layers [{start}, {end}) check-tensors: {report.summary()}; {time.perf_counter() - began:.2f} s "
              "with the header read")
    with tempfile.TemporaryDirectory() as scratch:
        cache = WeightCache(Path(scratch) / "weights", 4 << 30) if args.cold else "environment"
        messages: list[str] = []
        started = time.perf_counter()
        stage = StageRuntime.load(model, start, end, weight_cache=cache, kernel=Kernel(args.kernel, args.threads),
                                  progress=messages.append)
        load_s = time.perf_counter() - started
        with open("/proc/self/statm") as statm:
            rss_mib = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
        print(f"layers [{start}, {end}) kernel {args.kernel} {'cold' if args.cold else 'warm'}: load {load_s:.1f} s, "
              f"weights {stage.weight_bytes() >> 20} MiB, RSS {rss_mib} MiB, peak RSS {peak_mib} MiB")
        cached = messages[-1].partition("; weight cache ")[2] if messages else ""
        if cached:  # what the cache did, with the time its digests took (float32/weight_cache.py)
            print(f"  weight cache {cached}")


if __name__ == "__main__":
    main()
