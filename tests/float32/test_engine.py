"""The float32 engine: the layers dequantized and bound by the kernel's `bind`, the head on the last stage,
the weight cache used and summarized; a pass is its blocks one after another."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from skippy_zmq.compute.kv_cache import Segment, SessionKV
from skippy_zmq.float32.engine import FloatEngine, FloatHead
from skippy_zmq.float32.layers import block, rms_norm
from skippy_zmq.float32.projections import NumpyProjection, bind_numpy
from skippy_zmq.float32.weight_cache import WeightCache
from skippy_zmq.model.gguf_model import GGUFModel


def _load(path: Path, start: int, end: int, cache: WeightCache | None = None) -> FloatEngine:
    return FloatEngine.load(GGUFModel(path), start, end, 16, bind=lambda w_t: bind_numpy(w_t, 1), cache=cache,
                            say=lambda _msg: None, started=0.0)


def test_a_middle_stage_holds_its_blocks_and_no_head(tiny_llama_path: Path) -> None:
    engine = _load(tiny_llama_path, 1, 3)
    assert [b.index for b in engine.blocks] == [1, 2] and engine.head is None and engine.note == ""
    assert all(isinstance(b.qkv, NumpyProjection) for b in engine.blocks)
    assert engine.weight_bytes == sum(b.n_bytes() for b in engine.blocks)
    assert (FloatEngine.values_transposed, FloatEngine.pool_slots) == (False, 0)


def test_the_last_stage_holds_the_norm_and_the_head(tiny_gemma3_path: Path) -> None:
    n_layer = GGUFModel(tiny_gemma3_path).hparams.n_layer
    engine = _load(tiny_gemma3_path, n_layer - 1, n_layer)
    head = engine.head
    assert isinstance(head, FloatHead)
    x = np.random.default_rng(4).standard_normal((2, head.in_features)).astype(np.float32)
    assert np.array_equal(head(x, reuse=True), head.head(rms_norm(x, head.norm, head.eps)))
    assert engine.weight_bytes == engine.blocks[0].n_bytes() + head.weight_bytes


def test_a_pass_is_the_blocks_in_order(tiny_llama_path: Path) -> None:
    engine = _load(tiny_llama_path, 0, 2)
    hp = engine.hparams
    x = np.random.default_rng(5).standard_normal((3, hp.n_embd)).astype(np.float32)
    positions = np.arange(3, dtype=np.int64)
    a, b = (SessionKV(1, 2, hp.n_head_kv, hp.head_dim, 16) for _ in range(2))
    expected = x
    for slot, layer in enumerate(engine.blocks):
        expected = block(expected, layer, slot, hp, [Segment(b, 0, 3, 0)], positions)
    assert np.array_equal(engine.run(x, [Segment(a, 0, 3, 0)], positions), expected)


def test_the_weight_cache_is_filled_then_used_and_summarized(tiny_llama_path: Path, tmp_path: Path) -> None:
    cache = WeightCache(tmp_path / "weights", 2**30)
    first = _load(tiny_llama_path, 0, 2, cache)
    again = _load(tiny_llama_path, 0, 2, cache)
    assert first.note.startswith("; ") and again.note.startswith("; ") and first.note != again.note
    assert any((tmp_path / "weights").rglob("*.npy"))
    x = np.ones((1, first.hparams.n_embd), np.float32)
    runs = []
    for engine in (first, again):
        kv = SessionKV(1, 2, engine.hparams.n_head_kv, engine.hparams.head_dim, 16)
        runs.append(engine.run(x, [Segment(kv, 0, 1, 0)], np.zeros(1, np.int64)))
    assert np.array_equal(runs[0], runs[1])
