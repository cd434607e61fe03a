"""Per-host CPU budgets of `bench links` (`--host-cpus`): each emulated host's processes run in a cgroup of
their own whose CPU bandwidth is capped at the host's share of this machine's cores, so the hosts compute
as separate machines would, each with its own cores, instead of all sharing every core.

Why it matters: without budgets, a stage that waits lends its cores to the stage that computes, so a
pipeline whose stages take turns (one client, or llama.cpp's RPC backend, whose devices always take
turns) runs each stage on the whole machine, and a pipeline whose stages overlap (micro-batches, many
clients) gains nothing from overlapping. On separate hosts the opposite holds: a host's idle cores help
no one. With a budget of C CPUs per host, a host never computes faster than C cores, whatever the others
do, and the hosts together never use more than this machine has (`auto`: cores / hosts each).

The cap is CFS bandwidth control: `quota` microseconds of CPU time per `period` (PERIOD_US, 10 ms: short
enough that a host cannot bank a long burst above its share between two decode steps, long enough for the
scheduler's 5 ms bandwidth slices). cgroup v1 (`cpu.cfs_period_us`, `cpu.cfs_quota_us` under the `cpu`
hierarchy) and v2 (`cpu.max` under the unified mount, its `cpu` controller enabled for the children) are
both planned here without touching anything: the mount found in /proc/mounts' text, the files and the
values to write, and the command line that puts a program in its host's group before it execs (so every
thread it starts is counted). bench/links.py writes the files and runs the commands.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs

from skippy_zmq.errors import BenchError

PERIOD_US = 10_000
"""The bandwidth period (see the module docstring)."""
MIN_CPUS = 0.05
"""The smallest budget a host may get: below it a stage cannot keep its heartbeats."""
GROUP_PREFIX = "skippy-links-"
"""Every cgroup this harness makes starts with it (as its namespaces do)."""
_ENTER = 'echo $$ > "$0" && exec "$@"'
"""sh: write this shell's pid (the program's, after exec) to the group's procs file ($0), then become the program."""


@attrs.frozen
class CpuBudget:
    """What each host may use: `cpus` CPUs' worth of time, enforced per `period_us`."""

    cpus: float = attrs.field()
    period_us: int = PERIOD_US

    @cpus.validator
    def _positive(self, _attribute: attrs.Attribute[float], value: float) -> None:
        if not (math.isfinite(value) and value >= MIN_CPUS):
            raise BenchError(f"--host-cpus {value!r}: expected at least {MIN_CPUS} CPUs per host")

    @classmethod
    def parse(cls, text: str, *, hosts: int, cores: int) -> CpuBudget | None:
        """`none` (no budget: every host shares every core), `auto` (cores / hosts each) or a number of
        CPUs per host; BenchError when the hosts together would need more than `cores`."""
        word = text.strip().lower()
        if word == "none":
            return None
        if word == "auto":
            return cls(cores / hosts)
        try:
            cpus = float(word)
        except ValueError:
            raise BenchError(f"--host-cpus {text!r} is not a number of CPUs; expected none, auto or a number "
                             "such as 0.5") from None
        budget = cls(cpus)
        if cpus * hosts > cores + 1e-9:
            raise BenchError(f"--host-cpus {text}: {hosts} hosts of {cpus:g} CPUs need {cpus * hosts:g}, but this "
                             f"machine has {cores} cores; expected at most {cores / hosts:.3g} per host (auto)")
        return budget

    @property
    def quota_us(self) -> int:
        """CPU time per period, over all the host's threads."""
        return max(1000, round(self.cpus * self.period_us))  # the kernel refuses quotas under 1 ms

    @property
    def threads(self) -> int:
        """Threads a host's program should run: its whole CPUs, at least one."""
        return max(1, round(self.cpus))

    @property
    def text(self) -> str:
        """`0.667 CPUs per host (6667 us of each 10000 us)`."""
        return f"{self.cpus:.3g} CPUs per host ({self.quota_us} us of each {self.period_us} us)"


@attrs.frozen
class CpuHierarchy:
    """Where CPU bandwidth is controlled: cgroup `version` 1 or 2, mounted at `root`."""

    version: int = attrs.field(validator=attrs.validators.in_((1, 2)))
    root: Path

    @classmethod
    def from_mounts(cls, mounts: str, v2_controllers: str | None = None) -> CpuHierarchy:
        """The `cpu` hierarchy in /proc/mounts' text: a cgroup (v1) mount with the `cpu` option first, else a
        cgroup2 mount whose root offers `cpu` (`v2_controllers`: its cgroup.controllers, None if unread);
        BenchError when neither is there."""
        unified = None
        for line in mounts.splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            kind, where, options = fields[2], Path(fields[1]), fields[3].split(",")
            if kind == "cgroup" and "cpu" in options:
                return cls(1, where)
            if kind == "cgroup2" and unified is None:
                unified = where
        if unified is not None and v2_controllers is not None and "cpu" in v2_controllers.split():
            return cls(2, unified)
        offered = "" if unified is None else f" (the cgroup2 mount at {unified} offers: {v2_controllers or 'nothing'})"
        raise BenchError(f"--host-cpus needs CPU bandwidth control: no cgroup v1 mount with the cpu controller and "
                         f"no cgroup2 mount offering cpu in /proc/mounts{offered}")

    def group(self, name: str) -> Path:
        """A group's directory."""
        if not name.startswith(GROUP_PREFIX) or "/" in name:
            raise BenchError(f"cgroup name {name!r} must start with {GROUP_PREFIX} and hold no '/'")
        return self.root / name

    def enable_writes(self) -> list[tuple[Path, str]]:
        """What must be written once before groups can be capped: v2's controller for the children."""
        return [] if self.version == 1 else [(self.root / "cgroup.subtree_control", "+cpu")]

    def limit_writes(self, name: str, budget: CpuBudget) -> list[tuple[Path, str]]:
        """The files and values that cap group `name` at `budget`, in order (v1's period before its quota, so
        the quota is never checked against the old period)."""
        group = self.group(name)
        if self.version == 1:
            return [(group / "cpu.cfs_period_us", str(budget.period_us)),
                    (group / "cpu.cfs_quota_us", str(budget.quota_us))]
        return [(group / "cpu.max", f"{budget.quota_us} {budget.period_us}")]

    def procs(self, name: str) -> Path:
        """The file a process joins group `name` by."""
        return self.group(name) / "cgroup.procs"

    def enter(self, name: str, argv: tuple[str, ...]) -> tuple[str, ...]:
        """`argv` started inside group `name`: a shell joins the group, then execs the program in its place."""
        return ("sh", "-c", _ENTER, str(self.procs(name)), *argv)


def group_names(suffix: str, hosts: int) -> tuple[str, ...]:
    """The groups of one run's hosts: `skippy-links-SUFFIX-cpu-hI`."""
    return tuple(f"{GROUP_PREFIX}{suffix}-cpu-h{i}" for i in range(hosts))
