"""Tests of skippy_zmq.compute.huge_pages: the kernel's mode is read from its setting, the
environment's choice is checked, and the advice lands on a mapping's whole huge pages only."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from skippy_zmq.compute import huge_pages
from skippy_zmq.errors import ModelLoadError

MiB = 1 << 20


@pytest.mark.parametrize(("text", "mode"), [
    ("always [madvise] never\n", "madvise"),
    ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"),
    ("garbled\n", "never"),
    ("", "never"),
])
def test_the_kernels_mode_is_the_bracketed_word(tmp_path: Path, text: str, mode: str) -> None:
    setting = tmp_path / "enabled"
    setting.write_text(text)
    assert huge_pages.kernel_mode(setting) == mode


def test_a_missing_setting_means_no_huge_pages(tmp_path: Path) -> None:
    assert huge_pages.kernel_mode(tmp_path / "absent") == "never"


def test_the_environment_chooses_and_a_kernel_without_them_overrules(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    setting.write_text("always [madvise] never\n")
    assert huge_pages.wanted({}) and huge_pages.wanted({huge_pages.HUGE_PAGES_ENV: "on"})
    assert not huge_pages.wanted({huge_pages.HUGE_PAGES_ENV: "off"})
    setting.write_text("always madvise [never]\n")
    assert not huge_pages.wanted({})


def test_an_unknown_choice_is_refused_by_name() -> None:
    with pytest.raises(ModelLoadError, match=r"\$SKIPPY_ZMQ_HUGE_PAGES is 'yes'; expected one of on, off"):
        huge_pages.wanted({huge_pages.HUGE_PAGES_ENV: "yes"})


def _eligible(address: int) -> bool:
    """Whether the kernel would give the mapping holding `address` huge pages (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_advice_covers_the_whole_huge_pages_only() -> None:
    if huge_pages.kernel_mode() == "never":
        pytest.skip("this kernel has no transparent huge pages")
    # Private and anonymous, as malloc maps a large block (a shared one is shmem, with its own rule).
    region = mmap.mmap(-1, 8 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        base = np.frombuffer(region, dtype=np.uint8).ctypes.data
        first = -(-base // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
        assert huge_pages.advise(first + 4096, 2 * MiB) == 0  # no whole huge page inside
        assert huge_pages.advise(first + 1, 4 * MiB) == 2 * MiB  # the one whole page past `first`
        assert huge_pages.advise(first, 4 * MiB) == 4 * MiB
        assert _eligible(first)
    finally:
        region.close()


def test_a_process_reports_its_huge_bytes() -> None:
    assert huge_pages.huge_bytes() >= 0
    assert huge_pages.huge_bytes(2 ** 31) == 0  # no such process
