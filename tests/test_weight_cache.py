"""The dequantized-weight cache: cold write, warm memory-mapped load, fallbacks, bounds."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from skippy_zmq.errors import ConfigError
from skippy_zmq.runtime.kernels import Kernel, NumpyProjection
from skippy_zmq.runtime.stage import FloatHead, StageRuntime
from skippy_zmq.runtime.weight_cache import MAX_MB_ENV, CacheEntry, WeightCache

F32 = npt.NDArray[np.float32]
PROMPT = np.array([2, 300, 301, 460, 302, 310, 311, 512, 600, 700, 320], dtype=np.int32)


def _run(stages: list[StageRuntime], steps: int = 6) -> list[F32]:
    """Greedy logits of a prompt and `steps` decode steps through a chain of stages."""
    for stage in stages:
        stage.open_session(1)
    out: list[F32] = []
    chunk, pos = PROMPT, 0
    for _ in range(steps + 1):
        x: np.ndarray = chunk
        for stage in stages:
            x = stage.forward(1, pos, x)
        out.append(stages[-1].logits(x[-1:])[0])
        pos += len(chunk)
        chunk = np.array([int(np.argmax(out[-1]))], dtype=np.int32)
    return out


def _split(path: Path, cache: WeightCache | None, cut: int, n_layer: int,
           kernel: Kernel | None = None) -> list[StageRuntime]:
    return [StageRuntime.load(path, 0, cut, ctx_size=64, weight_cache=cache, kernel=kernel),
            StageRuntime.load(path, cut, n_layer, ctx_size=64, weight_cache=cache, kernel=kernel)]


NUMPY = Kernel("numpy")  # keeps the arrays it was given, so a test can see where they live


def _arrays(stage: StageRuntime) -> list[np.ndarray]:
    """The matrices a numpy-kernel stage multiplies by: every block's four, and its head."""
    projections = [p for b in stage.blocks for p in (b.qkv, b.wo, b.gate_up, b.down)]
    if stage.head is not None:
        assert isinstance(stage.head, FloatHead)
        projections.append(stage.head.head)
    assert all(isinstance(p, NumpyProjection) for p in projections)
    return [p.w_t for p in projections if isinstance(p, NumpyProjection)]


def _entries(cache: WeightCache) -> list[Path]:
    return sorted(p for p in cache.root.iterdir() if p.is_dir())


def _is_mapped(array: np.ndarray) -> bool:
    return not array.flags.owndata and not array.flags.writeable


