"""`bench links --host-cpus`: the budget's parsing and values, the cgroup hierarchy found in /proc/mounts' text,
the files a cap writes and the command that enters a group, in-process; the groups made real (root)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippy_zmq.bench.cpu_budget import CpuBudget, CpuHierarchy, group_names
from skippy_zmq.bench.links import CpuGroups, cpu_groups_unavailable
from skippy_zmq.errors import BenchError

V1_MOUNTS = """tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
V2_MOUNTS = "proc /proc proc rw 0 0\ncgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n"


@pytest.mark.parametrize(("text", "cpus"), [("none", None), ("auto", 2 / 3), (" AUTO ", 2 / 3), ("0.5", 0.5),
                                             ("0.6", 0.6)])
def test_a_budget_is_none_auto_or_cpus_per_host(text: str, cpus: float | None) -> None:
    budget = CpuBudget.parse(text, hosts=3, cores=2)
    assert (None if budget is None else budget.cpus) == pytest.approx(cpus)


@pytest.mark.parametrize(("text", "message"), [
    ("half", "--host-cpus 'half' is not a number of CPUs; expected none, auto or a number such as 0.5"),
    ("0.9", "--host-cpus 0.9: 3 hosts of 0.9 CPUs need 2.7, but this machine has 2 cores; expected at most 0.667 "
            "per host (auto)"),
    ("0.01", "--host-cpus 0.01: expected at least 0.05 CPUs per host"),
    ("nan", "--host-cpus nan: expected at least 0.05 CPUs per host"),
])
def test_a_budget_that_cannot_be_says_why(text: str, message: str) -> None:
    with pytest.raises(BenchError) as caught:
        CpuBudget.parse(text, hosts=3, cores=2)
    assert str(caught.value) == message


@given(st.floats(min_value=0.05, max_value=64))
def test_the_quota_is_the_budget_of_each_period_and_threads_its_whole_cpus(cpus: float) -> None:
    budget = CpuBudget(cpus)
    assert budget.period_us == 10_000
    # the share of each period, to a microsecond, but never under the kernel's 1 ms floor
    assert budget.quota_us >= 1000
    assert abs(budget.quota_us - cpus * budget.period_us) <= 0.5 or (cpus < 0.1 and budget.quota_us == 1000)
    # one thread per whole CPU: never more threads than the budget rounds to, never none
    assert budget.threads >= 1 and (cpus < 1.5 or abs(budget.threads - cpus) <= 0.5)


def test_the_text_says_the_share_and_the_period() -> None:
    assert CpuBudget(2 / 3).text == "0.667 CPUs per host (6667 us of each 10000 us)"


def test_cgroup_v1_cpu_is_found_before_the_unified_mount() -> None:
    found = CpuHierarchy.from_mounts(V1_MOUNTS, "memory pids")
    assert found == CpuHierarchy(1, Path("/sys/fs/cgroup/cpu"))
    assert found.enable_writes() == []
    assert found.limit_writes("skippy-links-ab12-cpu-h0", CpuBudget(0.5)) == [
        (Path("/sys/fs/cgroup/cpu/skippy-links-ab12-cpu-h0/cpu.cfs_period_us"), "10000"),
        (Path("/sys/fs/cgroup/cpu/skippy-links-ab12-cpu-h0/cpu.cfs_quota_us"), "5000")]


def test_cgroup_v2_is_used_when_it_offers_cpu() -> None:
    found = CpuHierarchy.from_mounts(V2_MOUNTS, "cpuset cpu io memory pids\n")
    assert found == CpuHierarchy(2, Path("/sys/fs/cgroup"))
    assert found.enable_writes() == [(Path("/sys/fs/cgroup/cgroup.subtree_control"), "+cpu")]
    assert found.limit_writes("skippy-links-ab12-cpu-h1", CpuBudget(1.5)) == [
        (Path("/sys/fs/cgroup/skippy-links-ab12-cpu-h1/cpu.max"), "15000 10000")]


@pytest.mark.parametrize(("mounts", "controllers", "tail"), [
    (V2_MOUNTS, "memory pids", " (the cgroup2 mount at /sys/fs/cgroup offers: memory pids)"),
    (V2_MOUNTS, None, " (the cgroup2 mount at /sys/fs/cgroup offers: nothing)"),
    ("proc /proc proc rw 0 0\n", None, ""),
])
def test_no_cpu_control_is_named(mounts: str, controllers: str | None, tail: str) -> None:
    with pytest.raises(BenchError) as caught:
        CpuHierarchy.from_mounts(mounts, controllers)
    assert str(caught.value) == ("--host-cpus needs CPU bandwidth control: no cgroup v1 mount with the cpu controller "
                                 f"and no cgroup2 mount offering cpu in /proc/mounts{tail}")


def test_a_program_enters_its_group_before_it_execs() -> None:
    hierarchy = CpuHierarchy(1, Path("/sys/fs/cgroup/cpu"))
    assert hierarchy.enter("skippy-links-ab12-cpu-h0", ("worker", "--stage", "a b")) == (
        "sh", "-c", 'echo $$ > "$0" && exec "$@"', "/sys/fs/cgroup/cpu/skippy-links-ab12-cpu-h0/cgroup.procs",
        "worker", "--stage", "a b")


@pytest.mark.parametrize("name", ["other-h0", "skippy-links-x/../../etc"])
def test_a_group_outside_the_harness_is_refused(name: str) -> None:
    with pytest.raises(BenchError, match="must start with skippy-links- and hold no '/'"):
        CpuHierarchy(1, Path("/sys/fs/cgroup/cpu")).group(name)


def test_group_names_are_per_host() -> None:
    assert group_names("ab12", 2) == ("skippy-links-ab12-cpu-h0", "skippy-links-ab12-cpu-h1")


@pytest.mark.slow
@pytest.mark.skipif(cpu_groups_unavailable() is not None, reason=str(cpu_groups_unavailable()))
def test_groups_are_capped_hold_the_program_they_start_and_are_removed() -> None:
    groups = CpuGroups.plan(2, CpuBudget(0.5), lambda _line: None)
    groups.create()
    try:
        hierarchy = groups.hierarchy
        for name in groups.names:
            for path, value in hierarchy.limit_writes(name, groups.budget):
                assert path.read_text().split() == value.split()
        argv = hierarchy.enter(groups.names[1], (sys.executable, "-c", "import time; time.sleep(30)"))
        child = subprocess.Popen(argv)
        try:
            deadline = time.monotonic() + 10
            while str(child.pid) not in hierarchy.procs(groups.names[1]).read_text().split():
                assert time.monotonic() < deadline, "the program never showed in its group's cgroup.procs"
                time.sleep(0.02)
            assert hierarchy.procs(groups.names[0]).read_text().split() == []
        finally:
            groups.delete()  # kills what is left in a group before removing it
            child.wait(timeout=10)
    finally:
        groups.delete()
    assert not any(hierarchy.group(name).exists() for name in groups.names)
    assert child.returncode == -9
