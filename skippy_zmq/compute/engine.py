"""The ggml engine behind the stage runtime: a stage's layers as ggml graphs over the file's own blocks
and, on the last stage, its output norm and head (docs/ARCHITECTURE.md, "Kernels")."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from skippy_zmq.compute.graphs import POOL_SLOTS, BlockGraphs, NormedHead
from skippy_zmq.compute.kv_cache import Segment
from skippy_zmq.compute.nbits_head import NbitsHead
from skippy_zmq.model.gguf_model import GGUFModel, head_tensor_name

F32 = npt.NDArray[np.float32]


class GgmlEngine:
    """Layers [start, end) as `BlockGraphs` and the last stage's `NormedHead`; the matrices stay the file's."""

    values_transposed = True  # the graphs read V transposed, as llama.cpp's attention does
    pool_slots = POOL_SLOTS  # sessions' caches side by side in one mapping (compute/kv_cache.py SlotPool)

    def __init__(self, graphs: BlockGraphs, head: NormedHead | None) -> None:
        """Hold built graphs and head; use GgmlEngine.load."""
        self.graphs = graphs
        self.head = head
        self.note = ""  # what the stage's load line adds: why the default batch-invariant mode is off, if it is

    @classmethod
    def load(cls, model: GGUFModel, layer_start: int, layer_end: int, *, threads: int, repack: bool,
             nbits_head: Callable[[str, str], bool], say: Callable[[str], None], started: float,
             invariant: bool | None = False) -> GgmlEngine:
        """Bind the layers' blocks; on the last stage the head too, multiplied by MatMulNBits where
        `nbits_head(type name, where)` says so; `invariant`: the batch-invariant mode (BlockGraphs; None: wherever
        the file allows it)."""
        is_last = layer_end == model.hparams.n_layer
        # A MatMulNBits head is decoded and packed on a thread of its own while the layers bind: numpy
        # and ONNX Runtime let go of the GIL for nearly all of it (0.9 s of Gemma 3 270M's start).
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="head") as pool:
            nbits = _start_nbits_head(model, threads, nbits_head, pool) if is_last else None
            graphs = BlockGraphs(model, layer_start, layer_end, threads, repack, invariant=invariant)
            say(f"bound layers [{layer_start}, {layer_end}) as ggml graphs over the file's blocks "
                f"in {time.perf_counter() - started:.1f}s{graphs.pages_note}{graphs.products_note}")
            head = None
            if is_last:
                name = head_tensor_name(model.header)
                head = NormedHead(model, name, threads, repack, nbits=None if nbits is None else nbits.result(),
                                  invariant=invariant)
                say(f"binding output head {name} ({model.tensor_type_name(name)}) from the file's blocks; "
                    f"products by {head.product}")
        engine = cls(graphs, head)
        refusal = graphs.refusal or (head.refusal if head is not None else None)
        if invariant is None:  # the default: say which mode the file allowed
            engine.note = ("; batch-invariant" if engine.invariant else
                           f"; llama.cpp's kernels, since {refusal}")
        return engine

    @property
    def invariant(self) -> bool:
        """True when every row's numbers are one order whatever its pass: the layers' and the head's."""
        return self.graphs.invariant and (self.head is None or self.head.invariant)

    @property
    def weight_bytes(self) -> int:
        """The file's blocks the layers and the head read."""
        return self.graphs.nbytes + (self.head.weight_bytes if self.head is not None else 0)

    def run(self, x: F32, segments: Sequence[Segment], positions: npt.NDArray[np.int64]) -> F32:
        """The residual stream after the layers: (R, n_embd) -> (R, n_embd)."""
        return self.graphs.run(x, segments, positions)


def _start_nbits_head(model: GGUFModel, threads: int, nbits_head: Callable[[str, str], bool],
                      pool: ThreadPoolExecutor) -> Future[NbitsHead] | None:
    """The MatMulNBits head being built on `pool`, where `nbits_head` takes the head's type."""
    head = head_tensor_name(model.header)
    if not nbits_head(model.tensor_type_name(head), f"{model.path}: tensor {head!r}"):
        return None
    hp = model.hparams
    return pool.submit(NbitsHead, model.block_matrix(head, (hp.n_vocab, hp.n_embd)), threads, str(model.path))
