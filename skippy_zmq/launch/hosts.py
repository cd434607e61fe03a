"""A pipeline over several hosts without Docker: the `--hosts` list, the cut within each host's
memory, and the topology whose stages name their hosts (docs/DEPLOY.md, "Plain hosts (no Docker)").

Each entry of `--hosts` is one stage, in pipeline order, and its memory is what that stage may
hold: a host named twice runs two stages, each within its own entry's bytes. Every process binds
its port on all interfaces and is reached at its host's address; CURVE is on unless turned off,
because the links leave the machine.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import attrs

from skippy_zmq import defaults
from skippy_zmq.config import TopologyConfig, endpoint_host, parse_size
from skippy_zmq.errors import ConfigError
from skippy_zmq.launch.memory import StageLimits
from skippy_zmq.launch.planner import Plan
from skippy_zmq.launch.topology import plan_local, topology_toml
from skippy_zmq.model.catalog import GEMMA3_270M_ALIAS, resolve_model
from skippy_zmq.model.gguf_model import read_hparams

DEFAULT_KEYS_DIR = "keys"
"""keys_dir of a planned multi-host topology: `keys/` beside the file (`keygen --bundles` copies it)."""
EXAMPLE_FILE = "cluster.toml"
"""The file name the next steps in a planned topology's comments use for it."""
_ADDRESS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}")
_WILDCARDS = frozenset({"0.0.0.0", "*"})


def check_address(address: str, where: str) -> str:
    """Return `address` if peers can connect to it (a host name or IPv4 address), else raise ConfigError."""
    if ":" in address:
        raise ConfigError(f"{where}: {address!r} is not taken: give a host name or IPv4 address without a port "
                          "(ports come from --base-port; the sockets are IPv4)")
    if not _ADDRESS.fullmatch(address) or address in _WILDCARDS:
        raise ConfigError(f"{where}: {address!r} is not an address peers can connect to; expected a host name "
                          "or IPv4 address such as 10.0.0.1")
    return address


@attrs.frozen
class HostEntry:
    """One stage's host in `--hosts`: the address its peers reach it at and the bytes the stage may hold."""

    address: str
    memory: int

    @classmethod
    def parse_list(cls, spec: str, where: str = "--hosts") -> tuple[HostEntry, ...]:
        """`10.0.0.1=12g,10.0.0.2=16GiB`: one entry per stage, in pipeline order."""
        entries = []
        for number, text in enumerate(spec.split(","), start=1):
            address, sep, memory = text.strip().rpartition("=")
            if not sep or not address or not memory.strip():
                raise ConfigError(f"{where}: entry {number} {text.strip()!r} must be ADDRESS=MEMORY, for example "
                                  "10.0.0.1=12GiB")
            address = check_address(address.strip(), f"{where}: entry {number}")
            entries.append(cls(address=address, memory=parse_size(memory, where=f"{where}: host {address}")))
        return tuple(entries)


def plan_hosts(model: str, hosts: Sequence[HostEntry], *, lane_count: int, ctx_size: int,
               cache_type_k: str = defaults.CACHE_TYPE, cache_type_v: str = defaults.CACHE_TYPE) -> Plan:
    """The cut of `model` into one stage per host entry, each within its entry's memory; ConfigError
    naming the stage, its host, its bytes and the limit when no cut fits."""
    if not hosts:
        raise ConfigError("--hosts names no host")
    path = resolve_model(model)
    limits = StageLimits.per_host([(host.address, host.memory) for host in hosts],
                                  source="each host's memory in --hosts")
    return plan_local(str(path), read_hparams(path).n_layer, len(hosts), lane_count=lane_count, ctx_size=ctx_size,
                      max_stage_memory=None, cache_type_k=cache_type_k, cache_type_v=cache_type_v, limits=limits)


