"""Topology text for local and namespaced pipelines: one address per process."""

from __future__ import annotations

import pytest

from skippy_zmq.config import TopologyConfig
from skippy_zmq.errors import ConfigError
from skippy_zmq.launch.topology import topology_toml


def test_each_process_is_reached_on_its_own_host() -> None:
    text = topology_toml(model="m.gguf", ranges=[(0, 3), (3, 4)], topology_id="t", ports=[5710, 5711, 5712],
                         stage_hosts=["10.77.1.1", "10.77.1.2"], driver_host="10.77.1.1")
    topology = TopologyConfig.from_toml_text(text)
    assert (topology.driver.return_bind, topology.driver.return_connect) == ("tcp://0.0.0.0:5710",
                                                                             "tcp://10.77.1.1:5710")
    assert [(s.pull_bind, s.pull_connect, s.runs_on) for s in topology.stages] == [
        ("tcp://0.0.0.0:5711", "tcp://10.77.1.1:5711", "10.77.1.1"),
        ("tcp://0.0.0.0:5712", "tcp://10.77.1.2:5712", "10.77.1.2")]


def test_without_hosts_every_process_is_on_host() -> None:
    text = topology_toml(model="m.gguf", ranges=[(0, 2), (2, 4)], topology_id="t", host="10.0.0.5")
    assert [s.pull_bind for s in TopologyConfig.from_toml_text(text).stages] == ["tcp://10.0.0.5:5711",
                                                                                 "tcp://10.0.0.5:5712"]


def test_a_host_missing_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^1 hosts for 2 stages$"):
        topology_toml(model="m.gguf", ranges=[(0, 2), (2, 4)], topology_id="t", stage_hosts=["a"], driver_host="a")
    with pytest.raises(ConfigError, match=r"needs both the stages' hosts and the driver's host"):
        topology_toml(model="m.gguf", ranges=[(0, 2), (2, 4)], topology_id="t", stage_hosts=["a", "b"])
