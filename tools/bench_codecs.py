"""Benchmark the activation codecs against numpy.copyto of the same bytes, side by side.

    python3 tools/bench_codecs.py [--sizes 4KiB,1MiB,16MiB] [--repeat 7] [--json out.json]

Prints a markdown table: size (of the f32 array), codec, op, GB/s of f32 input (decode:
f32 output), the copyto GB/s measured in the same repetitions, and their ratio.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.wire import codecs
from skippy_zmq.wire.codecs import CODECS, ActivationCodec, decode_array, encode_array, select_lossless

_UNITS = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "B": 1}
DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB,64MiB"
ROW_LEN = 640  # n_embd of gemma3-270m: the row length of real activation frames
MIN_BATCH_SECONDS = 0.02  # repeat small ops so one timing covers at least this long


@attrs.frozen
class Result:
    """One benchmark row."""

    size_bytes: int
    codec: str
    op: str
    gbps: float
    copy_gbps: float

    @property
    def ratio(self) -> float:
        """Speed relative to numpy.copyto of the same bytes in the same run."""
        return self.gbps / self.copy_gbps


def parse_size(text: str) -> int:
    """'16MiB' -> 16777216; plain integers are bytes."""
    upper = text.strip().upper()
    for unit, factor in _UNITS.items():
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * factor)
    return int(upper)


def format_size(nbytes: int) -> str:
    """16777216 -> '16 MiB'."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


def activations(nbytes: int, rng: np.random.Generator) -> npt.NDArray[np.float32]:
    """Normal(0, 4) f32 values shaped (rows, ROW_LEN) like a hidden state (or 1-D if tiny)."""
    count = nbytes // 4
    values = (rng.standard_normal(count) * 4.0).astype(np.float32)
    if count % ROW_LEN == 0:
        return values.reshape(-1, ROW_LEN)
    return values


def _batch_size(op: Callable[[], object]) -> int:
    start = time.perf_counter()
    op()
    elapsed = time.perf_counter() - start
    return max(1, int(MIN_BATCH_SECONDS / max(elapsed, 1e-7)))


def _time(op: Callable[[], object], batch: int) -> float:
    start = time.perf_counter()
    for _ in range(batch):
        op()
    return (time.perf_counter() - start) / batch


def measure(
    op: Callable[[], object], values: npt.NDArray[np.float32], repeat: int
) -> tuple[float, float]:
    """Best-of-``repeat`` GB/s of ``op`` and of copyto of ``values``, interleaved."""
    target = np.empty_like(values)

    def copy() -> None:
        np.copyto(target, values)

    op_batch, copy_batch = _batch_size(op), _batch_size(copy)
    op_best = copy_best = float("inf")
    for _ in range(repeat):
        copy_best = min(copy_best, _time(copy, copy_batch))
        op_best = min(op_best, _time(op, op_batch))
    return values.nbytes / op_best / 1e9, values.nbytes / copy_best / 1e9


def bench_size(nbytes: int, repeat: int, rng: np.random.Generator) -> list[Result]:
    """All codec rows for one array size."""
    values = activations(nbytes, rng)
    rows: list[Result] = []

    def add(codec: str, op: str, fn: Callable[[], object]) -> None:
        gbps, copy_gbps = measure(fn, values, repeat)
        rows.append(Result(nbytes, codec, op, gbps, copy_gbps))

    # Every codec of the table but raw, which is zero copy: nothing to time.
    for codec in (row.codec for row in CODECS if row.codec is not ActivationCodec.RAW_F32_V1):
        payload = encode_array(codec, values).tobytes()
        add(codec.wire_name, "encode", functools.partial(encode_array, codec, values))
        add(
            codec.wire_name, "decode", functools.partial(decode_array, codec, payload, values.shape)
        )
    # Reference: numpy's own float16 casts, which the f16 kernels replace.
    halves = values.astype(np.float16)
    add("numpy astype float16 (reference)", "encode", functools.partial(values.astype, np.float16))
    add("numpy astype float16 (reference)", "decode", functools.partial(halves.astype, np.float32))
    # select_lossless on frames whose winner is bf16 / f16 (the full-scan cases).
    bf16_exact = (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    f16_exact = values.astype(np.float16).astype(np.float32)
    for label, frame in (("bf16-exact", bf16_exact), ("f16-exact", f16_exact)):
        chosen, _ = select_lossless([frame])
        gbps, copy_gbps = measure(functools.partial(select_lossless, [frame]), frame, repeat)
        rows.append(Result(nbytes, f"{label} -> {chosen.wire_name}", "select", gbps, copy_gbps))
    return rows


def machine_facts() -> dict[str, Any]:
    """CPU model, core count and numpy version, for the report."""
    model = platform.processor() or "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "block_elements": codecs._BLOCK,
        # Other processes share the CPUs and memory bus; read the figures with this in mind.
        "loadavg_1min": round(os.getloadavg()[0], 2),
    }


def markdown(results: list[Result]) -> str:
    """The results as a markdown table."""
    lines = [
        "| size | codec | op | GB/s | copyto GB/s | ratio to copyto |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {format_size(r.size_bytes)} | {r.codec} | {r.op} | {r.gbps:.2f} "
            f"| {r.copy_gbps:.2f} | {r.ratio:.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"comma list (default {DEFAULT_SIZES})"
    )
    parser.add_argument("--repeat", type=int, default=7, help="timed repetitions, best kept")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--block", type=int, help="kernel block size in elements (tuning)")
    args = parser.parse_args()
    if args.block:
        codecs._set_block(args.block)
    rng = np.random.default_rng(20261130)
    facts = machine_facts()
    print(", ".join(f"{k}: {v}" for k, v in facts.items()))
    print()
    results: list[Result] = []
    for size in (parse_size(s) for s in args.sizes.split(",")):
        results.extend(bench_size(size, args.repeat, rng))
    print(markdown(results))
    if args.json:
        payload = {
            "machine": facts,
            "results": [attrs.asdict(r) | {"ratio": r.ratio} for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
