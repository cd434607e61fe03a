"""`bench codecs`: the activation codecs against `numpy.copyto` of the same bytes, side by side.

For each size (of the float32 array) and codec: encode and decode GB/s (of the float32 side), and the
copyto GB/s measured in the same repetitions, interleaved, so their ratio holds on a shared host;
numpy's own float16 casts as a reference; `select_lossless` on frames whose winner is bf16 or f16
(the full-scan cases). Best of `repeat` timings; small operations are repeated so one timing lasts
at least MIN_BATCH_SECONDS.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.bench.report import Report, markdown_table
from skippy_zmq.wire.codecs import CODECS, ActivationCodec, decode_array, encode_array, select_lossless

ROW_LEN = 640
"""n_embd of Gemma 3 270M: the row length of real activation frames."""
MIN_BATCH_SECONDS = 0.02
"""Small operations are repeated until one timing covers at least this long."""
REFERENCE = "numpy astype float16 (reference)"
"""The row name of numpy's float16 casts, which the f16 codec's kernels replace."""


@attrs.frozen
class CodecRow:
    """One operation at one size: its GB/s and copyto's in the same repetitions."""

    size_bytes: int
    codec: str
    op: str
    gbps: float
    copy_gbps: float

    @property
    def ratio(self) -> float:
        """Speed relative to numpy.copyto of the same bytes."""
        return self.gbps / self.copy_gbps

    def as_json(self) -> dict[str, Any]:
        """The row's figures."""
        return {"size_bytes": self.size_bytes, "codec": self.codec, "op": self.op, "gbps": round(self.gbps, 3),
                "copy_gbps": round(self.copy_gbps, 3), "ratio": round(self.ratio, 4)}


def format_size(nbytes: int) -> str:
    """16777216 -> '16 MiB'."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


def activations(nbytes: int, rng: np.random.Generator) -> npt.NDArray[np.float32]:
    """Normal(0, 4) float32 values shaped (rows, ROW_LEN) like a hidden state (1-D when they do not fill rows)."""
    count = max(1, nbytes // 4)
    values = (rng.standard_normal(count) * 4.0).astype(np.float32)
    return values.reshape(-1, ROW_LEN) if count % ROW_LEN == 0 else values


def _batch_size(op: Callable[[], object]) -> int:
    start = time.perf_counter()
    op()
    return max(1, int(MIN_BATCH_SECONDS / max(time.perf_counter() - start, 1e-7)))


def _time(op: Callable[[], object], batch: int) -> float:
    start = time.perf_counter()
    for _ in range(batch):
        op()
    return (time.perf_counter() - start) / batch


def measure(op: Callable[[], object], values: npt.NDArray[np.float32], repeat: int) -> tuple[float, float]:
    """Best-of-`repeat` GB/s of `op` over `values`' bytes, and of copyto of `values`, interleaved."""
    target = np.empty_like(values)

    def copy() -> None:
        np.copyto(target, values)

    op_batch, copy_batch = _batch_size(op), _batch_size(copy)
    op_best = copy_best = float("inf")
    for _ in range(repeat):
        copy_best = min(copy_best, _time(copy, copy_batch))
        op_best = min(op_best, _time(op, op_batch))
    return values.nbytes / op_best / 1e9, values.nbytes / copy_best / 1e9


def bench_size(nbytes: int, repeat: int, rng: np.random.Generator) -> list[CodecRow]:
    """Every row of one array size."""
    values = activations(nbytes, rng)
    rows: list[CodecRow] = []

    def add(codec: str, op: str, fn: Callable[[], object], frame: npt.NDArray[np.float32] = values) -> None:
        gbps, copy_gbps = measure(fn, frame, repeat)
        rows.append(CodecRow(values.nbytes, codec, op, gbps, copy_gbps))

    # Every codec of the table but raw, which is zero copy: nothing to time.
    for codec in (row.codec for row in CODECS if row.codec is not ActivationCodec.RAW_F32_V1):
        payload = encode_array(codec, values).tobytes()
        add(codec.wire_name, "encode", functools.partial(encode_array, codec, values))
        add(codec.wire_name, "decode", functools.partial(decode_array, codec, payload, values.shape))
    halves = values.astype(np.float16)
    add(REFERENCE, "encode", functools.partial(values.astype, np.float16))
    add(REFERENCE, "decode", functools.partial(halves.astype, np.float32))
    bf16_exact = (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    f16_exact = values.astype(np.float16).astype(np.float32)
    for label, frame in (("bf16-exact", bf16_exact), ("f16-exact", f16_exact)):
        chosen, _ = select_lossless([frame])
        add(f"{label} -> {chosen.wire_name}", "select", functools.partial(select_lossless, [frame]), frame)
    return rows


def run_codecs_bench(sizes: Sequence[int], repeat: int, report: Report,
                     progress: Callable[[str], None], seed: int = 20261130) -> list[CodecRow]:
    """Every size's rows; one report row each."""
    rng = np.random.default_rng(seed)
    rows: list[CodecRow] = []
    for index, size in enumerate(sizes, start=1):
        progress(f"size {index}/{len(sizes)}: {format_size(size)}, best of {repeat}")
        for row in bench_size(size, repeat, rng):
            rows.append(row)
            report.add({"repeat": repeat, "numpy": np.__version__, **row.as_json()})
    return rows


def codecs_table(rows: Sequence[CodecRow]) -> str:
    """Sizes, codecs and operations with their GB/s, copyto's, and the ratio."""
    return markdown_table(("size", "codec", "op", "GB/s", "copyto GB/s", "ratio to copyto"), [
        (format_size(r.size_bytes), r.codec, r.op, f"{r.gbps:.2f}", f"{r.copy_gbps:.2f}", f"{r.ratio:.1%}")
        for r in rows
    ], "rllrrr")
