"""Topology files for ad-hoc local pipelines: free loopback ports, the cut, BLAS threads per
stage, and the TOML text (docs/PROTOCOL.md §1).
"""

from __future__ import annotations

import json
import os
import random
import socket
import tempfile
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from skippy_zmq import defaults
from skippy_zmq.config import StageConfig, TopologyConfig
from skippy_zmq.errors import ConfigError
from skippy_zmq.launch.memory import MemoryModel, StageLimits, StageMemory, check_fits
from skippy_zmq.launch.planner import Plan, balanced_ranges, plan_model
from skippy_zmq.link import LinkShape
from skippy_zmq.model.catalog import resolve_model
from skippy_zmq.model.gguf_file import read_header
from skippy_zmq.model.gguf_model import read_hparams
from skippy_zmq.runtime.kernels import Kernel


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def blas_threads_per_stage(n_stages: int, *, busy_stages: int = 1, cores: int | None = None) -> int:
    """BLAS threads for each stage of a local pipeline whose stages share this host's cores.

    The rule: the stages that compute at the same time split the cores, and the others sleep.
    With one micro-batch a decode step visits the stages one after another, so one stage is
    busy at a time and each may use every core; with K micro-batches up to min(K, n_stages)
    stages are busy at once. Threads = max(1, cores // min(busy_stages, n_stages)).
    LocalPipeline pairs this with OPENBLAS_THREAD_TIMEOUT, without which the idle stages'
    spinning BLAS threads slow the busy one down (seen in hand-run trials on 2 cores with 16
    sessions; no tool in tools/ reproduces those figures, so none are quoted here).
    """
    if n_stages < 1 or busy_stages < 1:
        raise ConfigError(f"n_stages {n_stages} and busy_stages {busy_stages} must be >= 1")
    cores = host_cores() if cores is None else cores
    return max(1, cores // min(busy_stages, n_stages))


_ISSUED_PORTS: set[int] = set()
_LOWEST_PORT = 20000


def _ephemeral_low() -> int:
    """The first port of the range the OS takes outgoing connections' ports from (Linux's
    ip_local_port_range; 32768 when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    """True when a TCP socket can bind `host:port` right now."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.bind((host, port))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def free_tcp_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago, never one this process handed out before.

    They are drawn below the OS's ephemeral range: a port the OS picked for bind(0) can be
    picked again for the next caller or taken as the local end of an outgoing connection (a
    stage's connect, an HTTP client) before the process it was meant for binds it, which made
    a stage fail with "Address already in use" in CI. Below that range only explicit binds
    compete, and this process never hands the same port out twice.
    """
    low, high = _LOWEST_PORT, _ephemeral_low()
    rng = random.SystemRandom()
    chosen: list[int] = []
    for _ in range(50 * count + 100):
        if len(chosen) == count or high - low < count:
            break
        port = rng.randrange(low, high)
        if port not in _ISSUED_PORTS and _bindable(host, port):
            _ISSUED_PORTS.add(port)
            chosen.append(port)
    for _ in range(50 * count + 100):  # no room below the ephemeral range: let the OS pick
        if len(chosen) == count:
            break
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        finally:
            probe.close()
        if port not in _ISSUED_PORTS:
            _ISSUED_PORTS.add(port)
            chosen.append(port)
    if len(chosen) < count:
        raise ConfigError(f"found only {len(chosen)} of {count} free TCP ports on {host}")
    return chosen


def topology_toml(
    *,
    model: str,
    ranges: Sequence[tuple[int, int]],
    topology_id: str,
    ports: Sequence[int] | None = None,
    host: str = "127.0.0.1",
    codec: str = "raw-f32-v1",
    policy: str = "fixed",
    lane_count: int = 8,
    ctx_size: int = defaults.CTX_SIZE,
    n_layer: int | None = None,
    max_memory: Sequence[int] | None = None,
    cache_type_k: str = defaults.CACHE_TYPE,
    cache_type_v: str = defaults.CACHE_TYPE,
    stage_hosts: Sequence[str] | None = None,
    driver_host: str | None = None,
    keys_dir: str | None = None,
    emulate_link: LinkShape | None = None,
) -> str:
    """A topology file for `ranges` on `host`; `ports` are driver first, then one per stage, each
    stage keeping keys and values in the cache types given (llama.cpp's names) and holding at most
    its `max_memory` bytes when given; `emulate_link` shapes every stage's outgoing link. With
    `stage_hosts` (one per stage) and `driver_host`, each process instead binds its port on every
    interface and is reached at its host, which its `host` key names (several hosts). With
    `keys_dir`, every link is CURVE with the keys there (relative to the file)."""
    if (stage_hosts is None) != (driver_host is None):
        raise ConfigError("a topology over several hosts needs both the stages' hosts and the driver's host")
    if stage_hosts is not None and len(stage_hosts) != len(ranges):
        raise ConfigError(f"{len(stage_hosts)} hosts for {len(ranges)} stages")
    ports = list(ports) if ports is not None else [5710 + i for i in range(len(ranges) + 1)]
    security = ["", "[security]", "curve = true", f"keys_dir = {_toml_string(keys_dir)}"] if keys_dir else []
    lines = [
        f'topology_id = "{topology_id}"',
        f"model = {_toml_string(model)}",
        *( [f"n_layer = {n_layer}"] if n_layer is not None else [] ),
        f'activation_codec = "{codec}"',
        f'codec_policy = "{policy}"',
        *([f'emulate_link = "{emulate_link.describe()}"'] if emulate_link is not None else []),
        *security,
        "",
        "[driver]",
        *_endpoints("return", host, driver_host, ports[0]),
    ]
    for index, (start, end) in enumerate(ranges):
        lines += [
            "",
            "[[stages]]",
            f'id = "stage-{index}"',
            f"index = {index}",
            f"layer_start = {start}",
            f"layer_end = {end}",
            *_endpoints("pull", host, None if stage_hosts is None else stage_hosts[index], ports[index + 1]),
            f"lane_count = {lane_count}",
            f"ctx_size = {ctx_size}",
            f'cache_type_k = "{cache_type_k}"',
            f'cache_type_v = "{cache_type_v}"',
            *([f"max_memory = {max_memory[index]}"] if max_memory is not None else []),
        ]
    return "\n".join(lines) + "\n"


def _endpoints(prefix: str, host: str, runs_on: str | None, port: int) -> list[str]:
    """The bind line of a process on `host`; for one on another machine, a bind on every interface,
    the endpoint its peers connect to, and its `host` key."""
    if runs_on is None:
        return [f'{prefix}_bind = "tcp://{host}:{port}"']
    # Every interface: the address peers use may be a name, or a NAT's address that is on no
    # interface of the host, and binding it would fail there (docs/DEPLOY.md, "Plain hosts").
    return [f'{prefix}_bind = "tcp://0.0.0.0:{port}"', f"{prefix}_connect = {_toml_string(f'tcp://{runs_on}:{port}')}",
            f"host = {_toml_string(runs_on)}"]


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_local_topology(
    model: str,
    n_layer: int,
    n_stages: int,
    *,
    codec: str,
    policy: str,
    head_layers: float | None = None,
    directory: Path | None = None,
    lane_count: int = 8,
    ctx_size: int = defaults.CTX_SIZE,
    threads: int | None = None,
    max_stage_memory: int | None = None,
    cache_type_k: str = defaults.CACHE_TYPE,
    cache_type_v: str = defaults.CACHE_TYPE,
    emulate_link: LinkShape | None = None,
) -> Path:
    """Write a loopback topology for an ad-hoc local pipeline into a temporary directory.

    The cut is the planner's for the model file (its blocks' bytes for a quantized kernel, else
    measured costs or its float32 sizes), within each stage's memory limit: `max_stage_memory`,
    else the host's available memory shared evenly (a cut that cannot fit is refused here, before
    any stage starts); the plan heads the file as comments. A `head_layers` value instead cuts
    equal layers with a head worth that many. `threads` pins
    the BLAS threads of every stage; it is kept beside the topology (in `topology.launch.json`)
    for LocalPipeline, because topology files have no field for it.
    """
    directory = directory or Path(tempfile.mkdtemp(prefix="skippy-zmq-"))
    comments = ""
    limits: tuple[int, ...] | None = None
    if head_layers is None:
        cut = plan_local(model, n_layer, n_stages, lane_count=lane_count, ctx_size=ctx_size,
                         max_stage_memory=max_stage_memory, cache_type_k=cache_type_k, cache_type_v=cache_type_v)
        ranges = list(cut.ranges)
        comments = cut.describe() + "\n"
        limits = cut.limits.limits if cut.limits is not None else None
    else:
        ranges = balanced_ranges(n_layer, n_stages, head_layers)
    text = comments + topology_toml(
        model=model,
        ranges=ranges,
        topology_id=f"local-{n_stages}stage",
        ports=free_tcp_ports(n_stages + 1),
        codec=codec,
        policy=policy,
        lane_count=lane_count,
        ctx_size=ctx_size,
        n_layer=n_layer,
        max_memory=limits,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
        emulate_link=emulate_link,
    )
    out = directory / "topology.toml"
    out.write_text(text)
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"threads {threads} must be >= 1")
        launch_file(out).write_text(json.dumps({"threads": threads}) + "\n")
    return out


def has_experts(topology: TopologyConfig) -> bool:
    """Whether the topology's model has expert (mixture-of-experts) layers, by its header."""
    return read_hparams(resolve_model(topology.model)).n_expert > 0


def check_topology_memory(topology: TopologyConfig,
                          stages: Sequence[StageConfig] | None = None) -> tuple[StageMemory, ...]:
    """The memory estimate of each of `stages` (default: all the topology's), checked against its
    `max_memory` (else an even share of this host's available memory among those stages, the ones
    this host runs) before any of them starts; ConfigError naming the first stage that does not fit."""
    path = resolve_model(topology.model)
    header = read_header(path)
    hparams = read_hparams(path)
    chosen = tuple(topology.stages if stages is None else stages)
    share = StageLimits.even_share(len(chosen))
    estimates = []
    for stage, even in zip(chosen, share.limits, strict=True):
        if stage.layer_end > hparams.n_layer:
            raise ConfigError(f"{topology.source}: {stage.label} ends past the model's {hparams.n_layer} layers")
        kernel = Kernel.from_environment(stage.kernel)
        memory = MemoryModel.of_model(header, hparams, quantized=kernel.quantized,
                                      ctx_size=stage.ctx_size, lanes=stage.lane_count,
                                      cache_type_k=stage.cache_type_k, cache_type_v=stage.cache_type_v,
                                      head_by_nbits=partial(kernel.head_by_nbits, where=str(path)))
        limit = (StageLimits.uniform(stage.max_memory, 1, f"max_memory of {stage.label}")
                 if stage.max_memory is not None else StageLimits(limits=(even,), source=share.source))
        try:
            (estimate,) = check_fits(memory, [(stage.layer_start, stage.layer_end)], limit, [stage.label])
        except ConfigError as exc:
            raise ConfigError(f"{topology.source}: {exc}") from None
        estimates.append(estimate)
    return tuple(estimates)


def plan_local(model: str, n_layer: int, n_stages: int, *, lane_count: int, ctx_size: int,
               max_stage_memory: int | None, cache_type_k: str = defaults.CACHE_TYPE,
               cache_type_v: str = defaults.CACHE_TYPE, limits: StageLimits | None = None) -> Plan:
    """The cut of a local pipeline: by cost among the cuts whose stages fit `max_stage_memory` (else the
    host's available memory shared evenly; `limits` instead gives each stage its own), with the kernel
    this process's stages will run."""
    path = resolve_model(model)
    hparams = read_hparams(path)
    if hparams.n_layer != n_layer:
        raise ConfigError(f"{model}: the model has {hparams.n_layer} layers, not {n_layer}")
    kernel = Kernel.from_environment()
    quantized = kernel.quantized
    memory = MemoryModel.of_model(read_header(path), hparams, quantized=quantized, ctx_size=ctx_size,
                                  lanes=lane_count, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                                  head_by_nbits=partial(kernel.head_by_nbits, where=str(path)))
    if limits is None:
        limits = (StageLimits.even_share(n_stages) if max_stage_memory is None
                  else StageLimits.uniform(max_stage_memory, n_stages))
    return plan_model(hparams, n_stages, batch=lane_count, memory=memory, limits=limits, quantized=quantized)


def launch_file(topology_path: Path) -> Path:
    """Launch settings written beside a local topology (BLAS threads per stage)."""
    return topology_path.with_name(topology_path.stem + ".launch.json")


def launch_threads(topology_path: Path) -> int | None:
    """BLAS threads recorded by write_local_topology for this topology, if any."""
    try:
        value = json.loads(launch_file(topology_path).read_text()).get("threads")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value >= 1 else None
