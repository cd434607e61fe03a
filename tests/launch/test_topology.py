"""Topology text for local and namespaced pipelines: one address per process."""

from __future__ import annotations

import pytest

from skippy_zmq.config import TopologyConfig
from skippy_zmq.errors import ConfigError
from skippy_zmq.launch.topology import topology_toml


def test_each_process_binds_and_is_reached_on_its_own_host() -> None:
    text = topology_toml(model="m.gguf", ranges=[(0, 3), (3, 4)], topology_id="t", ports=[5710, 5711, 5712],
                         hosts=["10.77.1.1", "10.77.1.1", "10.77.1.2"])
    topology = TopologyConfig.from_toml_text(text)
    assert (topology.driver.return_bind, topology.driver.return_connect) == ("tcp://10.77.1.1:5710",) * 2
    assert [(s.pull_bind, s.pull_connect) for s in topology.stages] == [
        ("tcp://10.77.1.1:5711", "tcp://10.77.1.1:5711"), ("tcp://10.77.1.2:5712", "tcp://10.77.1.2:5712")]


def test_without_hosts_every_process_is_on_host() -> None:
    text = topology_toml(model="m.gguf", ranges=[(0, 2), (2, 4)], topology_id="t", host="10.0.0.5")
    assert [s.pull_bind for s in TopologyConfig.from_toml_text(text).stages] == ["tcp://10.0.0.5:5711",
                                                                                 "tcp://10.0.0.5:5712"]


def test_a_host_missing_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^2 hosts for a driver and 2 stages; expected 3$"):
        topology_toml(model="m.gguf", ranges=[(0, 2), (2, 4)], topology_id="t", hosts=["a", "b"])
