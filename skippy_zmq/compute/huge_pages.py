"""Weights on transparent huge pages (docs/ARCHITECTURE.md, "Kernels").

A stage of a pipeline waits while the other stages compute, and after such a wait its pass over the
weights ran about 7 % slower than back to back (docs/BENCHMARKS.md, "Huge pages"): the translations
of its weights' 4 KiB pages had left the TLB and the caches meanwhile. A 2 MiB page needs one entry
where 4 KiB pages need 512. Linux gives anonymous memory huge pages where a mapping asks for them
(`madvise(MADV_HUGEPAGE)`, the usual "madvise" mode of transparent huge pages), and not to a
regular file's pages here, so weights go to anonymous buffers that ask before they are written.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from skippy_zmq.errors import ModelLoadError

HUGE_PAGES_ENV = "SKIPPY_ZMQ_HUGE_PAGES"
"""`on` (the default): weights live in buffers on huge pages where the kernel gives them; `off`: the
file's own pages, and repacked buffers on whatever pages the kernel chose."""
MODES = ("on", "off")
HUGE_PAGE = 2 << 20
"""Bytes of an x86-64 transparent huge page: a buffer is advised on its whole huge pages only."""
WHOLE_PAGE_BYTES = 2 * HUGE_PAGE
"""The fewest bytes that hold a whole huge page wherever they start: a smaller matrix is not copied."""
MADV_HUGEPAGE = 14
"""Linux's madvise advice asking for transparent huge pages (linux/mman.h; Python's mmap lacks it)."""
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
"""The kernel's mode of transparent huge pages: `always`, `madvise` or `never`, the chosen in brackets."""

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.restype, _LIBC.madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def wanted(environ: dict[str, str] | None = None) -> bool:
    """Whether weights should be placed on huge pages: `$SKIPPY_ZMQ_HUGE_PAGES` is `on` (or unset)
    and the kernel's mode is not `never` (then a copy would buy nothing); ModelLoadError for a mode
    that is neither."""
    mode = (os.environ if environ is None else environ).get(HUGE_PAGES_ENV, "on")
    if mode not in MODES:
        raise ModelLoadError(f"${HUGE_PAGES_ENV} is {mode!r}; expected one of {', '.join(MODES)}")
    return mode == "on" and kernel_mode() != "never"


def kernel_mode(setting: Path | None = None) -> str:
    """The kernel's transparent huge page mode (the bracketed word of `setting`, default THP_SETTING),
    `never` where the file is missing or unreadable (not Linux, or a kernel without them)."""
    try:
        text = (THP_SETTING if setting is None else setting).read_text()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "never"


def advise(address: int, nbytes: int) -> int:
    """Ask for huge pages under the whole 2 MiB pages of `nbytes` bytes at `address`, before they are
    first written (a page already touched waits for the kernel's background merging); the bytes
    advised, 0 where none are whole or the kernel refuses (then the buffer keeps small pages)."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) != 0:
        return 0
    return end - start


def huge_bytes(pid: int | str = "self") -> int:
    """Bytes of process `pid`'s anonymous memory on transparent huge pages now (`/proc/PID/smaps_rollup`),
    0 where the kernel does not say."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
