"""The docker-compose deployment: a valid compose file whose services match the topology."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from skippy_zmq.config import TopologyConfig

pytestmark = pytest.mark.slow  # real worker processes (or docker-compose) on 127.0.0.1

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"


def _container_port(port: str | dict) -> int:
    """The container side of a published port, in either compose syntax."""
    if isinstance(port, dict):
        return int(port["target"])
    return int(str(port).split(":")[-1].split("/")[0])  # HOST:PUBLISHED:TARGET[/tcp]


def _host(endpoint: str) -> str:
    return endpoint.removeprefix("tcp://").rsplit(":", 1)[0]


@pytest.fixture(scope="module")
def compose() -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (.ci/run installs Debian's package)")
    done = subprocess.run(
        [binary, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def test_compose_runs_one_service_per_stage_plus_the_gateway(compose: dict) -> None:
    services = compose["services"]
    commands = {name: service["command"] for name, service in services.items()}
    topology_files = {cmd[cmd.index("--topology") + 1] for cmd in commands.values()}
    assert len(topology_files) == 1, "every service must use the same topology file"
    topology = TopologyConfig.from_toml(REPO / topology_files.pop())
    stage_services = {name for name, cmd in commands.items() if cmd[0] == "worker"}
    assert stage_services == {stage.stage_id for stage in topology.stages}
    for stage in topology.stages:
        command = commands[stage.stage_id]
        assert command[command.index("--stage") + 1] == stage.stage_id
        # Peers reach a stage by its service name.
        assert _host(stage.pull_connect) == stage.stage_id
    gateways = [name for name, cmd in commands.items() if cmd[0] == "serve"]
    assert gateways == [_host(topology.driver.return_connect)]
    gateway = services[gateways[0]]
    assert "/health" in " ".join(gateway["healthcheck"]["test"])
    assert [_container_port(p) for p in gateway["ports"]] == [8000]
    assert {service["image"] for service in services.values()} == {"skippy-zmq:latest"}


def test_stages_start_downstream_first(compose: dict) -> None:
    services = compose["services"]
    assert set(services["stage-0"]["depends_on"]) == {"stage-1"}
    assert set(services["stage-1"]["depends_on"]) == {"stage-2"}
    assert set(services["gateway"]["depends_on"]) == {"stage-0"}
    for name in ("stage-0", "stage-1", "gateway"):
        for dependency in services[name]["depends_on"].values():
            assert dependency == {"condition": "service_healthy"}
    for name in ("stage-0", "stage-1", "stage-2"):
        command = services[name]["command"]
        ready = command[command.index("--ready-file") + 1]
        assert ready in services[name]["healthcheck"]["test"]


def test_dockerfile_bakes_the_default_model_into_the_image() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "ensure_gemma3_270m" in text and "SKIPPY_ZMQ_CACHE" in text
    assert "'.[model]'" in text