@pytest.mark.parametrize(("arch", "n_layer"), [("llama", 4), ("gemma3", 7)])
def test_warm_load_maps_the_cold_arrays_and_computes_the_same_bits(
    request: pytest.FixtureRequest, tmp_path: Path, arch: str, n_layer: int
) -> None:
    path: Path = request.getfixturevalue(f"tiny_{arch}_path")
    cache = WeightCache(tmp_path / "weights", 2**30)
    reference = _run(_split(path, None, 2, n_layer))
    cold = _split(path, cache, 2, n_layer)
    (entry,) = _entries(cache)
    names = sorted(p.name for p in entry.glob("*.npy"))
    assert "output_t.npy" in names and "blk.0.wqkv_t.npy" in names and "meta.json" in os.listdir(entry)
    messages: list[str] = []
    warm = [StageRuntime.load(path, 0, 2, ctx_size=64, weight_cache=cache, kernel=NUMPY),
            StageRuntime.load(path, 2, n_layer, ctx_size=64, weight_cache=cache, progress=messages.append,
                              kernel=NUMPY)]
    assert all(m.endswith("from the weight cache") for m in messages if m.startswith("loaded layer"))
    assert "arrays mapped, 0 written" in messages[-1]
    assert warm[1].head is not None and all(_is_mapped(a) for s in warm for a in _arrays(s))
    numpy_reference = _run(_split(path, None, 2, n_layer, NUMPY))
    assert all(np.array_equal(a, b) for a, b in zip(_run(warm), numpy_reference, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(_run(cold), reference, strict=True))
    # Another cut of the same file reuses the same arrays.
    regrouped = _run(_split(path, cache, 3, n_layer))
    assert all(np.array_equal(a, b) for a, b in zip(regrouped, reference, strict=True))
    assert _entries(cache) == [entry]


def test_a_single_stage_with_a_tied_head_computes_the_same_bits_warm(tiny_gemma3_path: Path,
                                                                     tmp_path: Path) -> None:
    cache = WeightCache(tmp_path / "weights", 2**30)
    reference = _run([StageRuntime.load(tiny_gemma3_path, 0, 7, ctx_size=64, weight_cache=None)])
    StageRuntime.load(tiny_gemma3_path, 0, 7, ctx_size=64, weight_cache=cache)
    warm = _run([StageRuntime.load(tiny_gemma3_path, 0, 7, ctx_size=64, weight_cache=cache)])
    assert all(np.array_equal(a, b) for a, b in zip(warm, reference, strict=True))


def test_corrupt_truncated_or_mismatched_files_fall_back_to_dequantizing(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    cache = WeightCache(tmp_path / "weights", 2**30)
    reference = _run(_split(tiny_llama_path, None, 2, 4))
    _split(tiny_llama_path, cache, 2, 4)
    (entry,) = _entries(cache)
    (entry / "blk.0.wqkv_t.npy").write_bytes(b"not an npy file")
    truncated = entry / "output_t.npy"
    truncated.write_bytes(truncated.read_bytes()[:-100])
    np.save(entry / "blk.3.w_down_t.npy", np.zeros((3, 5), dtype=np.float32))  # wrong shape
    wide = np.load(entry / "blk.1.wo_t.npy")
    np.save(entry / "blk.1.wo_t.npy", wide.astype(np.float64))  # wrong dtype
    messages: list[str] = []
    stages = [StageRuntime.load(tiny_llama_path, 0, 2, ctx_size=64, weight_cache=cache, progress=messages.append),
              StageRuntime.load(tiny_llama_path, 2, 4, ctx_size=64, weight_cache=cache, progress=messages.append)]
    rebuilt = [m for m in messages if m.startswith("loaded layer") and not m.endswith("from the weight cache")]
    assert [m.split(" (")[0] for m in rebuilt] == ["loaded layer 0", "loaded layer 1", "loaded layer 3"]
    assert all(np.array_equal(a, b) for a, b in zip(_run(stages), reference, strict=True))
    # The bad files were replaced: the next load maps everything.
    again = _split(tiny_llama_path, cache, 2, 4, NUMPY)
    assert again[1].head is not None and all(_is_mapped(a) for s in again for a in _arrays(s))


def test_a_changed_model_file_gets_a_new_entry_and_the_old_one_is_pruned(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model.gguf"
    shutil.copyfile(tiny_llama_path, model)
    cache = WeightCache(tmp_path / "weights", 2**30)
    _split(model, cache, 2, 4)
    (first,) = _entries(cache)
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _split(model, cache, 2, 4)
    (second,) = _entries(cache)
    assert second != first  # the stale entry went when the new one was written


def test_the_size_bound_skips_writes_and_prunes_least_recently_used(
    tiny_llama_path: Path, tiny_gemma3_path: Path, tmp_path: Path
) -> None:
    tiny = WeightCache(tmp_path / "tiny", 1000)  # room for a few norms, no matrix
    reference = _run(_split(tiny_llama_path, None, 2, 4))
    assert all(np.array_equal(a, b) for a, b in zip(_run(_split(tiny_llama_path, tiny, 2, 4)), reference,
                                                    strict=True))
    assert sum(p.stat().st_size for p in tiny.root.glob("*/*.npy")) <= 1000
    assert not any(tiny.root.glob("*/*_t.npy"))
    cache = WeightCache(tmp_path / "weights", 2**30)
    _split(tiny_llama_path, cache, 2, 4)
    (llama_entry,) = _entries(cache)
    llama_bytes = sum(p.stat().st_size for p in llama_entry.iterdir())
    cache.max_bytes = llama_bytes + 10  # room for one model only
    _split(tiny_gemma3_path, cache, 3, 7)
    entries = _entries(cache)
    assert llama_entry not in entries and len(entries) == 1


def test_entry_load_and_store_round_trip(tmp_path: Path, tiny_llama_path: Path) -> None:
    cache = WeightCache(tmp_path / "weights", 2**20)
    entry: CacheEntry = cache.entry(tiny_llama_path, [_run])
    assert entry.load("x", (2, 3)) is None
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    stored = entry.store("x", array)
    assert _is_mapped(stored) and np.array_equal(stored, array)
    assert entry.load("x", (3, 2)) is None and not (entry.directory / "x.npy").exists()
    assert entry.fetch("y", (2, 3), lambda: array * 2).tolist() == (array * 2).tolist()
    assert (entry.hits, entry.stores) == (2, 2)
    with pytest.raises(ValueError, match="bad array name"):
        entry.load("../escape", (1,))
    assert cache.entry(tiny_llama_path, [_run, _split]).directory != entry.directory


def test_environment_sizes_or_disables_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SKIPPY_ZMQ_CACHE", str(tmp_path))
    monkeypatch.delenv(MAX_MB_ENV, raising=False)
    default = WeightCache.from_environment()
    assert default is not None and default.root == tmp_path / "weights" and default.max_bytes == 4096 * 2**20
    monkeypatch.setenv(MAX_MB_ENV, "0")
    assert WeightCache.from_environment() is None
    monkeypatch.setenv(MAX_MB_ENV, "lots")
    with pytest.raises(ConfigError, match="SKIPPY_ZMQ_WEIGHT_CACHE_MB = 'lots' must be a number"):
        WeightCache.from_environment()
