"""Several hosts: the --hosts list, the cut within each host's memory, the topology naming each stage's host."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from skippy_zmq.config import TopologyConfig
from skippy_zmq.errors import ConfigError
from skippy_zmq.launch.hosts import HostEntry, hosts_topology, inbound_ports, plan_hosts
from skippy_zmq.launch.memory import MemoryModel, format_bytes
from skippy_zmq.model.gguf_file import read_header
from skippy_zmq.model.gguf_model import read_hparams
from skippy_zmq.runtime.kernels import Kernel
from tests.conftest import TINY_LLAMA_LAYERS

GiB = 1 << 30
# A context long enough that the KV cache, not the tiny weights, decides what fits.
CTX, LANES = 65536, 8


def test_a_hosts_list_is_one_entry_per_stage_in_order() -> None:
    entries = HostEntry.parse_list("10.0.0.1=12g, gpu-box.lan=16GiB,10.0.0.1=512MiB")
    assert entries == (HostEntry("10.0.0.1", 12 * GiB), HostEntry("gpu-box.lan", 16 * GiB),
                       HostEntry("10.0.0.1", 512 << 20))


@pytest.mark.parametrize(("spec", "message"), [
    ("10.0.0.1", r"--hosts: entry 1 '10\.0\.0\.1' must be ADDRESS=MEMORY, for example 10\.0\.0\.1=12GiB"),
    ("10.0.0.1=4g,,b=4g", r"--hosts: entry 2 '' must be ADDRESS=MEMORY"),
    ("=4g", r"entry 1 '=4g' must be ADDRESS=MEMORY"),
    ("a=4g,b=lots", r"--hosts: host b: 'lots' is not a memory size"),
    ("fe80::1=4g", r"--hosts: entry 1: 'fe80::1' is not taken: give a host name or IPv4 address without a port"),
    ("10.0.0.1:5711=4g", r"entry 1: '10\.0\.0\.1:5711' is not taken"),
    ("0.0.0.0=4g", r"entry 1: '0\.0\.0\.0' is not an address peers can connect to"),
    ("a/b=4g", r"entry 1: 'a/b' is not an address peers can connect to"),
    (".hidden=4g", r"entry 1: '\.hidden' is not an address"),
])
def test_a_bad_hosts_list_names_the_entry(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        HostEntry.parse_list(spec)


def _memory(path: Path) -> MemoryModel:
    """The estimates plan_hosts makes: this process's kernel, CTX positions and LANES lanes."""
    kernel = Kernel.from_environment()
    return MemoryModel.of_model(read_header(path), read_hparams(path), quantized=kernel.quantized, ctx_size=CTX,
                                lanes=LANES, head_by_nbits=partial(kernel.head_by_nbits, where=str(path)))


def test_each_stage_fits_its_own_hosts_memory(tiny_llama_path: Path) -> None:
    memory = _memory(tiny_llama_path)
    assert memory.kv_per_layer > 1 << 20  # the cut below is decided by memory
    small = memory.stage(0, 1).total  # room for one layer
    big = memory.stage(1, TINY_LLAMA_LAYERS).total
    plan = plan_hosts(str(tiny_llama_path), [HostEntry("small", small), HostEntry("big", big)],
                      lane_count=LANES, ctx_size=CTX)
    assert plan.ranges == ((0, 1), (1, TINY_LLAMA_LAYERS))
    assert plan.limits is not None and plan.limits.limits == (small, big)
    assert plan.stage_memory is not None
    assert all(m.total <= limit for m, limit in zip(plan.stage_memory, (small, big), strict=True))
    assert "# stage 0 on host small: layers 0..1" in plan.describe()
    assert "# memory limit per stage: each host's memory in --hosts" in plan.describe()
    swapped = plan_hosts(str(tiny_llama_path), [HostEntry("big", big), HostEntry("small", big)],
                         lane_count=LANES, ctx_size=CTX)
    assert swapped.ranges != plan.ranges  # the same model, room on both: the cut follows the costs


