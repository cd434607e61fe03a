"""`bench links`: the serving workload through a pipeline whose stages run in network namespaces of their
own, every link shaped by a token bucket, side by side with llama.cpp's RPC backend on the same links.

Modes (`--links`): `loopback` (the pipeline's processes on 127.0.0.1, no namespaces: the reference),
`RATE` (`1gbit`, `100mbit`: stage i in host i of bench/netns.py's layout, the gateway in host 0 with
stage 0, so the return link from the last stage crosses the network too), `rpc@RATE` (one
`ggml-rpc-server` per host, host 0's too, and `llama-server --rpc` in host 0 using them all, its
layers split as the pipeline's stages are) and `rpc@loopback`. Codecs and micro-batches apply to the
pipeline's modes only. Every setup starts its processes, runs the workload (bench/clients.py) at each
client count and stops them; rounds repeat the setups, in reverse order every second round.

Measured per run: aggregate tok/s, TTFT p50, ITL p50, and per hop the bytes each host sent (its link's
tx counter, read after the warm-up and after the run) per generated token. Hop i is host i's upload:
stage i to stage i+1, the last host's to the driver in host 0; on rpc modes host 0's upload is
llama-server's traffic to the other hosts' servers and host i's is their answers. Prompts and heartbeats
count too: a hop's bytes per token are everything it sent over the tokens generated.

The table gives, per setup and client count, medians over rounds and two ratios of aggregate tok/s:
`vs loopback`, a pipeline row over the loopback pipeline with the same codec, micro-batches and clients
(an rpc row over `rpc@loopback`), and `vs rpc`, a pipeline row over `rpc@` the same rate at the same
clients; `-` where the run has no such partner.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from skippy_zmq import defaults
from skippy_zmq.bench.clients import TEXTS, RunSummary, Workload
from skippy_zmq.bench.clients import run as run_clients
from skippy_zmq.bench.cpu_budget import CpuBudget, CpuHierarchy, group_names
from skippy_zmq.bench.netns import (
    KERNEL_HZ,
    MTU_FRAME_BYTES,
    NAMESPACE_PREFIX,
    TBF_LATENCY_MS,
    Command,
    Layout,
    LinkCounters,
    Rate,
    free_subnets,
    namespace_names,
    stale_namespaces,
    taken_networks,
)
from skippy_zmq.bench.report import Report, cell, markdown_table
from skippy_zmq.bench.servers import CLI, Server, ServerCommand, log_directory
from skippy_zmq.errors import BenchError
from skippy_zmq.wire.codecs import CODECS, LOSSLESS_CANDIDATES, ActivationCodec, CodecPolicy

LOOPBACK = "loopback"
"""The mode (and the rpc mode's link) without namespaces."""
RPC_PREFIX = "rpc@"
"""What names a llama.cpp RPC mode: `rpc@100mbit`."""
DRIVER_PORT = 5710
"""In a namespace: the driver's return port; stage i pulls on DRIVER_PORT + 1 + i."""
HTTP_PORT = 8000
"""In host 0's namespace: the gateway's (or llama-server's) HTTP port."""
RPC_PORT = 50052
"""In each host's namespace: its ggml-rpc-server's port (ggml's default)."""
COMMAND_TIMEOUT_S = 30.0
"""One `ip` or `tc` command."""
LEFTOVER_TIMEOUT_S = 10.0
"""How long a namespace's leftover processes may take to die after SIGKILL before it is deleted anyway."""
LISTEN_POLL_S = 0.1
"""Between two looks for an rpc-server's listening socket."""


@attrs.frozen
class Mode:
    """A pipeline (`rpc` False) or llama.cpp's RPC backend, on loopback (`rate` None) or shaped links."""

    rpc: bool
    rate: Rate | None

    @classmethod
    def parse(cls, text: str) -> Mode:
        """`loopback`, `100mbit`, `rpc@100mbit`, `rpc@loopback`."""
        word = text.strip().lower()
        rpc = word.startswith(RPC_PREFIX)
        link = word.removeprefix(RPC_PREFIX)
        try:
            return cls(rpc, None if link == LOOPBACK else Rate.parse(link))
        except BenchError as exc:
            raise BenchError(f"--links: {text!r} is not a mode ({exc}); expected loopback, a rate such as 100mbit, "
                             "or rpc@ either") from None

    @property
    def link(self) -> str:
        """`loopback` or the rate: `100mbit`."""
        return LOOPBACK if self.rate is None else self.rate.text

    @property
    def name(self) -> str:
        """The mode as `--links` names it."""
        return f"{RPC_PREFIX}{self.link}" if self.rpc else self.link


@attrs.frozen
class CodecChoice:
    """An activation codec of the pipeline's links, as named on the command line, and the topology keys
    it sets (`activation_codec`, `codec_policy`)."""

    name: str
    codec: str
    policy: str

    @classmethod
    def parse(cls, text: str) -> CodecChoice:
        """A codec's wire name or its short label (`f16`, `bf16`, `s8`, `f32`), or `auto-lossless-v1`
        (the policy, on the codec it falls back to)."""
        word = text.strip().lower()
        if word == CodecPolicy.AUTO_LOSSLESS_V1.value:
            return cls(word, LOSSLESS_CANDIDATES[0].wire_name, word)
        names = {name: spec.wire_name for spec in CODECS for name in (spec.wire_name, spec.label.lower())}
        if word not in names:
            raise BenchError(f"--codecs: {text!r} is not a codec; expected one of {', '.join(names)} or "
                             f"{CodecPolicy.AUTO_LOSSLESS_V1.value}")
        ActivationCodec.parse(names[word])
        return cls(names[word], names[word], CodecPolicy.FIXED.value)


@attrs.frozen
class Setup:
    """One configuration: a mode, and for a pipeline its codec and micro-batches."""

    mode: Mode
    codec: CodecChoice | None = None
    micro_batches: int | None = None

    @property
    def name(self) -> str:
        """`100mbit f16-rne-v1 x2`, `rpc@100mbit`."""
        if self.codec is None:
            return self.mode.name
        return f"{self.mode.name} {self.codec.name} x{self.micro_batches}"

    @property
    def slug(self) -> str:
        """The name as a file name."""
        return self.name.replace(" ", "-").replace("@", "-")

    def loopback_partner(self) -> Setup | None:
        """The setup this one's `vs loopback` divides by; None on loopback itself."""
        if self.mode.rate is None:
            return None
        return attrs.evolve(self, mode=Mode(self.mode.rpc, None))

    def rpc_partner(self) -> Setup | None:
        """The setup this one's `vs rpc` divides by: llama.cpp's RPC on the same links; None for an rpc setup."""
        return None if self.mode.rpc else Setup(Mode(True, self.mode.rate))


def setups(modes: Sequence[Mode], codecs: Sequence[CodecChoice], micro_batches: Sequence[int]) -> list[Setup]:
    """Every setup, in the order the modes were given: a pipeline mode with every codec and micro-batch
    count, an rpc mode once."""
    found: list[Setup] = []
    for mode in dict.fromkeys(modes):
        if mode.rpc:
            found.append(Setup(mode))
        else:
            found += [Setup(mode, codec, count) for codec in dict.fromkeys(codecs)
                      for count in dict.fromkeys(micro_batches)]
    return found


def schedule(found: Sequence[Setup], rounds: int) -> list[tuple[int, Setup]]:
    """(round, setup) in order: the setups as given in odd rounds and reversed in even ones, so none always
    runs first on a drifting host."""
    return [(r, setup) for r in range(1, rounds + 1) for setup in (found if r % 2 else list(reversed(found)))]


def tensor_split(ranges: Sequence[tuple[int, int]], n_layer: int) -> tuple[int, ...]:
    """llama-server's `--tensor-split` that puts the pipeline's ranges on its RPC devices in order.

    llama.cpp counts the output head as layer n_layer and gives layer l to the first device whose share
    of the cumulative split exceeds l / (n_layer + 1), so the stages' layer counts (the last one's plus
    one, its head) as proportions give device i exactly stage i's layers."""
    if not ranges or ranges[0][0] != 0 or ranges[-1][1] != n_layer or any(
            a[1] != b[0] for a, b in itertools.pairwise(ranges)) or any(s >= e for s, e in ranges):
        raise BenchError(f"the ranges {list(ranges)} do not cut layers 0..{n_layer} in order")
    counts = [end - start for start, end in ranges]
    counts[-1] += 1
    return tuple(counts)


@attrs.frozen
class Placement:
    """Where one setup's processes run: per host its namespace (None on loopback) and the address its
    processes bind, and where host 0's HTTP server listens for the benchmark's client."""

    namespaces: tuple[str | None, ...]
    addresses: tuple[str, ...]
    http_host: str
    hierarchy: CpuHierarchy | None = None
    groups: tuple[str, ...] = ()

    @classmethod
    def loopback(cls, hosts: int) -> Placement:
        """Every process on 127.0.0.1 in this namespace."""
        return cls((None,) * hosts, ("127.0.0.1",) * hosts, "127.0.0.1")

    @classmethod
    def of_layout(cls, layout: Layout) -> Placement:
        """Host i's processes in its namespace on its bridge address; HTTP on the client link."""
        hosts = range(layout.hosts)
        return cls(tuple(layout.host(i) for i in hosts), tuple(layout.host_address(i) for i in hosts),
                   layout.gateway_address)

    def capped(self, hierarchy: CpuHierarchy, groups: Sequence[str]) -> Placement:
        """The same placement with host i's processes in CPU group `groups[i]` (bench/cpu_budget.py)."""
        if len(groups) != len(self.namespaces):
            raise BenchError(f"{len(groups)} CPU groups for {len(self.namespaces)} hosts")
        return attrs.evolve(self, hierarchy=hierarchy, groups=tuple(groups))

    def wrap(self, index: int, argv: Sequence[str]) -> Command:
        """`argv` as host `index` runs it: inside its namespace (`ip netns exec`) when it has one, in its CPU
        group when capped (entered first: `ip netns exec` mounts the namespace's own /sys, without the
        cgroup hierarchies, and a group is kept across exec)."""
        namespace = self.namespaces[index]
        inner = tuple(argv) if namespace is None else ("ip", "netns", "exec", namespace, *argv)
        return inner if self.hierarchy is None else self.hierarchy.enter(self.groups[index], inner)


@attrs.frozen
class LinksBench:
    """What `bench links` was asked for."""

    model: Path
    stages: int
    modes: tuple[Mode, ...]
    codecs: tuple[CodecChoice, ...] = (CodecChoice.parse("raw-f32-v1"),)
    micro_batches: tuple[int, ...] = (1,)
    client_counts: tuple[int, ...] = (1, 16)
    tokens: int = 64
    requests: int = 1  # per client, one after another
    rounds: int = 1
    lanes: int = 16
    ctx_size: int = defaults.CTX_SIZE
    threads: int | None = None  # per worker and rpc-server; None: as a local pipeline's (launch/topology.py)
    host_cpus: CpuBudget | None = None  # each host's CPU cap (bench/cpu_budget.py); None: all share every core
    texts: str = attrs.field(default="stories", validator=attrs.validators.in_(tuple(TEXTS)))
    worker_args: tuple[str, ...] = ()
    serve_args: tuple[str, ...] = ()
    rpc_server: str | None = None
    llama_server: str | None = None
    rpc_server_args: tuple[str, ...] = ()
    llama_server_args: tuple[str, ...] = ()
    rpc_cache: bool = True
    ready_timeout_s: float = defaults.READY_TIMEOUT_S
    timeout_s: float = 600.0
    label: str = ""

    def setups(self) -> list[Setup]:
        """Every setup to run (module function `setups`)."""
        return setups(self.modes, self.codecs, self.micro_batches)

    @property
    def shaped(self) -> bool:
        """Some mode needs the namespaces."""
        return any(mode.rate is not None for mode in self.modes)

    def workload(self, count: int) -> Workload:
        """The workload of one run at `count` clients."""
        return Workload(clients=count, tokens=self.tokens, requests=self.requests, prompts=TEXTS[self.texts],
                        timeout_s=self.timeout_s)

    def threads_for(self, setup: Setup, cores: int) -> int:
        """Threads of each worker (or rpc-server, and llama-server) of `setup` on `cores` shared cores: as a
        local pipeline's stages get them (K micro-batches keep up to K stages busy at once; llama.cpp's
        RPC devices take turns, as one micro-batch); under a CPU budget, the host's whole CPUs."""
        if self.threads is not None:
            return self.threads
        if self.host_cpus is not None:
            return self.host_cpus.threads
        from skippy_zmq.launch.topology import blas_threads_per_stage

        return blas_threads_per_stage(self.stages, busy_stages=setup.micro_batches or 1, cores=cores)

    def rpc_binaries(self) -> tuple[str, str]:
        """The rpc-server and llama-server programs the rpc modes run; BenchError naming what is missing."""
        missing = [f"{option} (not given)" if value is None else f"{option} {value} (no such program)"
                   for option, value in (("--rpc-server", self.rpc_server), ("--llama-server", self.llama_server))
                   if value is None or shutil.which(value) is None]
        if missing:
            rpc = ", ".join(mode.name for mode in self.modes if mode.rpc)
            raise BenchError(f"the rpc modes ({rpc}) need llama.cpp's ggml-rpc-server and an RPC-enabled "
                             f"llama-server: {'; '.join(missing)}")
        assert self.rpc_server is not None and self.llama_server is not None
        return self.rpc_server, self.llama_server


def pipeline_commands(options: LinksBench, setup: Setup, placement: Placement, topology: Path,
                      ports: Sequence[int], threads: int) -> tuple[list[ServerCommand], ServerCommand]:
    """The workers (stage i in host i) and the gateway (host 0) of a pipeline setup; `ports` are the
    driver's, each stage's, then the HTTP port."""
    assert setup.micro_batches is not None and len(ports) == options.stages + 2
    workers = [ServerCommand(f"stage-{i}", placement.wrap(i, (
        *CLI, "worker", "--topology", str(topology), "--stage", f"stage-{i}", "--threads", str(threads),
        *options.worker_args)), ports[i + 1], placement.addresses[i]) for i in range(options.stages)]
    http = ports[-1]
    gateway = ServerCommand("serve", placement.wrap(0, (
        *CLI, "serve", "--topology", str(topology), "--host", placement.http_host, "--port", str(http),
        "--micro-batches", str(setup.micro_batches), "--ready-timeout", f"{options.ready_timeout_s:g}",
        *options.serve_args)), http, placement.http_host)
    return workers, gateway


def rpc_commands(options: LinksBench, placement: Placement, split: Sequence[int], ports: Sequence[int],
                 threads: int) -> tuple[list[ServerCommand], ServerCommand]:
    """One ggml-rpc-server per host and llama-server in host 0 using them all in host order, `split` its
    `--tensor-split`; `ports` are each rpc-server's, then the HTTP port."""
    rpc_server, llama_server = options.rpc_binaries()
    assert len(ports) == options.stages + 1 and len(split) == options.stages
    servers = [ServerCommand(f"rpc-server-{i}", placement.wrap(i, (
        rpc_server, "-H", placement.addresses[i], "-p", str(ports[i]), "-t", str(threads),
        *(("-c",) if options.rpc_cache else ()), *options.rpc_server_args)), ports[i], placement.addresses[i])
        for i in range(options.stages)]
    http = ports[-1]
    devices = ",".join(f"{placement.addresses[i]}:{ports[i]}" for i in range(options.stages))
    llama = ServerCommand("llama-server", placement.wrap(0, (
        llama_server, "-m", str(options.model), "--rpc", devices, "-ngl", "999",
        "-ts", ",".join(str(count) for count in split), "-t", str(threads), "-np", str(options.lanes),
        "-c", str(options.ctx_size * options.lanes), "-fit", "off", "--host", placement.http_host,
        "--port", str(http), *options.llama_server_args)), http, placement.http_host)
    return servers, llama


@attrs.frozen
class LinksRun:
    """One run: a setup in a round at a client count, its figures, and each host's link counters over the
    measured part (None on loopback)."""

    round: int
    setup: Setup
    clients: int
    threads: int
    summary: RunSummary
    links: tuple[LinkCounters, ...] | None
    host_cpus: float | None = None
    texts: str = "stories"

    def hop_bytes_per_token(self) -> tuple[float, ...] | None:
        """Per hop, the bytes its host sent per generated token (None on loopback or without tokens)."""
        tokens = self.summary.completion_tokens
        if self.links is None or tokens <= 0:
            return None
        return tuple(link.tx_bytes / tokens for link in self.links)

    def as_json(self, label: str) -> dict[str, Any]:
        """The run as a JSON row."""
        per_token = self.hop_bytes_per_token()
        codec = self.setup.codec
        return {
            "row": "run", "label": label, "mode": self.setup.mode.name, "server": "rpc" if self.setup.mode.rpc
            else "pipeline", "rate_bit_s": None if self.setup.mode.rate is None else self.setup.mode.rate.bits_per_s,
            "codec": None if codec is None else codec.codec, "codec_policy": None if codec is None else codec.policy,
            "micro_batches": self.setup.micro_batches, "round": self.round, "clients": self.clients,
            "threads": self.threads, "host_cpus": self.host_cpus, "texts": self.texts, **self.summary.as_json(),
            "upload_bytes": None if self.links is None else [link.tx_bytes for link in self.links],
            "download_bytes": None if self.links is None else [link.rx_bytes for link in self.links],
            "bytes_per_token_per_hop": None if per_token is None else [round(v, 1) for v in per_token],
        }


@attrs.frozen
class LinksCell:
    """One setup at one client count over the rounds: medians, and the ratios to its partners."""

    setup: Setup
    clients: int
    runs: tuple[LinksRun, ...]
    vs_loopback: float | None
    vs_rpc: float | None

    @property
    def tok_s(self) -> float:
        """Median aggregate tok/s."""
        return statistics.median(run.summary.aggregate_tok_s for run in self.runs)

    @property
    def ttft_p50_ms(self) -> float:
        """Median over rounds of the TTFT p50."""
        return statistics.median(run.summary.ttft_p50_ms for run in self.runs)

    @property
    def itl_p50_ms(self) -> float:
        """Median over rounds of the ITL p50."""
        return statistics.median(run.summary.itl_p50_ms for run in self.runs)

    def hop_bytes_per_token(self) -> tuple[float, ...] | None:
        """Per hop, the median over rounds of its bytes per generated token."""
        each = [per for run in self.runs if (per := run.hop_bytes_per_token()) is not None]
        return tuple(statistics.median(values) for values in zip(*each, strict=True)) if each else None

    def as_json(self, label: str) -> dict[str, Any]:
        """The cell as a JSON row."""
        per_token = self.hop_bytes_per_token()
        return {"row": "setup", "label": label, "mode": self.setup.mode.name,
                "codec": None if self.setup.codec is None else self.setup.codec.name,
                "micro_batches": self.setup.micro_batches, "clients": self.clients, "rounds": len(self.runs),
                "aggregate_tok_s": round(self.tok_s, 2), "ttft_p50_ms": round(self.ttft_p50_ms, 1),
                "itl_p50_ms": round(self.itl_p50_ms, 1),
                "vs_loopback": None if self.vs_loopback is None else round(self.vs_loopback, 3),
                "vs_rpc": None if self.vs_rpc is None else round(self.vs_rpc, 3),
                "bytes_per_token_per_hop": None if per_token is None else [round(v, 1) for v in per_token]}


def cells(runs: Sequence[LinksRun]) -> list[LinksCell]:
    """The runs grouped by setup and client count (in first-run order), with their ratios: a partner
    that streamed nothing gives none."""
    grouped: dict[tuple[Setup, int], list[LinksRun]] = {}
    for run in runs:
        grouped.setdefault((run.setup, run.clients), []).append(run)
    speed = {key: statistics.median(r.summary.aggregate_tok_s for r in group) for key, group in grouped.items()}

    def ratio(key: tuple[Setup, int], partner: Setup | None) -> float | None:
        base = speed.get((partner, key[1])) if partner is not None else None
        return speed[key] / base if base else None

    return [LinksCell(setup, count, tuple(group), ratio((setup, count), setup.loopback_partner()),
                      ratio((setup, count), setup.rpc_partner())) for (setup, count), group in grouped.items()]


def _ratio_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _bytes_cell(values: tuple[float, ...] | None) -> str:
    return "-" if values is None else " / ".join(f"{value:,.0f}" for value in values)


@attrs.frozen
class LinksResults:
    """Every run, and what the table says about the layout."""

    options: LinksBench
    ranges: tuple[tuple[int, int], ...]
    runs: tuple[LinksRun, ...]

    def cells(self) -> list[LinksCell]:
        """The runs by setup and client count (module function `cells`)."""
        return cells(self.runs)

    def problems(self) -> list[str]:
        """Runs whose figures do not count: requests failed, or fewer tokens than asked for."""
        return [f"{r.setup.name} round {r.round} at {r.clients} clients: {problem}"
                for r in self.runs if (problem := r.summary.problem()) is not None]

    def describe(self) -> str:
        """One line on the layout: the stages' layers, lanes, context, the links' buckets."""
        layers = ", ".join(f"{start}..{end}" for start, end in self.ranges)
        o = self.options
        return (f"{o.stages} stages (layers {layers}, the last with the head), {o.lanes} lanes of {o.ctx_size} "
                f"positions, {o.tokens} tokens per request, {o.requests} per client; links: tbf on "
                f"both directions of each host, burst max(rate / {KERNEL_HZ} Hz, {MTU_FRAME_BYTES} B), latency "
                f"{TBF_LATENCY_MS} ms; bytes/token: each host's upload (hop i: host i to the next, the last to "
                f"host 0) over the tokens generated; CPUs: {self.cpu_text()}; prompts: {o.texts}")

    def cpu_text(self) -> str:
        """Each host's CPU budget, or that every host shares every core."""
        budget = self.options.host_cpus
        return "every host shares every core of this machine" if budget is None else budget.text

    def table(self) -> str:
        """The layout's line, then one row per setup and client count."""
        rows = []
        for found in self.cells():
            setup = found.setup
            rows.append((setup.mode.name, "-" if setup.codec is None else setup.codec.name,
                         cell(setup.micro_batches), str(found.clients), cell(found.tok_s),
                         _ratio_cell(found.vs_loopback), _ratio_cell(found.vs_rpc), cell(found.ttft_p50_ms),
                         cell(found.itl_p50_ms), _bytes_cell(found.hop_bytes_per_token())))
        return self.describe() + "\n\n" + markdown_table(
            ("mode", "codec", "micro-batches", "clients", "tok/s", "vs loopback", "vs rpc", "TTFT p50 ms",
             "ITL p50 ms", "bytes/token per hop"), rows, "llrrrrrrrl")


# --------------------------------------------------------------------------- the shell: commands, processes


def namespace_prerequisites(euid: int, which: Callable[[str], str | None]) -> list[str]:
    """What shaped modes need and this host lacks: root, `ip` and `tc`."""
    missing = [] if euid == 0 else [f"root (this process runs as uid {euid}; namespaces, veths and qdiscs "
                                    "need CAP_NET_ADMIN)"]
    return missing + [f"`{tool}` (iproute2) on PATH" for tool in ("ip", "tc") if which(tool) is None]


def listening(proc_net_tcp: str, port: int) -> bool:
    """Whether /proc/PID/net/tcp's text (the sockets of that process's namespace) has one listening on `port`."""
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
            return True
    return False


def _run(argv: Sequence[str], what: str) -> str:
    """Run one command within COMMAND_TIMEOUT_S; its stdout, or BenchError with what it printed."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what}: `{shlex.join(argv)}` did not finish within {COMMAND_TIMEOUT_S:g} s") from None
    except OSError as exc:
        raise BenchError(f"{what}: `{shlex.join(argv)}` cannot run: {exc}") from None
    if done.returncode != 0:
        raise BenchError(f"{what}: `{shlex.join(argv)}` exited with status {done.returncode}: "
                         f"{(done.stderr or done.stdout).strip()[:500]}")
    return done.stdout


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while cleaning up, so an impatient second Ctrl-C leaves no
    process or namespace behind; they are delivered after."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Network:
    """A `Layout` made real: created whole or not at all, shaped, its counters read, deleted."""

    def __init__(self, layout: Layout, progress: Callable[[str], None]) -> None:
        self.layout = layout
        self.progress = progress
        self.created = False

    @classmethod
    def plan(cls, hosts: int, progress: Callable[[str], None]) -> Network:
        """A layout of `hosts` hosts under a suffix no namespace has and on a subnet the root namespace
        does not route; stale namespaces of this harness are named (not deleted: a run may own them)."""
        missing = namespace_prerequisites(os.geteuid(), shutil.which)
        if missing:
            raise BenchError(f"the shaped modes need {'; '.join(missing)}")
        names = namespace_names(_run(("ip", "netns", "list"), "listing network namespaces"))
        stale = stale_namespaces("\n".join(names))
        if stale:
            progress(f"found {len(stale)} namespaces named {NAMESPACE_PREFIX}* (a run killed before it cleaned up, "
                     f"or one still running): {', '.join(stale)}; left alone. To remove one: "
                     "ip netns pids NS | xargs -r kill; ip netns delete NS")
        taken = taken_networks(_run(("ip", "-j", "route", "show"), "listing routes"),
                               _run(("ip", "-j", "addr", "show"), "listing addresses"))
        subnets = free_subnets(taken)
        if not subnets:
            raise BenchError("every 10.78.X.0/30 client network overlaps a route or address of this host")
        while True:
            suffix = secrets.token_hex(3)
            if not any(suffix in name for name in names):
                break
        return cls(Layout(suffix, hosts, secrets.choice(subnets)), progress)

    def create(self) -> None:
        """Run every command of the layout; on a failure delete what was made, then raise."""
        layout = self.layout
        self.progress(f"creating namespaces {', '.join(layout.namespaces)} (hosts on {layout.bridge_network}, "
                      f"the client link {layout.client_network})")
        self.created = True
        try:
            for command in layout.create_commands():
                _run(command, "creating the namespaces")
        except BaseException:
            self.delete()
            raise

    def shape(self, rate: Rate) -> None:
        """Shape every host's link both ways at `rate`."""
        self.progress(f"shaping every host's link at {rate.text} both ways")
        for command in self.layout.shape_commands(rate):
            try:
                _run(command, f"shaping the links at {rate.text}")
            except BenchError as exc:
                raise BenchError(f"{exc}; the tbf qdisc could not be added (a kernel without sch_tbf, "
                                 "CONFIG_NET_SCH_TBF, refuses it)") from None

    def counters(self) -> tuple[LinkCounters, ...]:
        """Every host link's counters now, host 0 first."""
        return tuple(LinkCounters.from_ip_json(_run(self.layout.counter_command(i), "reading link counters"),
                                               self.layout.host_veth(i)) for i in range(self.layout.hosts))

    def delete(self) -> None:
        """Kill what still runs in the namespaces, delete them; BenchError naming any left."""
        if not self.created:
            return
        with _signals_held():
            failures = []
            for namespace in self.layout.namespaces[::-1]:
                try:
                    self._kill_leftovers(namespace)
                except BenchError as exc:
                    failures.append(str(exc))
            for command in self.layout.delete_commands():
                try:
                    _run(command, "deleting the namespaces")
                except BenchError as exc:
                    if command[:3] != ("ip", "link", "delete") or self._root_link_exists():
                        failures.append(str(exc))  # else a creation that failed before making it
            left = set(self.layout.namespaces) & set(namespace_names(_run(("ip", "netns", "list"), "listing")))
            self.created = bool(left)
        if left:
            raise BenchError(f"namespaces left behind: {', '.join(sorted(left))}: {'; '.join(failures)}")
        self.progress(f"deleted namespaces {', '.join(self.layout.namespaces)}")

    def _root_link_exists(self) -> bool:
        try:
            _run(("ip", "link", "show", "dev", self.layout.client_veth), "looking for the client link")
        except BenchError:
            return False
        return True

    def _kill_leftovers(self, namespace: str) -> None:
        pids = [int(word) for word in _run(("ip", "netns", "pids", namespace), "listing processes").split()]
        if not pids:
            return
        self.progress(f"killing processes still in {namespace}: {' '.join(map(str, pids))}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + LEFTOVER_TIMEOUT_S
        while _run(("ip", "netns", "pids", namespace), "listing processes").split():
            if time.monotonic() > deadline:
                raise BenchError(f"processes in {namespace} outlived SIGKILL by {LEFTOVER_TIMEOUT_S:g} s")
            time.sleep(0.1)


class CpuGroups:
    """One cgroup per host, capped at the run's CPU budget (bench/cpu_budget.py): made whole or not at all,
    removed at the end once their processes are gone."""

    def __init__(self, hierarchy: CpuHierarchy, names: tuple[str, ...], budget: CpuBudget,
                 progress: Callable[[str], None]) -> None:
        self.hierarchy = hierarchy
        self.names = names
        self.budget = budget
        self.progress = progress
        self.made: list[str] = []

    @classmethod
    def plan(cls, hosts: int, budget: CpuBudget, progress: Callable[[str], None]) -> CpuGroups:
        """The groups of `hosts` hosts under a fresh suffix, in the hierarchy /proc/mounts names."""
        mounts = Path("/proc/mounts").read_text()
        controllers = None
        for line in mounts.splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2":
                with contextlib.suppress(OSError):
                    controllers = (Path(fields[1]) / "cgroup.controllers").read_text()
                break
        hierarchy = CpuHierarchy.from_mounts(mounts, controllers)
        return cls(hierarchy, group_names(secrets.token_hex(3), hosts), budget, progress)

    def create(self) -> None:
        """Make and cap every group; on a failure remove what was made, then raise."""
        self.progress(f"capping each host at {self.budget.text} (cgroup v{self.hierarchy.version} at "
                      f"{self.hierarchy.root}: {', '.join(self.names)})")
        try:
            for path, value in self.hierarchy.enable_writes():
                _write(path, value, "enabling the cpu controller")
            for name in self.names:
                self.hierarchy.group(name).mkdir()
                self.made.append(name)
                for path, value in self.hierarchy.limit_writes(name, self.budget):
                    _write(path, value, f"capping {name}")
        except OSError as exc:
            self.delete()
            raise BenchError(f"--host-cpus: cannot make the CPU groups under {self.hierarchy.root}: {exc}") from None
        except BaseException:
            self.delete()
            raise

    def delete(self) -> None:
        """Kill what is left in the groups, remove them; BenchError naming any that outlived LEFTOVER_TIMEOUT_S."""
        with _signals_held():
            left = []
            for name in list(reversed(self.made)):
                group = self.hierarchy.group(name)
                deadline = time.monotonic() + LEFTOVER_TIMEOUT_S
                while True:
                    try:
                        group.rmdir()
                    except FileNotFoundError:
                        pass  # gone already
                    except OSError:  # busy: a process is still in it
                        if time.monotonic() > deadline:
                            left.append(name)
                            break
                        self._kill(name)
                        time.sleep(0.1)
                        continue
                    self.made.remove(name)
                    break
        if left:
            raise BenchError(f"CPU groups left behind (processes outlived SIGKILL by {LEFTOVER_TIMEOUT_S:g} s): "
                             f"{', '.join(str(self.hierarchy.group(n)) for n in left)}")

    def _kill(self, name: str) -> None:
        with contextlib.suppress(OSError):
            for word in self.hierarchy.procs(name).read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(word), signal.SIGKILL)


def cpu_groups_unavailable() -> str | None:
    """Why this host cannot make `--host-cpus` groups (not root, no CPU bandwidth control), or None."""
    if os.geteuid() != 0:
        return f"making cgroups needs root (this process runs as uid {os.geteuid()})"
    try:
        CpuGroups.plan(1, CpuBudget(1.0), lambda _line: None)
    except (BenchError, OSError) as exc:
        return str(exc)
    return None


def _write(path: Path, value: str, what: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise BenchError(f"--host-cpus: {what}: writing {value!r} to {path} failed: {exc}") from None


def _environment(program: str | None = None) -> dict[str, str]:
    """Every process's environment: OpenBLAS's and OpenMP's waits as a local pipeline's stages get them
    (launch/processes.py), the same for llama.cpp's processes; and for a llama.cpp program its own
    directory on LD_LIBRARY_PATH, where its build keeps the ggml libraries."""
    from skippy_zmq.launch.processes import BLAS_THREAD_TIMEOUT, openmp_wait_environment

    env = dict(os.environ)
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)
    env.update(openmp_wait_environment(env))
    if program is not None:
        found = shutil.which(program)
        directory = str(Path(found).resolve().parent) if found is not None else ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (directory, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


@contextlib.contextmanager
def _running() -> Iterator[list[Server]]:
    """The servers a setup starts, appended as they start; every one stopped at the end, the last
    started first (a gateway before its stages), signals held meanwhile."""
    servers: list[Server] = []
    try:
        yield servers
    finally:
        with _signals_held():
            for server in reversed(servers):
                server.stop()


def _wait_listening(server: Server, timeout_s: float) -> None:
    """Wait until the server's process has a socket listening on its port (in its own namespace: its
    /proc/PID/net/tcp); BenchError with its log's tail when it exits first or `timeout_s` passes."""
    deadline = server.started + timeout_s
    tcp = Path(f"/proc/{server.process.pid}/net/tcp")
    while True:
        if server.process.poll() is not None:
            raise server.failure(f"exited with status {server.process.returncode} before it listened on "
                                 f"{server.command.host}:{server.command.port}")
        with contextlib.suppress(OSError):
            if listening(tcp.read_text(), server.command.port):
                return
        if time.monotonic() >= deadline:
            raise server.failure(f"did not listen on {server.command.host}:{server.command.port} within "
                                 f"--ready-timeout {timeout_s:g} s")
        time.sleep(LISTEN_POLL_S)


@attrs.frozen
class _Plan:
    """What every setup shares: the model's cut, its layer count, the cores."""

    ranges: tuple[tuple[int, int], ...]
    n_layer: int
    cores: int


def _plan(options: LinksBench, progress: Callable[[str], None]) -> _Plan:
    from skippy_zmq.launch.topology import host_cores, plan_local
    from skippy_zmq.model.gguf_model import read_hparams

    n_layer = read_hparams(options.model).n_layer
    cut = plan_local(str(options.model), n_layer, options.stages, lane_count=options.lanes,
                     ctx_size=options.ctx_size, max_stage_memory=None)
    progress(f"the cut of {options.model.name} in {options.stages} stages:\n{cut.describe()}")
    return _Plan(tuple(cut.ranges), n_layer, host_cores())


def _start(options: LinksBench, setup: Setup, plan: _Plan, placement: Placement, directory: Path,
           servers: list[Server], progress: Callable[[str], None]) -> tuple[Server, int]:
    """Start a setup's processes into `servers`, wait until its HTTP server answers; (that server, threads)."""
    from skippy_zmq.launch.topology import free_tcp_ports, topology_toml

    threads = options.threads_for(setup, plan.cores)
    on_loopback = setup.mode.rate is None
    directory.mkdir(parents=True)
    if setup.mode.rpc:
        ports = (free_tcp_ports(options.stages + 1) if on_loopback
                 else [RPC_PORT] * options.stages + [HTTP_PORT])
        rpc, llama = rpc_commands(options, placement, tensor_split(plan.ranges, plan.n_layer), ports, threads)
        for command in rpc:
            progress(f"starting {command.name}: {command.shown}")
            servers.append(Server(command, directory / f"{command.name}.log", env=_environment(options.rpc_server)))
        for server in list(servers):
            _wait_listening(server, options.ready_timeout_s)
        progress(f"starting llama-server: {llama.shown}")
        servers.append(Server(llama, directory / "llama-server.log", env=_environment(options.llama_server)))
        companions = servers[:-1]
    else:
        assert setup.codec is not None
        ports = (free_tcp_ports(options.stages + 2) if on_loopback
                 else [DRIVER_PORT + i for i in range(options.stages + 1)] + [HTTP_PORT])
        topology = directory / "topology.toml"
        topology.write_text(topology_toml(
            model=str(options.model), ranges=plan.ranges, topology_id=f"links-{setup.slug}", ports=ports[:-1],
            **_placed(placement, on_loopback), codec=setup.codec.codec,
            policy=setup.codec.policy, lane_count=options.lanes, ctx_size=options.ctx_size, n_layer=plan.n_layer))
        workers, gateway = pipeline_commands(options, setup, placement, topology, ports, threads)
        env = _environment()
        for command in [*workers, gateway]:
            progress(f"starting {command.name}: {command.shown}")
            servers.append(Server(command, directory / f"{command.name}.log", env=env))
        companions = servers[:-1]
    ready_s = servers[-1].wait_healthy(options.ready_timeout_s, progress, companions=companions)
    progress(f"{setup.name} ready in {ready_s:.1f} s ({threads} threads per process)")
    return servers[-1], threads


def run_links_bench(options: LinksBench, report: Report, progress: Callable[[str], None]) -> LinksResults:
    """Plan the cut, make the namespaces when a mode is shaped, run every setup of every round at each
    client count (one report row per run, then one per setup and client count), delete everything."""
    if any(mode.rpc for mode in options.modes):
        options.rpc_binaries()
    plan = _plan(options, progress)
    order = schedule(options.setups(), options.rounds)
    network = Network.plan(options.stages, progress) if options.shaped else None
    groups = None if options.host_cpus is None else CpuGroups.plan(options.stages, options.host_cpus, progress)
    runs: list[LinksRun] = []
    with log_directory() as logs:
        try:
            if groups is not None:
                groups.create()
            if network is not None:
                network.create()
                # the bucket refused now, before any setup ran, if the kernel has no tbf
                network.shape(next(mode.rate for mode in options.modes if mode.rate is not None))
            for index, (round_index, setup) in enumerate(order, start=1):
                progress(f"setup {index}/{len(order)}: {setup.name}, round {round_index}")
                if setup.mode.rate is not None:
                    assert network is not None
                    network.shape(setup.mode.rate)
                placement = (Placement.loopback(options.stages) if setup.mode.rate is None or network is None
                             else Placement.of_layout(network.layout))
                if groups is not None:
                    placement = placement.capped(groups.hierarchy, groups.names)
                with _running() as servers:
                    http, threads = _start(options, setup, plan, placement, logs / f"{index:02d}-{setup.slug}",
                                           servers, progress)
                    for count in options.client_counts:
                        for server in servers:
                            server.check_alive()
                        runs.append(_measure(options, setup, round_index, count, threads, http.command.url,
                                             None if setup.mode.rate is None else network, progress))
                        report.add(runs[-1].as_json(options.label))
                    for server in servers:  # one that died in the last run: its log says why its requests failed
                        server.check_alive()
        finally:
            try:
                if network is not None:
                    network.delete()
            finally:
                if groups is not None:
                    groups.delete()
    results = LinksResults(options, plan.ranges, tuple(runs))
    for found in results.cells():
        report.add(found.as_json(options.label))
    return results


def _measure(options: LinksBench, setup: Setup, round_index: int, count: int, threads: int, url: str,
             network: Network | None, progress: Callable[[str], None]) -> LinksRun:
    progress(f"{setup.name}: {count} clients x {options.tokens} tokens")
    cpus = None if options.host_cpus is None else options.host_cpus.cpus
    if network is None:
        return LinksRun(round_index, setup, count, threads, run_clients(url, options.workload(count)), None,
                        cpus, options.texts)
    before: list[tuple[LinkCounters, ...]] = []
    summary = run_clients(url, options.workload(count), on_start=lambda: before.append(network.counters()))
    links = tuple(after - start for after, start in zip(network.counters(), before[0], strict=True))
    return LinksRun(round_index, setup, count, threads, summary, links, cpus, options.texts)


def _placed(placement: Placement, on_loopback: bool) -> dict[str, Any]:
    """topology_toml's arguments for where the processes run: all on 127.0.0.1, or stage i in host
    i's namespace (binding every interface there, reached at its address) and the driver in host 0's."""
    if on_loopback:
        return {"host": "127.0.0.1"}
    return {"stage_hosts": list(placement.addresses), "driver_host": placement.addresses[0]}
