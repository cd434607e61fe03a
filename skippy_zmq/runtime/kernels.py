"""The kernel a process computes with, chosen once (docs/ARCHITECTURE.md, "Kernels"): one `KernelRow` per
kernel in `KERNELS`, each naming the engine a stage loads its layers on.

`ggml`, the default, is the ggml engine (compute/engine.py): llama.cpp's numbers from the file's own
blocks. `onnxruntime` and `numpy` are the float32 engine (float32/engine.py) with that library's
products of the dequantized weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq import defaults
from skippy_zmq.compute import ggml, nbits_head
from skippy_zmq.compute.engine import GgmlEngine
from skippy_zmq.compute.kv_cache import Segment
from skippy_zmq.errors import ModelLoadError
from skippy_zmq.float32.engine import FloatEngine
from skippy_zmq.float32.projections import Binder, Projection, bind_numpy, bind_onnx, onnx_unavailable
from skippy_zmq.float32.weight_cache import WeightCache
from skippy_zmq.model.gguf_model import GGUFModel

F32 = npt.NDArray[np.float32]

KERNEL_ENV = "SKIPPY_ZMQ_KERNEL"
REPACK_ENV = "SKIPPY_ZMQ_REPACK"
"""0 keeps every ggml matrix the file's bytes in place (no copy); 1, the default, repacks what the CPU can."""
HEAD_ENV = "SKIPPY_ZMQ_HEAD"
"""Who multiplies by a quantized kernel's head: `auto` (the default: a Q8_0 head by the package's Q8_0 product
in ggml's graph where it runs, llama.cpp's logits bit for bit; else MatMulNBits where the head's type has a row
in compute/nbits_head.NBITS_TYPES and ONNX Runtime is installed; else ggml), `ggml` or `nbits`."""
HEAD_ROUTES = ("auto", "ggml", "nbits")
INVARIANT_ENV = defaults.BATCH_INVARIANT_ENV
"""`auto` (the default): the ggml kernel computes every row in one order whatever its pass wherever the stage's
file allows it, and llama.cpp's kernels elsewhere; 1: that mode or a refusal naming why not; 0: llama.cpp's."""
INVARIANT_MODES: dict[str, bool | None] = {"auto": None, "1": True, "0": False}
THREADS_ENV = "OPENBLAS_NUM_THREADS"  # the worker's --threads sets it before numpy loads
DEFAULT_KERNEL = "ggml"
"""What a stage runs when nothing names a kernel: llama.cpp's numbers from the file's blocks."""
FALLBACK_KERNEL = "onnxruntime"
"""The default when ggml's library is not installed (the `model` extra): float32, and the reason is logged."""


class StageHead(Protocol):
    """The last stage's output norm and head, as an engine binds them."""

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the head reads."""

    def __call__(self, x: F32, *, reuse: bool = False) -> F32:
        """Logits (R, n_vocab) of hidden states (R, n_embd); `reuse` may return the head's own buffer."""

    def normed(self, x: F32) -> F32:
        """The output norm of hidden states, the rows the head multiplies: (R, n_embd)."""


class StageEngine(Protocol):
    """A stage's layers (and the last stage's head) on one engine, chosen once at load."""

    @property
    def head(self) -> StageHead | None:
        """The output norm and head on the last stage, else None."""

    @property
    def note(self) -> str:
        """What the stage's load line adds (the weight cache's summary), or ''."""

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the layers and the head read."""

    @property
    def invariant(self) -> bool:
        """True when a row's numbers do not depend on its pass (docs/ARCHITECTURE.md, "Batch-invariant mode")."""

    def run(self, x: F32, segments: Sequence[Segment], positions: npt.NDArray[np.int64]) -> F32:
        """The residual stream after the layers: (R, n_embd) -> (R, n_embd)."""


@attrs.frozen
class KernelRow:
    """One way to compute: a check that it can run here, its numerics, and the engine it loads; a
    float32 kernel also names how it binds one matrix (`bind`)."""

    unavailable: Callable[[], str | None]
    numerics: str
    bind: Binder | None = None  # None: the ggml engine, which computes from the file's blocks


KERNELS: dict[str, KernelRow] = {
    "onnxruntime": KernelRow(onnx_unavailable, "float32 products of the dequantized weights", bind=bind_onnx),
    "numpy": KernelRow(lambda: None, "float32 products of the dequantized weights", bind=bind_numpy),
    "ggml": KernelRow(ggml.unavailable, "the file's quantized blocks, activations quantized as llama.cpp does"),
}


