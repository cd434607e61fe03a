"""The network of `bench links`, planned without touching it: namespace, veth and bridge names, addresses,
and the exact `ip` and `tc` command lines that create the layout, shape its links and delete it; plus
the parsers of what `ip` prints back (namespace lists, routes, link counters). No process is started here
(bench/links.py runs the commands).

The layout, for `hosts` hosts under a unique `suffix`:

- a switch namespace `skippy-links-SUFFIX-sw` holding a bridge;
- one namespace per host, `skippy-links-SUFFIX-hI`, joined to the bridge by a veth pair whose host end
  has 10.77.X.(I+1)/24 (X: the layout's subnet);
- a separate veth pair from the root namespace (10.78.X.1/30) to host 0 (10.78.X.2/30): the benchmark's
  HTTP client reaches the gateway over it, unshaped (client traffic is not a pipeline link).

Every host's link is shaped in both directions by a token bucket (`tc-tbf`): on the host end's egress
(the host's upload) and on the switch end's egress (its download), so a transfer between two hosts
crosses two shaped queues. The bucket holds `burst` bytes: at least one kernel tick's worth of the rate
(rate / HZ, HZ = 250, the usual distribution kernel's CONFIG_HZ; a smaller bucket cannot refill fast
enough between two timer ticks to reach the rate) and at least one full Ethernet frame (a smaller bucket
never passes one). A message shorter than the burst after an idle gap passes at the veth's own speed, so
a decode step's small message pays no serialization time; sustained traffic gets the rate. `latency` 50
ms bounds the queue (tbf's limit = rate x latency + burst): a sender that floods the link waits at most
50 ms in the queue and then loses packets, as on a router with a moderate buffer, instead of queueing
without bound. Delay itself is not modelled here: the kernel has no `netem`; the stages emulate it.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Iterable
from typing import Any

import attrs

from skippy_zmq.errors import BenchError

NAMESPACE_PREFIX = "skippy-links-"
"""Every namespace this harness makes starts with it (stale ones are found by it)."""
VETH_PREFIX = "sl"
"""Every interface this harness makes starts with it, then the layout's suffix."""
IFNAME_MAX = 15
"""Linux interface names hold at most 15 characters (IFNAMSIZ less the terminating zero)."""
KERNEL_HZ = 250
"""Timer ticks per second the burst is sized for (the usual CONFIG_HZ)."""
MTU_FRAME_BYTES = 1514
"""The largest frame a veth of MTU 1500 sends: the bucket must hold one."""
TBF_LATENCY_MS = 50
"""How long a packet may wait in a shaped queue (see the module docstring)."""
BRIDGE_NET = "10.77.{x}.0/24"
"""The hosts' network; host I has .I+1."""
CLIENT_NET = "10.78.{x}.0/30"
"""The client link's network: .1 in the root namespace, .2 in host 0."""
MAX_HOSTS = 250
"""Hosts one layout holds (the bridge network's addresses, with room left)."""
_SUFFIX = re.compile(r"[0-9a-f]{4,8}")
_RATE = re.compile(r"(?P<number>\d+(?:\.\d+)?)(?P<unit>bit|kbit|mbit|gbit)", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}  # tc's units: powers of ten


@attrs.frozen
class Rate:
    """A link rate in bits per second."""

    bits_per_s: int = attrs.field()

    @bits_per_s.validator
    def _positive(self, _attribute: attrs.Attribute[int], value: int) -> None:
        if value < 1000:
            raise BenchError(f"link rate {value} bit/s is below 1kbit; expected a rate such as 100mbit")

    @classmethod
    def parse(cls, text: str) -> Rate:
        """`100mbit` -> 10**8 bit/s: a number and one of bit, kbit, mbit, gbit (powers of ten, as tc's)."""
        match = _RATE.fullmatch(text.strip())
        if match is None:
            hint = " (tc's mbps means megabytes per second: write mbit)" if text.strip().lower().endswith("bps") else ""
            raise BenchError(f"link rate {text!r} is not a rate{hint}; expected a number and bit, kbit, mbit or gbit, "
                             "such as 1gbit or 100mbit")
        bits = float(match.group("number")) * _RATE_UNITS[match.group("unit").lower()]
        if bits != int(bits):
            raise BenchError(f"link rate {text!r} is not a whole number of bits per second")
        return cls(int(bits))

    @property
    def bytes_per_s(self) -> float:
        """The rate in bytes per second."""
        return self.bits_per_s / 8

    @property
    def text(self) -> str:
        """The rate in the largest unit that writes it whole: `100mbit`."""
        for unit in ("gbit", "mbit", "kbit"):
            if self.bits_per_s % _RATE_UNITS[unit] == 0:
                return f"{self.bits_per_s // _RATE_UNITS[unit]}{unit}"
        return f"{self.bits_per_s}bit"