def hosts_topology(model: str, hosts: Sequence[HostEntry], *, driver_host: str | None = None,
                   base_port: int = 5710, codec: str = "raw-f32-v1", policy: str = "auto-lossless-v1",
                   lane_count: int = 8, ctx_size: int = defaults.CTX_SIZE, cache_type_k: str = defaults.CACHE_TYPE,
                   cache_type_v: str = defaults.CACHE_TYPE, keys_dir: str | None = DEFAULT_KEYS_DIR) -> str:
    """The topology TOML of `plan --hosts`: the plan, the next steps and the ports to open as comments,
    then stage `i` on `hosts[i]` within its memory, the driver on `driver_host` (default: the first
    host), CURVE with `keys_dir` unless it is None. The text is checked by parsing it."""
    driver = check_address(driver_host, "--driver-host") if driver_host is not None else hosts[0].address
    cut = plan_hosts(model, hosts, lane_count=lane_count, ctx_size=ctx_size, cache_type_k=cache_type_k,
                     cache_type_v=cache_type_v)
    path = resolve_model(model)
    written = model if model == GEMMA3_270M_ALIAS else str(Path(path).resolve())
    body = topology_toml(
        model=written, ranges=cut.ranges, topology_id=f"{Path(str(path)).stem}-{len(hosts)}host",
        ports=[base_port + i for i in range(len(hosts) + 1)], codec=codec, policy=policy,
        n_layer=cut.cost_model.n_layer, lane_count=lane_count, ctx_size=ctx_size,
        max_memory=[host.memory for host in hosts], cache_type_k=cache_type_k, cache_type_v=cache_type_v,
        stage_hosts=[host.address for host in hosts], driver_host=driver, keys_dir=keys_dir)
    topology = TopologyConfig.from_toml_text(body, source="<plan --hosts>")
    return "\n".join([cut.describe(), *next_steps(topology, EXAMPLE_FILE)]) + "\n" + body


def next_steps(topology: TopologyConfig, file_name: str) -> list[str]:
    """Comment lines: the commands that deploy `topology` saved as `file_name`, and the ports to open."""
    hosts = topology.hosts()
    driver = topology.driver.runs_on
    lines = [f"# Next, on this machine, with this file saved as {file_name} "
             '(docs/DEPLOY.md, "Plain hosts (no Docker)"):']
    every = list(dict.fromkeys([*hosts, *([driver] if driver is not None else [])]))
    if topology.security.curve:
        lines += [f"#   skippy-zmq keygen --topology {file_name} --bundles bundles",
                  *(f"#   rsync -a bundles/{host}/ {host}:skippy/" for host in every)]
    else:
        lines += [f"#   scp {file_name} {host}:skippy/" for host in every]
    lines.append("# then in skippy/ on each host, stages first:")
    lines += [f"#   {host}: skippy-zmq up --topology {file_name} --host {host}" for host in hosts]
    lines.append(f"#   {driver}: skippy-zmq serve --topology {file_name}   (the gateway, with the driver)")
    if topology.model == GEMMA3_270M_ALIAS:
        lines.append(f"# Each of these hosts assembles {GEMMA3_270M_ALIAS} itself (pip install skippy-zmq[model]).")
    else:
        lines.append(f"# Each of these hosts needs the model at {topology.model}.")
    lines.append("# TCP ports each host must accept:")
    for host, rules in inbound_ports(topology).items():
        lines.append(f"#   {host}: " + "; ".join(f"{port} ({what}) from {', '.join(peers)}"
                                                  for port, what, peers in rules))
    return lines


def inbound_ports(topology: TopologyConfig) -> dict[str, list[tuple[int, str, tuple[str, ...]]]]:
    """Per host: each port it binds, what listens there, and the hosts that connect to it (a stage's
    PULL from its upstream's host, the driver's return socket from every stage's host)."""
    rules: dict[str, list[tuple[int, str, tuple[str, ...]]]] = {}
    driver = topology.driver.runs_on
    stage_hosts = tuple(dict.fromkeys(s.runs_on for s in topology.stages if s.runs_on is not None))
    if driver is not None:
        rules.setdefault(driver, []).append((_port(topology.driver.return_bind), "driver replies", stage_hosts))
    for stage in topology.stages:
        upstream = topology.upstream(stage)
        sender = driver if upstream is None else upstream.runs_on
        if stage.runs_on is not None:
            rules.setdefault(stage.runs_on, []).append(
                (_port(stage.pull_bind), stage.stage_id, (sender,) if sender is not None else ()))
    return rules


def _port(endpoint: str) -> int:
    port = endpoint.rpartition(":")[2]
    if endpoint_host(endpoint) is None or not port.isdigit():
        raise ConfigError(f"endpoint {endpoint!r} has no TCP port")
    return int(port)
