"""Dequantized weights kept on disk as .npy files, memory-mapped on the next load.

Dequantizing a GGUF model to float32 takes seconds per stage; reading it back from a
memory-mapped file takes milliseconds, and stages on one host then share the same page-cache
pages. Layout, under the model cache directory (`$SKIPPY_ZMQ_CACHE`, else
`~/.cache/skippy-zmq`):

    weights/<key>/meta.json          the GGUF's path, size, mtime and sample hash; last use
    weights/<key>/<array name>.npy   one float32 array each (numpy .npy format)

`<key>` hashes the GGUF's resolved path, size, modification time and a hash of its first and
last MiB, the cache format, the numpy and gguf versions and the source of the functions that
produce the arrays, so a changed model file or a changed dequantizer never meets an old entry.
Files are written to a temporary name and renamed, so readers see whole files or none; a file
whose shape or dtype differs from what the loader expects, or that cannot be read, is deleted
and the weights are dequantized again. `$SKIPPY_ZMQ_WEIGHT_CACHE_MB` bounds the disk use
(default 4096 MiB; 0 turns the cache off): entries of model files that changed or disappeared
go first, then the least recently used. Gemma 3 270M takes about 1.1 GB.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import ConfigError
from skippy_zmq.runtime.catalog import cache_dir

F32 = npt.NDArray[np.float32]

CACHE_FORMAT = 1
MAX_MB_ENV = "SKIPPY_ZMQ_WEIGHT_CACHE_MB"
DEFAULT_MAX_MB = 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_UNFINISHED_GRACE_S = 3600.0
_SAMPLE_BYTES = 2**20


@attrs.frozen
class ModelIdentity:
    """Which version of which GGUF file an entry was made from.

    Size and modification time alone can miss a file rewritten in place within one clock tick
    (timestamps are coarse), so a hash of its first and last MiB (header, first and last
    tensors) is part of it too.
    """

    path: str
    size: int
    mtime_ns: int
    sample_sha256: str

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> ModelIdentity:
        """The identity of the file at `path` now."""
        resolved = Path(path).resolve()
        with open(resolved, "rb") as handle:
            stat = os.fstat(handle.fileno())
            digest = hashlib.sha256(handle.read(_SAMPLE_BYTES))
            if stat.st_size > _SAMPLE_BYTES:
                handle.seek(max(stat.st_size - _SAMPLE_BYTES, _SAMPLE_BYTES))
                digest.update(handle.read(_SAMPLE_BYTES))
        return cls(path=str(resolved), size=stat.st_size, mtime_ns=stat.st_mtime_ns,
                   sample_sha256=digest.hexdigest())

    def still_current(self) -> bool:
        """Whether the file is still there, unchanged."""
        try:
            return ModelIdentity.of(self.path) == self
        except OSError:
            return False


def producer_fingerprint(producers: Sequence[Callable[..., Any]]) -> str:
    """A hash of the code that makes the cached arrays, and of the libraries it relies on."""
    parts = [f"format {CACHE_FORMAT}", f"numpy {np.__version__}"]
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        parts.append(f"gguf {version('gguf')}")
    for producer in producers:
        try:
            parts.append(inspect.getsource(producer))
        except (OSError, TypeError):
            parts.append(f"{producer.__module__}.{producer.__qualname__}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class WeightCache:
    """A bounded directory of cache entries, one per (GGUF file version, producer code)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        """Use `root` (created on first write) and keep it under about `max_bytes`."""
        self.root = root
        self.max_bytes = max_bytes

    @classmethod
    def from_environment(cls) -> WeightCache | None:
        """The cache under the model cache directory, sized by $SKIPPY_ZMQ_WEIGHT_CACHE_MB; None when 0."""
        text = os.environ.get(MAX_MB_ENV, "").strip()
        try:
            max_mb = float(text) if text else float(DEFAULT_MAX_MB)
        except ValueError:
            raise ConfigError(f"${MAX_MB_ENV} = {text!r} must be a number of MiB (0 turns the cache off)") from None
        if max_mb <= 0:
            return None
        return cls(cache_dir() / "weights", int(max_mb * 2**20))

    def entry(self, model_path: str | os.PathLike[str], producers: Sequence[Callable[..., Any]]) -> CacheEntry:
        """The entry for the current version of `model_path` made by `producers`."""
        identity = ModelIdentity.of(model_path)
        fields = (identity.path, identity.size, identity.mtime_ns, identity.sample_sha256,
                  producer_fingerprint(producers))
        key = hashlib.sha256("\0".join(map(str, fields)).encode()).hexdigest()[:24]
        return CacheEntry(self, self.root / key, identity)

    def prune(self, keep: Path | None = None) -> None:
        """Delete entries of changed or missing model files, then the least recently used ones
        until the cache fits its bound; never `keep`."""
        if not self.root.is_dir():
            return
        with _locked(self.root / ".lock"):
            entries = []
            for directory in self.root.iterdir():
                if not directory.is_dir() or directory == keep:
                    continue
                identity, last_used = _read_meta(directory)
                if identity is None and not _older_than(directory, _UNFINISHED_GRACE_S):
                    continue  # another process may be creating it this moment
                if identity is None or not identity.still_current():
                    shutil.rmtree(directory, ignore_errors=True)
                else:
                    entries.append((last_used, directory))
            total = sum(_dir_bytes(d) for _, d in entries) + (_dir_bytes(keep) if keep else 0)
            for _, directory in sorted(entries):
                if total <= self.max_bytes:
                    break
                total -= _dir_bytes(directory)
                shutil.rmtree(directory, ignore_errors=True)


