"""The dequantized-weight cache: cold write, warm memory-mapped load, fallbacks, bounds."""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from skippy_zmq.errors import ConfigError
from skippy_zmq.float32 import weight_cache
from skippy_zmq.float32.engine import FloatEngine, FloatHead
from skippy_zmq.float32.projections import NumpyProjection
from skippy_zmq.float32.weight_cache import MAX_MB_ENV, CacheEntry, WeightCache, WeightCacheWarning
from skippy_zmq.runtime import kernels
from skippy_zmq.runtime.kernels import Kernel
from skippy_zmq.runtime.stage import StageRuntime

F32 = npt.NDArray[np.float32]
PROMPT = np.array([2, 300, 301, 460, 302, 310, 311, 512, 600, 700, 320], dtype=np.int32)



def _engine(runtime: StageRuntime) -> FloatEngine:
    """The float32 engine of a runtime loaded with a float32 kernel."""
    assert isinstance(runtime.engine, FloatEngine)
    return runtime.engine

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


@pytest.fixture(autouse=True)
def _float32_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache holds dequantized float32 weights: the stages here run onnxruntime unless a test
    names a kernel (the default, ggml, computes from the file's blocks and caches nothing)."""
    monkeypatch.setenv(kernels.KERNEL_ENV, "onnxruntime")


def _split(path: Path, cache: WeightCache | None, cut: int, n_layer: int,
           kernel: Kernel | None = None) -> list[StageRuntime]:
    return [StageRuntime.load(path, 0, cut, ctx_size=64, weight_cache=cache, kernel=kernel),
            StageRuntime.load(path, cut, n_layer, ctx_size=64, weight_cache=cache, kernel=kernel)]


NUMPY = Kernel("numpy")  # keeps the arrays it was given, so a test can see where they live


def _arrays(stage: StageRuntime) -> list[np.ndarray]:
    """The matrices a numpy-kernel stage multiplies by: every block's four, and its head."""
    projections = [p for b in _engine(stage).blocks for p in (b.qkv, b.wo, b.gate_up, b.down)]
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
    with pytest.warns(WeightCacheWarning) as warned:
        stages = [StageRuntime.load(tiny_llama_path, 0, 2, ctx_size=64, weight_cache=cache, progress=messages.append),
                  StageRuntime.load(tiny_llama_path, 2, 4, ctx_size=64, weight_cache=cache, progress=messages.append)]
    assert sorted(str(w.message).split(": ")[1].rsplit("/", 1)[1] for w in warned) == [
        "blk.0.wqkv_t.npy", "blk.1.wo_t.npy", "blk.3.w_down_t.npy", "output_t.npy"]
    summaries = [m for m in messages if m.startswith("stage layers")]
    assert ["2 rejected and made again" in m for m in summaries] == [True, True]
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
    with pytest.warns(WeightCacheWarning, match=r"x.npy: holds float32 \(2, 3\), expected float32 \(3, 2\); deleted"):
        assert entry.load("x", (3, 2)) is None
    assert not (entry.directory / "x.npy").exists()
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


def _flip_one_data_byte(path: Path) -> None:
    """Flip the low bit of one byte in the middle of an .npy file's array data."""
    data_offset = np.load(path, mmap_mode="r").offset
    size = path.stat().st_size - 32  # the digest trailer
    at = data_offset + (size - data_offset) // 2
    with open(path, "r+b") as handle:
        handle.seek(at)
        byte = handle.read(1)[0]
        handle.seek(at)
        handle.write(bytes([byte ^ 0x01]))


def test_a_flipped_byte_in_a_cached_array_is_detected_and_rebuilt(tiny_llama_path: Path, tmp_path: Path) -> None:
    """Issue 16's case: one byte of a cached array's data changed (its header intact)."""
    cache = WeightCache(tmp_path / "weights", 2**30)
    reference = _run(_split(tiny_llama_path, None, 2, 4, NUMPY))
    _split(tiny_llama_path, cache, 2, 4)
    (entry,) = _entries(cache)
    damaged = entry / "blk.1.wo_t.npy"
    _flip_one_data_byte(damaged)
    messages: list[str] = []
    with pytest.warns(WeightCacheWarning) as warned:
        stages = [StageRuntime.load(tiny_llama_path, 0, 2, ctx_size=64, weight_cache=cache, kernel=NUMPY,
                                    progress=messages.append),
                  StageRuntime.load(tiny_llama_path, 2, 4, ctx_size=64, weight_cache=cache, kernel=NUMPY)]
    (warning,) = [str(w.message) for w in warned]
    assert re.fullmatch(rf"weight cache: {re.escape(str(damaged))}: its data's digest [0-9a-f]{{32}} differs from "
                        "the one written with it, [0-9a-f]{32}; deleted, the weights are dequantized again", warning)
    assert [m.split(" (")[0] for m in messages if m.startswith("loaded layer") and not m.endswith("cache")] == [
        "loaded layer 1"]
    assert "1 rejected and made again" in messages[-1] and "6 written" in messages[-1]  # the layer's six arrays
    assert all(np.array_equal(a, b) for a, b in zip(_run(stages), reference, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt file passes: no warning now
        again = _split(tiny_llama_path, cache, 2, 4, NUMPY)
    assert all(_is_mapped(a) for s in again for a in _arrays(s))
    assert all(np.array_equal(a, b) for a, b in zip(_run(again), reference, strict=True))


def test_a_missing_digest_trailer_is_rejected(tiny_llama_path: Path, tmp_path: Path) -> None:
    cache = WeightCache(tmp_path / "weights", 2**20)
    entry = cache.entry(tiny_llama_path, [_run])
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    entry.store("x", array)
    np.save(entry.directory / "x.npy", array)  # the same array without the trailer (cache format 1)
    with pytest.warns(WeightCacheWarning, match=r"x.npy: 152 bytes, expected 184 \(the array and its digest"):
        assert entry.load("x", (2, 3)) is None
    entry.store("x", array)
    with open(entry.directory / "x.npy", "r+b") as handle:
        handle.seek(-32, os.SEEK_END)
        handle.write(b"SKPYXXH4")
    with pytest.warns(WeightCacheWarning, match="its digest trailer is missing or damaged"):
        assert entry.load("x", (2, 3)) is None
    assert (entry.hits, entry.stores, entry.rejected) == (2, 2, 2)  # each store maps its file back


def test_leftover_temporary_files_are_removed_at_start(tiny_llama_path: Path, tmp_path: Path) -> None:
    cache = WeightCache(tmp_path / "weights", 2**30)
    _split(tiny_llama_path, cache, 2, 4)
    (entry,) = _entries(cache)
    host = weight_cache._HOST
    mine = entry / f".blk.0.wo_t.npy.{host}.{os.getpid()}.tmp"  # a killed predecessor with this pid
    init = entry / f".blk.1.wo_t.npy.{host}.1.tmp"  # a live writer (pid 1 is always there)
    recent = entry / ".blk.2.wo_t.npy.otherhost.77.tmp"  # another container, maybe still writing
    stale = entry / ".blk.3.wo_t.npy.otherhost.78.tmp"
    unrelated = entry / ".notes.tmp"
    for path in (mine, init, recent, stale, unrelated):
        path.write_bytes(b"\0" * 1000)
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    messages: list[str] = []
    StageRuntime.load(tiny_llama_path, 0, 2, ctx_size=64, weight_cache=cache, progress=messages.append)
    assert sorted(p.name for p in entry.glob(".*.tmp")) == sorted(p.name for p in (init, recent, unrelated))
    assert "; 2 unfinished files removed (0.0 MiB)" in messages[-1]


def test_a_full_disk_says_so_once_and_the_stage_runs_without_the_cache(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts: list[Path] = []

    def full_disk(path: Path, array: np.ndarray) -> None:
        attempts.append(path)
        with open(path, "wb") as handle:
            handle.write(b"\x93NUMPY" + b"\0" * 500)  # part of a file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(weight_cache, "_write_array", full_disk)
    cache = WeightCache(tmp_path / "weights", 2**30)
    reference = _run(_split(tiny_llama_path, None, 2, 4))
    messages: list[str] = []
    with pytest.warns(WeightCacheWarning) as warned:
        stages = [StageRuntime.load(tiny_llama_path, 0, 2, ctx_size=64, weight_cache=cache, progress=messages.append),
                  StageRuntime.load(tiny_llama_path, 2, 4, ctx_size=64, weight_cache=cache)]
    (warning,) = [str(w.message) for w in warned]
    assert warning.startswith(f"weight cache {cache.root}: cannot write blk.0.attn_norm.npy: [Errno 28] No space "
                              "left on device")
    assert warning.endswith("this stage runs without the cache (nothing more is written, what is cached is still used)")
    assert len(attempts) == 1
    assert "0 written" in messages[-1] and messages[-1].endswith("not writable: No space left on device")
    assert not list(cache.root.glob("*/*.tmp")) and not list(cache.root.glob("*/*.npy"))
    assert all(np.array_equal(a, b) for a, b in zip(_run(stages), reference, strict=True))


@pytest.mark.slow
def test_a_flipped_byte_in_the_real_model_s_cache_gives_the_clean_numbers(gemma3_270m_path: Path,
                                                                          tmp_path: Path) -> None:
    """Gemma 3 270M layer 6: its cached feed-forward matrix damaged by one byte, then loaded."""
    cache = WeightCache(tmp_path / "weights", 2**30)
    hidden = np.random.default_rng(16).standard_normal((5, 640)).astype(np.float32)

    def run(stage: StageRuntime) -> F32:
        stage.open_session(1)
        return stage.forward(1, 0, hidden)

    clean = run(StageRuntime.load(gemma3_270m_path, 6, 7, ctx_size=64, weight_cache=None, kernel=NUMPY))
    StageRuntime.load(gemma3_270m_path, 6, 7, ctx_size=64, weight_cache=cache, kernel=NUMPY)
    (entry,) = _entries(cache)
    _flip_one_data_byte(entry / "blk.6.w_gate_up_t.npy")
    with pytest.warns(WeightCacheWarning, match="blk.6.w_gate_up_t.npy: its data's digest"):
        warm = run(StageRuntime.load(gemma3_270m_path, 6, 7, ctx_size=64, weight_cache=cache, kernel=NUMPY))
    assert np.array_equal(warm, clean)
