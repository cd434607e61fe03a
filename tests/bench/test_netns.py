"""The namespaces of `bench links`, planned in-process: names, addresses, the ip and tc command lines that
create, shape and delete them, and the parsers of what ip prints."""

from __future__ import annotations

import ipaddress
import json

import pytest

from skippy_zmq.bench.netns import (
    IFNAME_MAX,
    MAX_HOSTS,
    NAMESPACE_PREFIX,
    Layout,
    LinkCounters,
    Rate,
    TbfShape,
    free_subnets,
    namespace_names,
    stale_namespaces,
    taken_networks,
)
from skippy_zmq.errors import BenchError


@pytest.mark.parametrize(("text", "bits", "shown"), [
    ("1gbit", 10**9, "1gbit"), ("100mbit", 10**8, "100mbit"), ("10Mbit", 10**7, "10mbit"),
    ("1.5mbit", 1_500_000, "1500kbit"), ("2500kbit", 2_500_000, "2500kbit"), (" 64000bit ", 64_000, "64kbit"),
    ("1001bit", 1001, "1001bit"),
])
def test_a_rate_is_bits_per_second_in_powers_of_ten(text: str, bits: int, shown: str) -> None:
    rate = Rate.parse(text)
    assert (rate.bits_per_s, rate.text, rate.bytes_per_s) == (bits, shown, bits / 8)
    assert Rate.parse(rate.text) == rate


@pytest.mark.parametrize(("text", "message"), [
    ("100mbps", "link rate '100mbps' is not a rate (tc's mbps means megabytes per second: write mbit); expected"),
    ("fast", "link rate 'fast' is not a rate; expected a number and bit, kbit, mbit or gbit, such as 1gbit or 100mbit"),
    ("0.5bit", "link rate '0.5bit' is not a whole number of bits per second"),
    ("999bit", "link rate 999 bit/s is below 1kbit"),
    ("-1mbit", "is not a rate"),
])
def test_a_rate_that_is_not_one_is_refused(text: str, message: str) -> None:
    with pytest.raises(BenchError) as caught:
        Rate.parse(text)
    assert message in str(caught.value)


@pytest.mark.parametrize(("rate", "burst"), [
    ("1gbit", 500_000),  # 125 MB/s over 250 ticks
    ("100mbit", 50_000),
    ("10mbit", 5_000),
    ("1mbit", 1_514),  # 500 bytes a tick: one full frame instead
])
def test_the_bucket_holds_a_tick_of_the_rate_and_at_least_a_frame(rate: str, burst: int) -> None:
    shape = TbfShape.for_rate(Rate.parse(rate))
    assert shape.burst_bytes == burst
    assert shape.tc_args() == ("tbf", "rate", f"{Rate.parse(rate).bits_per_s}bit", "burst", str(burst),
                               "latency", "50ms")


def test_names_are_unique_prefixed_and_short_enough_for_an_interface() -> None:
    layout = Layout("abcdef01", MAX_HOSTS, 254)  # the longest suffix and host index
    names = layout.interfaces()
    assert len(set(names)) == len(names) == 2 * MAX_HOSTS + 3
    assert max(len(name) for name in names) <= IFNAME_MAX
    assert all(ns.startswith(NAMESPACE_PREFIX + "abcdef01-") for ns in layout.namespaces)
    assert len(set(layout.namespaces)) == MAX_HOSTS + 1
    other = Layout("abcdef02", MAX_HOSTS, 254)
    assert not set(names) & set(other.interfaces()) and not set(layout.namespaces) & set(other.namespaces)


def test_addresses() -> None:
    layout = Layout("1234", 3, 7)
    assert [layout.host_address(i) for i in range(3)] == ["10.77.7.1", "10.77.7.2", "10.77.7.3"]
    assert (layout.client_address, layout.gateway_address) == ("10.78.7.1", "10.78.7.2")
    assert not layout.bridge_network.overlaps(layout.client_network)
    with pytest.raises(BenchError, match=r"^host 3 is outside the layout's 3 hosts \(0 to 2\)$"):
        layout.host_address(3)


@pytest.mark.parametrize(("suffix", "hosts", "subnet", "message"), [
    ("ABCD", 2, 1, "namespace suffix 'ABCD' must be 4 to 8 lowercase hex digits"),
    ("abc", 2, 1, "namespace suffix 'abc' must be 4 to 8"),
    ("abcd", 0, 1, f"a layout of 0 hosts: expected 1 to {MAX_HOSTS}"),
    ("abcd", MAX_HOSTS + 1, 1, "hosts: expected 1 to"),
    ("abcd", 2, 255, "subnet 255 (10.77.255.0/24): expected 1 to 254"),
])
def test_a_layout_out_of_bounds_is_refused(suffix: str, hosts: int, subnet: int, message: str) -> None:
    with pytest.raises(BenchError) as caught:
        Layout(suffix, hosts, subnet)
    assert message in str(caught.value)


def _where(command: tuple[str, ...]) -> str:
    """The namespace an ip or tc command acts in (`root` without -n)."""
    return command[2] if command[1] == "-n" else "root"


