"""The ggml engine: the layers as graphs over the file's blocks, the head on the last stage only, and who
multiplies by the head decided by the kernel's rule for the head's type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from skippy_zmq.compute.engine import GgmlEngine
from skippy_zmq.compute.kv_cache import Segment, SessionKV
from skippy_zmq.model.gguf_model import GGUFModel


def _load(path: Path, start: int, end: int, nbits: bool, asked: list[tuple[str, str]]) -> GgmlEngine:
    def nbits_head(type_name: str, where: str) -> bool:
        asked.append((type_name, where))
        return nbits

    return GgmlEngine.load(GGUFModel(path), start, end, threads=1, repack=False, nbits_head=nbits_head,
                           say=lambda _msg: None, started=0.0)


def test_a_middle_stage_has_no_head_and_asks_nothing_about_it(tiny_gemma3_path: Path) -> None:
    asked: list[tuple[str, str]] = []
    engine = _load(tiny_gemma3_path, 1, 3, True, asked)
    assert engine.head is None and asked == [] and engine.note == ""
    assert engine.weight_bytes == engine.graphs.nbytes > 0
    assert (GgmlEngine.values_transposed, GgmlEngine.pool_slots) == (True, 32)


@pytest.mark.parametrize("nbits", [False, True])
def test_the_last_stage_binds_its_head_as_the_kernels_rule_says(tiny_gemma3_path: Path, nbits: bool) -> None:
    asked: list[tuple[str, str]] = []
    model = GGUFModel(tiny_gemma3_path)
    engine = _load(tiny_gemma3_path, 0, model.hparams.n_layer, nbits, asked)
    assert asked == [("Q8_0", f"{tiny_gemma3_path}: tensor 'token_embd.weight'")]
    assert engine.head is not None and ("MatMulNBits" in engine.head.product) == nbits
    assert engine.weight_bytes == engine.graphs.nbytes + engine.head.weight_bytes


def test_run_is_the_graphs_pass(tiny_llama_path: Path) -> None:
    engine = _load(tiny_llama_path, 0, 2, False, [])
    hp = GGUFModel(tiny_llama_path).hparams
    x = np.random.default_rng(2).standard_normal((3, hp.n_embd)).astype(np.float32)

    def kv() -> SessionKV:
        return SessionKV(1, 2, hp.n_head_kv, hp.head_dim, 16, values_transposed=True)

    positions = np.arange(3, dtype=np.int64)
    a, b = kv(), kv()
    for cache in (a, b):
        cache.will_write(3)
    assert np.array_equal(engine.run(x, [Segment(a, 0, 3, 0)], positions),
                          engine.graphs.run(x, [Segment(b, 0, 3, 0)], positions))