@attrs.frozen
class Kernel:
    """A kernel chosen for this process: its name and how many threads each product may use."""

    name: str = attrs.field()
    threads: int = attrs.field(default=1)
    fallback_reason: str | None = attrs.field(default=None, eq=False)  # why the default could not run
    # ggml: copy the matrices its CPU backend can repack into their interleaved layout, as llama.cpp
    # does by default (many rows per block read: a batch of sessions costs little more than one)
    repack: bool = attrs.field(default=True)
    # the head's product with a quantized kernel (HEAD_ENV): MatMulNBits is faster on many rows
    head: str = attrs.field(default="auto", validator=attrs.validators.in_(HEAD_ROUTES))
    # ggml: a row's logits the same bits whatever else is in its pass (INVARIANT_ENV); None: where the file allows
    invariant: bool | None = attrs.field(default=False)

    @name.validator
    def _check_name(self, _attribute: object, value: str) -> None:
        if value not in KERNELS:
            raise ModelLoadError(f"kernel {value!r} is unknown; expected one of {sorted(KERNELS)}")
        why = KERNELS[value].unavailable()
        if why is not None:
            raise ModelLoadError(f"kernel {value!r} cannot run here: {why}")

    @threads.validator
    def _check_threads(self, _attribute: object, value: int) -> None:
        if value < 1:
            raise ModelLoadError(f"kernel threads {value} must be >= 1")

    @classmethod
    def from_environment(cls, name: str | None = None) -> Kernel:
        """`name`, else $SKIPPY_ZMQ_KERNEL, else the default (ggml, or onnxruntime where ggml cannot
        run, saying why in `fallback_reason`), with $OPENBLAS_NUM_THREADS threads (default 1)."""
        name = name or os.environ.get(KERNEL_ENV, "").strip()
        fallback = None
        if not name:
            fallback = KERNELS[DEFAULT_KERNEL].unavailable()
            name = DEFAULT_KERNEL if fallback is None else FALLBACK_KERNEL
        raw = os.environ.get(THREADS_ENV, "").strip() or "1"
        try:
            threads = int(raw)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ModelLoadError(f"${THREADS_ENV} = {raw!r} is not a thread count; expected an integer >= 1")
        repack = os.environ.get(REPACK_ENV, "1").strip()
        if repack not in ("0", "1"):
            raise ModelLoadError(f"${REPACK_ENV} = {repack!r}; expected 1 (repack, the default) or 0")
        head = os.environ.get(HEAD_ENV, "").strip() or "auto"
        if head not in HEAD_ROUTES:
            raise ModelLoadError(f"${HEAD_ENV} = {head!r}; expected one of {list(HEAD_ROUTES)}")
        invariant = os.environ.get(INVARIANT_ENV, "").strip() or "auto"
        if invariant not in INVARIANT_MODES:
            raise ModelLoadError(f"${INVARIANT_ENV} = {invariant!r}; expected auto (the default), 1 or 0")
        # the mode is the ggml engine's: a float32 kernel has no such choice
        return cls(name, threads, fallback_reason=fallback, repack=repack == "1", head=head,
                   invariant=INVARIANT_MODES[invariant] if KERNELS[name].bind is None else False)

    def head_by_nbits(self, type_name: str, where: str) -> bool:
        """Whether a quantized kernel's head of `type_name` is multiplied by MatMulNBits (HEAD_ENV): `auto`
        where it can run and a Q8_0 head has no package product here, `nbits` always (refused, naming the type or
        the missing library, where it cannot)."""
        if not self.quantized or self.head == "ggml":
            return False
        if self.head == "auto" and type_name == "Q8_0" and not isinstance(ggml.q80_product(), str):
            # faster than MatMulNBits at 1 to 16 rows on two threads, and llama.cpp's logits bit for bit
            # (docs/BENCHMARKS.md, "The Q8_0 product")
            return False
        why = nbits_head.unavailable()
        if type_name not in nbits_head.NBITS_TYPES:
            why = f"MatMulNBits takes {sorted(nbits_head.NBITS_TYPES)}, not {type_name}"
        if why is None:
            return True
        if self.head == "nbits":
            raise ModelLoadError(f"{where}: ${HEAD_ENV} = nbits, but the head cannot run there: {why}")
        return False

    @property
    def described(self) -> str:
        """The kernel's name for a load line, with why the default could not run when it fell back."""
        if self.fallback_reason is None:
            if self.quantized:
                mode = {True: ", batch-invariant", False: ", llama.cpp's kernels", None: ""}[self.invariant]
                return f"the {self.name} kernel ({'repacking' if self.repack else 'not repacking'} weights{mode})"
            return f"the {self.name} kernel"
        return f"the {self.name} kernel ({DEFAULT_KERNEL}, the default, cannot run here: {self.fallback_reason})"

    @property
    def quantized(self) -> bool:
        """True when the kernel computes from the file's blocks (the ggml engine), not float32."""
        return KERNELS[self.name].bind is None

    @property
    def engine(self) -> type[GgmlEngine] | type[FloatEngine]:
        """The engine class the kernel loads a stage on (its KV layout: `values_transposed`, `pool_slots`)."""
        return GgmlEngine if self.quantized else FloatEngine

    def bind(self, w_t: F32) -> Projection:
        """The matrix w_t (K, N) ready for float32 products; the kernel may keep its own copy."""
        binder = KERNELS[self.name].bind
        if binder is None:
            raise ModelLoadError(f"kernel {self.name!r} computes from a file's blocks; it binds no float32 matrix")
        return binder(w_t, self.threads)

    def load_engine(self, model: GGUFModel, layer_start: int, layer_end: int, ctx_size: int, *,
                    cache: WeightCache | None, say: Callable[[str], None], started: float) -> StageEngine:
        """Layers [layer_start, layer_end) of `model` (and the head on the last stage) on this kernel's engine;
        `cache` holds a float32 engine's dequantized weights."""
        if self.quantized:
            return GgmlEngine.load(model, layer_start, layer_end, threads=self.threads, repack=self.repack,
                                   nbits_head=self.head_by_nbits, say=say, started=started, invariant=self.invariant)
        return FloatEngine.load(model, layer_start, layer_end, ctx_size, bind=self.bind, cache=cache,
                                say=say, started=started)