@attrs.frozen
class TbfShape:
    """One token bucket: its rate, its burst (bytes) and the longest wait in its queue."""

    rate: Rate
    burst_bytes: int
    latency_ms: int = TBF_LATENCY_MS

    @classmethod
    def for_rate(cls, rate: Rate) -> TbfShape:
        """The bucket the module docstring argues for: max(rate / HZ, one frame) bytes, 50 ms of queue."""
        return cls(rate, max(math.ceil(rate.bytes_per_s / KERNEL_HZ), MTU_FRAME_BYTES))

    def tc_args(self) -> tuple[str, ...]:
        """What follows `tc qdisc replace dev DEV root`: the rate in bits, so no unit is misread."""
        return ("tbf", "rate", f"{self.rate.bits_per_s}bit", "burst", str(self.burst_bytes),
                "latency", f"{self.latency_ms}ms")


Command = tuple[str, ...]
"""One command line, argv."""


@attrs.frozen
class Layout:
    """The namespaces of one benchmark: `hosts` hosts behind a bridge, under `suffix`, on subnet `subnet`."""

    suffix: str = attrs.field()
    hosts: int = attrs.field()
    subnet: int = attrs.field()

    @suffix.validator
    def _check_suffix(self, _attribute: attrs.Attribute[str], value: str) -> None:
        if _SUFFIX.fullmatch(value) is None:
            raise BenchError(f"namespace suffix {value!r} must be 4 to 8 lowercase hex digits")

    @hosts.validator
    def _check_hosts(self, _attribute: attrs.Attribute[int], value: int) -> None:
        if not 1 <= value <= MAX_HOSTS:
            raise BenchError(f"a layout of {value} hosts: expected 1 to {MAX_HOSTS}")

    @subnet.validator
    def _check_subnet(self, _attribute: attrs.Attribute[int], value: int) -> None:
        if not 1 <= value <= 254:
            raise BenchError(f"subnet {value} (10.77.{value}.0/24): expected 1 to 254")

    @property
    def switch(self) -> str:
        """The switch's namespace."""
        return f"{NAMESPACE_PREFIX}{self.suffix}-sw"

    def host(self, index: int) -> str:
        """Host `index`'s namespace."""
        self._check_index(index)
        return f"{NAMESPACE_PREFIX}{self.suffix}-h{index}"

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace: the switch, then the hosts."""
        return (self.switch, *(self.host(i) for i in range(self.hosts)))

    @property
    def bridge(self) -> str:
        """The bridge, in the switch's namespace."""
        return f"{VETH_PREFIX}{self.suffix}br"

    def host_veth(self, index: int) -> str:
        """Host `index`'s end of its link, in its namespace."""
        self._check_index(index)
        return f"{VETH_PREFIX}{self.suffix}h{index}"

    def switch_veth(self, index: int) -> str:
        """The switch's end of host `index`'s link, a port of the bridge."""
        self._check_index(index)
        return f"{VETH_PREFIX}{self.suffix}s{index}"

    @property
    def client_veth(self) -> str:
        """The root namespace's end of the client link."""
        return f"{VETH_PREFIX}{self.suffix}c"

    @property
    def gateway_veth(self) -> str:
        """Host 0's end of the client link."""
        return f"{VETH_PREFIX}{self.suffix}g"

    def interfaces(self) -> tuple[str, ...]:
        """Every interface the layout makes."""
        return (self.bridge, *(self.host_veth(i) for i in range(self.hosts)),
                *(self.switch_veth(i) for i in range(self.hosts)), self.client_veth, self.gateway_veth)

    @property
    def bridge_network(self) -> ipaddress.IPv4Network:
        """The hosts' network."""
        return ipaddress.IPv4Network(BRIDGE_NET.format(x=self.subnet))

    @property
    def client_network(self) -> ipaddress.IPv4Network:
        """The client link's network."""
        return ipaddress.IPv4Network(CLIENT_NET.format(x=self.subnet))

    def host_address(self, index: int) -> str:
        """Host `index`'s address on the bridge."""
        self._check_index(index)
        return str(self.bridge_network[index + 1])

    @property
    def client_address(self) -> str:
        """The root namespace's address on the client link."""
        return str(self.client_network[1])

    @property
    def gateway_address(self) -> str:
        """Host 0's address on the client link: the gateway's HTTP listens there."""
        return str(self.client_network[2])

    def create_commands(self) -> list[Command]:
        """Every command that builds the layout, in order (unshaped: `shape_commands` shapes it)."""
        sw = self.switch
        commands: list[Command] = [("ip", "netns", "add", ns) for ns in self.namespaces]
        commands += [("ip", "-n", sw, "link", "add", self.bridge, "type", "bridge"),
                     ("ip", "-n", sw, "link", "set", self.bridge, "up")]
        prefix = self.bridge_network.prefixlen
        for i in range(self.hosts):
            ns, host_end, switch_end = self.host(i), self.host_veth(i), self.switch_veth(i)
            commands += [
                ("ip", "-n", sw, "link", "add", switch_end, "type", "veth", "peer", "name", host_end, "netns", ns),
                ("ip", "-n", sw, "link", "set", switch_end, "master", self.bridge),
                ("ip", "-n", sw, "link", "set", switch_end, "up"),
                ("ip", "-n", ns, "link", "set", "lo", "up"),
                ("ip", "-n", ns, "addr", "add", f"{self.host_address(i)}/{prefix}", "dev", host_end),
                ("ip", "-n", ns, "link", "set", host_end, "up"),
            ]
        h0, client_prefix = self.host(0), self.client_network.prefixlen
        commands += [
            ("ip", "link", "add", self.client_veth, "type", "veth", "peer", "name", self.gateway_veth, "netns", h0),
            ("ip", "addr", "add", f"{self.client_address}/{client_prefix}", "dev", self.client_veth),
            ("ip", "link", "set", self.client_veth, "up"),
            ("ip", "-n", h0, "addr", "add", f"{self.gateway_address}/{client_prefix}", "dev", self.gateway_veth),
            ("ip", "-n", h0, "link", "set", self.gateway_veth, "up"),
        ]
        return commands

    def shape_commands(self, rate: Rate) -> list[Command]:
        """Shape every host's link both ways at `rate` (`replace`: the first call adds the bucket, later
        ones change its rate)."""
        args = TbfShape.for_rate(rate).tc_args()
        commands: list[Command] = []
        for i in range(self.hosts):
            commands += [("tc", "-n", self.host(i), "qdisc", "replace", "dev", self.host_veth(i), "root", *args),
                         ("tc", "-n", self.switch, "qdisc", "replace", "dev", self.switch_veth(i), "root", *args)]
        return commands

    def delete_commands(self) -> list[Command]:
        """Delete the client link (its root end; the other goes with it), then every namespace, the hosts
        first. A namespace's interfaces go with it, but only once the kernel has destroyed it, which it
        does after `ip netns delete` returns: the root end is deleted itself, so nothing is left behind
        in the root namespace when this returns."""
        return [("ip", "link", "delete", self.client_veth),
                *(("ip", "netns", "delete", ns) for ns in reversed(self.namespaces))]

    def counter_command(self, index: int) -> Command:
        """Host `index`'s link counters as JSON (`counters` reads them)."""
        return ("ip", "-n", self.host(index), "-s", "-j", "link", "show", "dev", self.host_veth(index))

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.hosts:
            raise BenchError(f"host {index} is outside the layout's {self.hosts} hosts (0 to {self.hosts - 1})")