class CacheEntry:
    """The arrays of one model file version: load (memory-mapped) or store by name."""

    def __init__(self, cache: WeightCache, directory: Path, identity: ModelIdentity) -> None:
        """An entry in `directory`; nothing touches the disk until used."""
        self.cache = cache
        self.directory = directory
        self.identity = identity
        self.hits = 0
        self.stores = 0
        self._meta_written = False

    def load(self, name: str, shape: Sequence[int]) -> F32 | None:
        """The array `name` memory-mapped read-only, or None when absent or not float32 `shape`."""
        path = self._path(name)
        try:
            mapped = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, EOFError):
            _unlink(path)  # unreadable or truncated: make it again
            return None
        array = np.asarray(mapped)  # a plain ndarray view; the mapping lives as long as it
        if array.dtype != np.float32 or array.shape != tuple(shape) or not array.flags.c_contiguous:
            _unlink(path)
            return None
        self.hits += 1
        return array

    def store(self, name: str, array: F32) -> F32:
        """Write `array` under `name` and return it memory-mapped; `array` itself when the
        cache is full or the write fails (the cache is an optimization, never a failure)."""
        if self._bytes() + array.nbytes > self.cache.max_bytes:
            return array
        path = self._path(name)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            if not self._meta_written:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._write_meta()
                self._meta_written = True
            with open(temporary, "wb") as handle:
                np.save(handle, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)
            os.replace(temporary, path)
        except OSError:
            _unlink(temporary)
            return array
        self.stores += 1
        mapped = self.load(name, array.shape)
        return mapped if mapped is not None else array

    def fetch(self, name: str, shape: Sequence[int], make: Callable[[], F32]) -> F32:
        """The cached array, else `make()` stored and returned (memory-mapped when stored)."""
        cached = self.load(name, shape)
        if cached is not None:
            return cached
        made = make()
        assert made.shape == tuple(shape) and made.dtype == np.float32, (name, made.dtype, made.shape)
        return self.store(name, made)

    def touch(self) -> None:
        """Record a use (for least-recently-used pruning)."""
        with contextlib.suppress(OSError):
            if self.directory.is_dir():
                self._write_meta()

    def _path(self, name: str) -> Path:
        if not _NAME.fullmatch(name):
            raise ValueError(f"weight cache: bad array name {name!r}")
        return self.directory / f"{name}.npy"

    def _bytes(self) -> int:
        return _dir_bytes(self.directory)

    def _write_meta(self) -> None:
        meta = attrs.asdict(self.identity) | {"last_used": time.time(), "format": CACHE_FORMAT}
        path = self.directory / "meta.json"
        temporary = path.with_name(f".meta.json.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(meta) + "\n")
        os.replace(temporary, path)


def _read_meta(directory: Path) -> tuple[ModelIdentity | None, float]:
    """The identity and last use recorded in an entry; (None, 0) when unreadable."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        identity = ModelIdentity(path=str(meta["path"]), size=int(meta["size"]), mtime_ns=int(meta["mtime_ns"]),
                                 sample_sha256=str(meta["sample_sha256"]))
        return identity, float(meta.get("last_used", 0.0))
    except (OSError, ValueError, KeyError, TypeError):
        return None, 0.0


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > seconds
    except OSError:
        return False


def _dir_bytes(directory: Path) -> int:
    try:
        return sum(item.stat().st_size for item in directory.iterdir() if item.is_file())
    except OSError:
        return 0


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (several stages may prune at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