def test_the_creation_builds_a_bridge_a_link_per_host_and_the_client_link() -> None:
    layout = Layout("beef", 2, 9)
    commands = layout.create_commands()
    assert commands[:3] == [("ip", "netns", "add", layout.switch), ("ip", "netns", "add", layout.host(0)),
                            ("ip", "netns", "add", layout.host(1))]
    made = set(layout.namespaces) | {"root"}
    assert all(_where(c) in made for c in commands[3:])  # every command acts in a namespace made before
    assert ("ip", "-n", layout.switch, "link", "add", "slbeefs1", "type", "veth", "peer", "name", "slbeefh1",
            "netns", layout.host(1)) in commands
    assert ("ip", "-n", layout.switch, "link", "set", "slbeefs1", "master", "slbeefbr") in commands
    assert ("ip", "-n", layout.host(1), "addr", "add", "10.77.9.2/24", "dev", "slbeefh1") in commands
    assert ("ip", "-n", layout.host(1), "link", "set", "lo", "up") in commands
    assert ("ip", "link", "add", "slbeefc", "type", "veth", "peer", "name", "slbeefg", "netns", layout.host(0)) \
        in commands
    assert ("ip", "addr", "add", "10.78.9.1/30", "dev", "slbeefc") in commands
    assert ("ip", "-n", layout.host(0), "addr", "add", "10.78.9.2/30", "dev", "slbeefg") in commands
    up = {(_where(c), c[-2]) for c in commands if c[-1] == "up"}
    assert up >= {(layout.host(i), layout.host_veth(i)) for i in range(2)} | {
        (layout.switch, layout.switch_veth(i)) for i in range(2)} | {("root", "slbeefc"), (layout.host(0), "slbeefg"),
                                                                     (layout.switch, "slbeefbr")}
    assert not [c for c in commands if c[0] == "tc"]  # shaping is its own step


def test_every_host_link_is_shaped_both_ways_at_the_rate() -> None:
    layout = Layout("beef", 3, 9)
    commands = layout.shape_commands(Rate.parse("100mbit"))
    tbf = ("root", "tbf", "rate", "100000000bit", "burst", "50000", "latency", "50ms")
    assert sorted(commands) == sorted(
        [("tc", "-n", layout.host(i), "qdisc", "replace", "dev", layout.host_veth(i), *tbf) for i in range(3)]
        + [("tc", "-n", layout.switch, "qdisc", "replace", "dev", layout.switch_veth(i), *tbf) for i in range(3)])
    assert layout.client_veth not in {c[6] for c in commands}  # the client's link is not a pipeline link


def test_the_deletion_undoes_the_creation() -> None:
    layout = Layout("beef", 3, 9)
    first, *rest = layout.delete_commands()
    assert first == ("ip", "link", "delete", "slbeefc")  # the root end: gone when the command returns
    assert all(c[:3] == ("ip", "netns", "delete") for c in rest)
    deleted = [c[3] for c in rest]
    assert sorted(deleted) == sorted(c[3] for c in layout.create_commands() if c[:3] == ("ip", "netns", "add"))
    assert deleted[-1] == layout.switch  # the hosts first
    # every interface made lives in a deleted namespace, or is the veth deleted first, with its peer
    added = [c for c in layout.create_commands() if c[:3] == ("ip", "link", "add") or c[3:5] == ("link", "add")]
    assert len(added) == 3 + 2  # the bridge, a veth pair per host, the client's
    for command in added:
        ifname = command[command.index("add") + 1]
        assert _where(command) in deleted or ifname == first[3], command


def test_the_counters_are_read_from_each_host_link() -> None:
    layout = Layout("beef", 2, 9)
    assert layout.counter_command(1) == ("ip", "-n", layout.host(1), "-s", "-j", "link", "show", "dev", "slbeefh1")
    text = json.dumps([{"ifname": "slbeefh1", "stats64": {"rx": {"bytes": 200, "packets": 2},
                                                          "tx": {"bytes": 90, "packets": 1}}}])
    before = LinkCounters.from_ip_json(text, "slbeefh1")
    assert before == LinkCounters(tx_bytes=90, rx_bytes=200)
    assert LinkCounters(1090, 260) - before == LinkCounters(1000, 60)


@pytest.mark.parametrize("text", ["[]", '[{"ifname": "other", "stats64": {}}]', '[{"ifname": "x"}]', "oops", "{}"])
def test_counters_missing_are_a_bench_error(text: str) -> None:
    with pytest.raises(BenchError, match=r"`ip -s -j link show dev x`"):
        LinkCounters.from_ip_json(text, "x")


def test_stale_namespaces_are_the_harness_own_only() -> None:
    listing = "docker-net (id: 0)\nskippy-links-ab12cd-h0 (id: 2)\nskippy-links-ab12cd-sw\n\nmine\n"
    assert namespace_names(listing) == ["docker-net", "skippy-links-ab12cd-h0", "skippy-links-ab12cd-sw", "mine"]
    assert stale_namespaces(listing) == ["skippy-links-ab12cd-h0", "skippy-links-ab12cd-sw"]
    assert stale_namespaces("") == []


def test_a_client_network_the_host_uses_is_not_chosen() -> None:
    routes = json.dumps([{"dst": "default", "gateway": "192.0.2.1"}, {"dst": "10.78.5.0/24", "dev": "x"},
                         {"dst": "10.78.9.4", "dev": "y"}])
    addresses = json.dumps([{"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
                            {"ifname": "v", "addr_info": [{"family": "inet", "local": "10.78.7.1", "prefixlen": 30},
                                                          {"family": "inet6", "local": "fe80::1", "prefixlen": 64}]}])
    taken = taken_networks(routes, addresses)
    assert ipaddress.IPv4Network("10.78.5.0/24") in taken and ipaddress.IPv4Network("10.78.7.0/30") in taken
    free = free_subnets(taken)
    assert 5 not in free and 7 not in free
    assert 9 in free  # 10.78.9.4 is past 10.78.9.0/30
    assert 9 not in free_subnets([ipaddress.IPv4Network("10.78.9.2/32")])
    assert free_subnets([ipaddress.IPv4Network("10.0.0.0/8")]) == []
    assert len(free_subnets([])) == 254


def test_route_listings_that_are_not_json_are_refused() -> None:
    with pytest.raises(BenchError, match=r"`ip -j route show` printed no JSON"):
        taken_networks("not json", "[]")