def test_no_cut_that_fits_names_the_stage_its_host_its_bytes_and_the_limit(tiny_llama_path: Path) -> None:
    memory = _memory(tiny_llama_path)
    one_layer = memory.stage(0, 1).total
    with pytest.raises(ConfigError) as info:
        plan_hosts(str(tiny_llama_path), [HostEntry("10.0.0.1", one_layer), HostEntry("10.0.0.2", one_layer)],
                   lane_count=LANES, ctx_size=CTX)
    text = str(info.value)
    assert text.startswith(f"no cut of {TINY_LLAMA_LAYERS} layers into 2 stages fits the memory limits; "
                           "the fastest cut's stage ")
    assert " on host 10.0.0." in text and " needs " in text
    assert f"over its limit of {format_bytes(one_layer)} (each host's memory in --hosts)" in text
    with pytest.raises(ConfigError, match=f"cannot cut {TINY_LLAMA_LAYERS} layers into 5 stages"):
        plan_hosts(str(tiny_llama_path), [HostEntry(f"h{i}", 8 * GiB) for i in range(5)], lane_count=1, ctx_size=64)


def test_the_topology_binds_every_interface_and_names_each_host(tiny_llama_path: Path, tmp_path: Path) -> None:
    hosts = [HostEntry("10.0.0.1", 2 * GiB), HostEntry("10.0.0.2", GiB), HostEntry("10.0.0.1", 3 * GiB)]
    text = hosts_topology(str(tiny_llama_path), hosts, base_port=6000, lane_count=2, ctx_size=256)
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    topo = TopologyConfig.from_toml(path)
    assert topo.n_stages == 3 and topo.layer_count == TINY_LLAMA_LAYERS
    assert [s.host for s in topo.stages] == ["10.0.0.1", "10.0.0.2", "10.0.0.1"]
    assert [s.pull_bind for s in topo.stages] == [f"tcp://0.0.0.0:{p}" for p in (6001, 6002, 6003)]
    assert [s.pull_connect for s in topo.stages] == ["tcp://10.0.0.1:6001", "tcp://10.0.0.2:6002",
                                                     "tcp://10.0.0.1:6003"]
    assert [s.max_memory for s in topo.stages] == [2 * GiB, GiB, 3 * GiB]
    assert {(s.lane_count, s.ctx_size) for s in topo.stages} == {(2, 256)}
    # the driver on the first host by default; CURVE with keys beside the file
    assert (topo.driver.return_bind, topo.driver.return_connect) == ("tcp://0.0.0.0:6000", "tcp://10.0.0.1:6000")
    assert topo.driver.host == "10.0.0.1"
    assert topo.security.curve and topo.security.keys_dir == tmp_path / "keys"
    assert topo.model == str(tiny_llama_path.resolve())
    assert "#   skippy-zmq keygen --topology cluster.toml --bundles bundles" in text
    assert "#   10.0.0.2: skippy-zmq up --topology cluster.toml --host 10.0.0.2" in text
    assert "#   10.0.0.1: skippy-zmq serve --topology cluster.toml" in text
    assert f"# Each of these hosts needs the model at {tiny_llama_path.resolve()}." in text
    assert "#   10.0.0.1: 6000 (driver replies) from 10.0.0.1, 10.0.0.2; 6001 (stage-0) from 10.0.0.1; " \
           "6003 (stage-2) from 10.0.0.2" in text


def test_the_driver_may_run_elsewhere_and_curve_may_be_off(tiny_llama_path: Path) -> None:
    hosts = [HostEntry("a.lan", GiB), HostEntry("b.lan", GiB)]
    text = hosts_topology(str(tiny_llama_path), hosts, driver_host="gw.lan", keys_dir=None, lane_count=1,
                          ctx_size=64)
    topo = TopologyConfig.from_toml_text(text)
    assert topo.driver.runs_on == "gw.lan" and not topo.security.curve
    assert "keygen" not in text and "#   scp cluster.toml gw.lan:skippy/" in text
    assert inbound_ports(topo) == {
        "gw.lan": [(5710, "driver replies", ("a.lan", "b.lan"))],
        "a.lan": [(5711, "stage-0", ("gw.lan",))],
        "b.lan": [(5712, "stage-1", ("a.lan",))],
    }
    with pytest.raises(ConfigError, match=r"--driver-host: '\*' is not an address peers can connect to"):
        hosts_topology(str(tiny_llama_path), hosts, driver_host="*")