def namespace_names(listing: str) -> list[str]:
    """The names `ip netns list` prints, one a line (`NAME` or `NAME (id: N)`)."""
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def stale_namespaces(listing: str) -> list[str]:
    """The namespaces of `ip netns list` with this harness's prefix (left by a run that was killed)."""
    return [name for name in namespace_names(listing) if name.startswith(NAMESPACE_PREFIX)]


def taken_networks(routes_json: str, addresses_json: str) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks the root namespace already uses: its routes' destinations (`ip -j route show`)
    and its addresses' networks (`ip -j addr show`); the default route takes none."""
    taken: list[ipaddress.IPv4Network] = []
    for route in _json_list(routes_json, "ip -j route show"):
        dst = route.get("dst") if isinstance(route, dict) else None
        if isinstance(dst, str) and dst != "default":
            taken.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False))
    for link in _json_list(addresses_json, "ip -j addr show"):
        for info in (link.get("addr_info", []) if isinstance(link, dict) else []):
            if isinstance(info, dict) and info.get("family") == "inet":
                taken.append(ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", strict=False))
    return taken


def free_subnets(taken: Iterable[ipaddress.IPv4Network]) -> list[int]:
    """The subnets X whose client network (the only one the root namespace sees) overlaps none of `taken`."""
    used = list(taken)
    return [x for x in range(1, 255)
            if not any(ipaddress.IPv4Network(CLIENT_NET.format(x=x)).overlaps(net) for net in used)]


@attrs.frozen
class LinkCounters:
    """One link's byte counters: sent (its upload) and received (its download)."""

    tx_bytes: int
    rx_bytes: int

    @classmethod
    def from_ip_json(cls, text: str, ifname: str) -> LinkCounters:
        """The counters `ip -s -j link show dev IFNAME` prints; BenchError when they are not there."""
        for link in _json_list(text, f"ip -s -j link show dev {ifname}"):
            if isinstance(link, dict) and link.get("ifname") == ifname:
                try:
                    stats = link["stats64"]
                    return cls(int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
                except (KeyError, TypeError, ValueError):
                    break
        raise BenchError(f"`ip -s -j link show dev {ifname}` gave no byte counters of {ifname}: {text[:300]!r}")

    def __sub__(self, earlier: LinkCounters) -> LinkCounters:
        """What was counted since `earlier`."""
        return LinkCounters(self.tx_bytes - earlier.tx_bytes, self.rx_bytes - earlier.rx_bytes)


def _json_list(text: str, what: str) -> list[Any]:
    try:
        value = json.loads(text or "[]")
    except ValueError:
        raise BenchError(f"`{what}` printed no JSON: {text[:300]!r}") from None
    if not isinstance(value, list):
        raise BenchError(f"`{what}` printed {type(value).__name__}, not a JSON list")
    return value
