"""Dequantized weights kept on disk as .npy files, memory-mapped on the next load.

Dequantizing a GGUF model to float32 takes seconds per stage; reading it back from a
memory-mapped file takes milliseconds, and stages on one host then share the same page-cache
pages. Layout, under the model cache directory (`$SKIPPY_ZMQ_CACHE`, else
`~/.cache/skippy-zmq`):

    weights/<key>/meta.json          the GGUF's path, size, mtime and sample hash; last use
    weights/<key>/<array name>.npy   one float32 array each (numpy .npy format), then a trailer
                                     of 32 bytes: b"SKPYXXH3", the XXH3-128 digest of the
                                     array's data bytes, their length (u64 little-endian)

`<key>` hashes the GGUF's resolved path, size, modification time and a hash of its first and
last MiB, the cache format, the numpy and gguf versions and the source of the functions that
produce the arrays, so a changed model file or a changed dequantizer never meets an old entry.
Files are written to a temporary name and renamed, so readers see whole files or none; a file
whose shape or dtype differs from what the loader expects, that cannot be read, or whose data
does not match its digest (checked when the file is first mapped, so no weights the stage did
not verify are used) is deleted and the weights are dequantized again; a mismatch is reported
as a warning. Temporary files of writers that died (a cold start killed mid-write) are removed
when a stage opens the cache. A cache that cannot be written (a full disk) says so once and the
stage goes on without it. `$SKIPPY_ZMQ_WEIGHT_CACHE_MB` bounds the disk use
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
import socket
import struct
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import xxhash

from skippy_zmq.errors import ConfigError
from skippy_zmq.model.catalog import cache_dir

F32 = npt.NDArray[np.float32]

CACHE_FORMAT = 2  # 2: every array file ends with its digest trailer
MAX_MB_ENV = "SKIPPY_ZMQ_WEIGHT_CACHE_MB"
DEFAULT_MAX_MB = 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_UNFINISHED_GRACE_S = 3600.0
_SAMPLE_BYTES = 2**20
_TRAILER = struct.Struct("<8s16sQ")  # magic, XXH3-128 digest of the data bytes, their length
_TRAILER_MAGIC = b"SKPYXXH3"
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.tmp")
_OTHER_HOST_GRACE_S = 600.0  # a writer on another host (a container sharing the volume) may be alive


class WeightCacheWarning(UserWarning):
    """The weight cache rejected a file (and rebuilt it) or cannot be written (and is not used)."""


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
        self.unwritable: str | None = None  # why a write failed; no more writes are tried then

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
        entry = CacheEntry(self, self.root / key, identity)
        entry.swept = self.remove_leftovers()
        return entry

    def remove_leftovers(self) -> tuple[int, int]:
        """Delete the temporary files of writers that died mid-write; (files, bytes) removed.

        A temporary name carries its writer's host and pid: on this host a writer that is gone (or
        that had this process's pid, a predecessor in a container) left it; another host's file
        goes once it is older than a writer could take."""
        removed = [0, 0]
        if not self.root.is_dir():
            return 0, 0
        for path in self.root.glob("*/.*.tmp"):
            match = _TEMPORARY.fullmatch(path.name)
            if match is None:
                continue
            pid = int(match["pid"])
            ours = match["host"] == _HOST
            if (ours and not _writer_alive(pid)) or (not ours and _older_than(path, _OTHER_HOST_GRACE_S)):
                with contextlib.suppress(OSError):
                    size = path.stat().st_size
                    path.unlink()
                    removed[0] += 1
                    removed[1] += size
        return removed[0], removed[1]

    def write_failed(self, path: Path, exc: OSError) -> None:
        """Stop writing after a failed write (a full disk), saying so once."""
        if self.unwritable is None:
            self.unwritable = f"{exc.strerror or exc}"
            warnings.warn(f"weight cache {self.root}: cannot write {path.name}: {exc}; this stage runs "
                          "without the cache (nothing more is written, what is cached is still used)",
                          WeightCacheWarning, stacklevel=3)

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
                # An entry of another cache format stays until it is least recently used: stages of
                # two versions may share a host's cache during an upgrade.
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
        self.rejected = 0  # files deleted for failing a check, made again
        self.verify_s = 0.0  # time spent checking digests
        self.swept = (0, 0)  # leftover temporary files removed when the entry was opened: (files, bytes)
        self._meta_written = False

    def load(self, name: str, shape: Sequence[int]) -> F32 | None:
        """The array `name` memory-mapped read-only once its digest matched, or None when absent,
        not float32 `shape`, or damaged (then the file is deleted and a warning says why)."""
        path = self._path(name)
        try:
            mapped = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, EOFError) as exc:
            self._reject(path, f"unreadable or truncated ({exc})")
            return None
        array = np.asarray(mapped)  # a plain ndarray view; the mapping lives as long as it
        if array.dtype != np.float32 or array.shape != tuple(shape) or not array.flags.c_contiguous:
            self._reject(path, f"holds {array.dtype} {array.shape}, expected float32 {tuple(shape)}")
            return None
        started = time.perf_counter()
        problem = _verify(path, int(getattr(mapped, "offset", 0)), array)
        self.verify_s += time.perf_counter() - started
        if problem is not None:
            self._reject(path, problem)
            return None
        self.hits += 1
        return array

    def store(self, name: str, array: F32) -> F32:
        """Write `array` under `name` with its digest and return it memory-mapped; `array` itself
        when the cache is full or cannot be written (an optimization, never a failure)."""
        if self.cache.unwritable is not None or self._bytes() + array.nbytes > self.cache.max_bytes:
            return array
        path = self._path(name)
        temporary = path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.tmp")
        array = np.ascontiguousarray(array, dtype=np.float32)
        try:
            if not self._meta_written:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._write_meta()
                self._meta_written = True
            _write_array(temporary, array)
            os.replace(temporary, path)
        except OSError as exc:
            _unlink(temporary)
            self.cache.write_failed(path, exc)
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

    def summary(self) -> str:
        """What this entry did for the load: `weight cache DIR: 90 arrays mapped, 0 written ...`."""
        parts = [f"weight cache {self.directory}: {self.hits} arrays mapped, {self.stores} written "
                 f"(digests checked in {self.verify_s:.2f}s)"]
        if self.rejected:
            parts.append(f"{self.rejected} rejected and made again")
        if self.swept[0]:
            parts.append(f"{self.swept[0]} unfinished files removed ({self.swept[1] / 2**20:.1f} MiB)")
        if self.cache.unwritable is not None:
            parts.append(f"not writable: {self.cache.unwritable}")
        return "; ".join(parts)

    def _reject(self, path: Path, problem: str) -> None:
        """Delete a damaged file (it is made again) and say why."""
        self.rejected += 1
        _unlink(path)
        warnings.warn(f"weight cache: {path}: {problem}; deleted, the weights are dequantized again",
                      WeightCacheWarning, stacklevel=3)

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
        temporary = path.with_name(f".meta.json.{_HOST}.{os.getpid()}.tmp")
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


def _digest(array: np.ndarray) -> bytes:
    """XXH3-128 of a C-contiguous array's data bytes (about 9 GB/s)."""
    return xxhash.xxh3_128_digest(memoryview(array.reshape(-1).view(np.uint8)))


def _write_array(path: Path, array: F32) -> None:
    """The .npy file of `array`, then its digest trailer."""
    with open(path, "wb") as handle:
        np.save(handle, array, allow_pickle=False)
        handle.write(_TRAILER.pack(_TRAILER_MAGIC, _digest(array), array.nbytes))


def _verify(path: Path, data_offset: int, array: np.ndarray) -> str | None:
    """Why the mapped `array` of the file at `path` is not what was written (None: it is)."""
    end = data_offset + array.nbytes
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size != end + _TRAILER.size:
            return f"{size} bytes, expected {end + _TRAILER.size} (the array and its digest trailer)"
        handle.seek(end)
        magic, digest, length = _TRAILER.unpack(handle.read(_TRAILER.size))
    if magic != _TRAILER_MAGIC or length != array.nbytes:
        return "its digest trailer is missing or damaged"
    actual = _digest(array)
    if actual != digest:
        return f"its data's digest {actual.hex()} differs from the one written with it, {digest.hex()}"
    return None


def _writer_alive(pid: int) -> bool:
    """Whether the process that wrote a temporary file may still be writing it (never this one:
    a stage opens the cache before it writes, so a file with its pid is a predecessor's)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


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
