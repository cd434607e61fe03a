"""The pipeline as a Docker Swarm stack: docker-compose.yml with docker-stack.yml (docs/DEPLOY.md,
"A swarm").

The unmarked tests read the files as `docker stack deploy` merges them. The slow ones, where a
Docker engine answers, turn it into a single-node swarm (when it is not one already), deploy the
stack from a prepared copy of this checkout, and check that it answers over HTTPS with the API
key, that swarm replaces a stage killed or frozen mid-completion while the gateway replays its
sessions to the same text, and that `docker stack rm` leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.deploy_support import (
    COMPOSE,
    STACK,
    Checkout,
    https,
    load,
    merged,
    run,
    stack_view,
    streamed,
    wait_healthy,
)

# Keys `docker stack deploy` refuses outright, and keys it ignores (with a warning): neither may be in
# the file both orchestrators read, or a swarm would silently run something else than it says.
FORBIDDEN = {"mem_limit", "memswap_limit", "extends", "volumes_from", "volume_driver", "cpu_quota", "cpu_shares",
             "cpuset", "mem_reservation", "cpus"}
IGNORED = {"build", "restart", "depends_on", "security_opt", "tmpfs", "links", "network_mode", "container_name",
           "external_links", "privileged", "devices", "cgroup_parent", "userns_mode", "ports"}


@pytest.fixture(scope="module")
def stack() -> dict[str, Any]:
    """What the swarm runs: docker-compose.yml with docker-stack.yml."""
    return stack_view()


def test_the_shared_file_holds_only_what_a_swarm_runs() -> None:
    for name, service in load(COMPOSE)["services"].items():
        assert not (set(service) & FORBIDDEN), f"{name}: {set(service) & FORBIDDEN} (docker stack deploy refuses it)"
        assert not (set(service) & IGNORED), f"{name}: {set(service) & IGNORED} (a swarm ignores it)"


def test_the_stack_file_adds_to_the_shared_one_and_overrides_nothing() -> None:
    assert set(load(STACK)["services"]) == set(load(COMPOSE)["services"])
    merged(load(COMPOSE), load(STACK))  # raises, naming the key, if both set one


def test_each_service_runs_on_its_labelled_node_with_dns_round_robin(stack: dict[str, Any]) -> None:
    for name, service in stack["services"].items():
        deploy = service["deploy"]
        assert deploy["placement"]["constraints"] == [f"node.labels.skippy.{name} == true"], name
        # No virtual IP: the long-lived ZeroMQ connections never meet IPVS's idle timeout.
        assert deploy["endpoint_mode"] == "dnsrr", name
        assert deploy["restart_policy"]["condition"] == "any", name  # a stage SIGTERMed by swarm exits 0
        assert service["networks"] == ["links"], name
        assert "healthcheck" in service, name  # a frozen stage turns unhealthy, and swarm replaces it
    assert stack["networks"] == {"links": {"driver": "overlay"}}


def test_the_gateway_publishes_its_port_on_its_own_node_only(stack: dict[str, Any]) -> None:
    ports = stack["services"]["gateway"]["ports"]
    # Host mode: on the gateway's node (routing-mesh ingress would need a virtual IP; dnsrr has none).
    assert ports == [{"target": 8000, "published": "${SKIPPY_HTTPS_PORT:-8000}", "protocol": "tcp", "mode": "host"}]
    assert all("ports" not in service for name, service in stack["services"].items() if name != "gateway")


def test_every_secret_reaches_its_service_with_the_containers_uid(stack: dict[str, Any]) -> None:
    for name, service in stack["services"].items():
        for secret in service["secrets"]:
            if secret["mode"] != 0o444:  # public keys and the certificate are readable by all
                assert (secret["uid"], secret["gid"], secret["mode"]) == ("10001", "10001", 0o400), (name, secret)


@pytest.mark.slow
def test_docker_stack_accepts_the_files() -> None:
    if subprocess.run(["sh", "-c", "command -v docker"], capture_output=True, check=False).returncode != 0:
        pytest.skip("the docker CLI is not installed (.ci/run installs Debian's docker.io)")
    done = run(["docker", "stack", "config", "-c", COMPOSE.name, "-c", STACK.name], COMPOSE.parent, 60)
    if done.returncode != 0 and "unknown command" in done.stderr + done.stdout:
        pytest.skip(f"this docker CLI has no `stack config`: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr


# ---- a single-node swarm -----------------------------------------------------------------


class Swarm:
    """The stack deployed on this engine's swarm."""

    def __init__(self, checkout: Checkout, name: str, port: int) -> None:
        self.checkout = checkout
        self.name = name
        self.port = port

    def docker(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run(["docker", *args], self.checkout.root, timeout, self.checkout.env)

    def logs(self) -> str:
        """The services' last log lines and task states, for a failure's message."""
        parts = []
        for service in ("stage-0", "stage-1", "stage-2", "gateway"):
            tasks = self.docker("service", "ps", "--no-trunc", f"{self.name}_{service}").stdout
            logs = self.docker("service", "logs", "--tail", "15", f"{self.name}_{service}").stdout
            parts.append(f"--- {service}\n{tasks}\n{logs[-1500:]}")
        return "\n".join(parts)

    def container(self, service: str) -> str:
        """The running container of the service's one task."""
        deadline = time.monotonic() + 120
        while True:
            listed = self.docker("ps", "-q", "--filter", f"label=com.docker.swarm.service.name={self.name}_{service}",
                                 "--filter", "status=running").stdout.split()
            if len(listed) == 1:
                return listed[0]
            assert time.monotonic() < deadline, f"{service}: running containers {listed}\n{self.logs()}"
            time.sleep(1)

    def pid(self, container: str) -> int:
        return int(self.docker("inspect", "-f", "{{.State.Pid}}", container).stdout.strip())

    def leftovers(self) -> list[str]:
        """What of the stack still exists: services, containers, networks, secrets."""
        label = f"label=com.docker.stack.namespace={self.name}"
        found = []
        for kind in (["service", "ls"], ["ps", "-a"], ["network", "ls"], ["secret", "ls"]):
            listed = self.docker(*kind, "-q", "--filter", label).stdout.split()
            found += [f"{kind[0]} {item}" for item in listed]
        return found


def _swarm_state() -> str:
    done = run(["docker", "info", "-f", "{{.Swarm.LocalNodeState}}"], COMPOSE.parent, 30)
    return done.stdout.strip()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def swarm(deploy_checkout: Checkout) -> Iterator[Swarm]:
    """The stack on a single-node swarm: `docker swarm init` where the engine is in none, the node
    labelled for every service, then the documented `docker stack deploy` (docs/DEPLOY.md)."""
    joined = _swarm_state() == "active"
    if not joined:
        init = run(["docker", "swarm", "init", "--advertise-addr", "127.0.0.1"], deploy_checkout.root, 120)
        if init.returncode != 0:
            pytest.skip(f"docker swarm init failed here: {init.stderr.strip()[-500:]}")
    name = f"skippyswarm{os.getpid()}"
    port = _free_port()
    deploy_checkout.env["SKIPPY_HTTPS_PORT"] = str(port)
    running = Swarm(deploy_checkout, name, port)
    node = running.docker("info", "-f", "{{.Swarm.NodeID}}").stdout.strip()
    labels = [f"skippy.{service}" for service in ("stage-0", "stage-1", "stage-2", "gateway")]
    try:
        for label in labels:
            assert running.docker("node", "update", "--label-add", f"{label}=true", node).returncode == 0
        # --resolve-image never: the image is this engine's own, in no registry.
        deployed = running.docker("stack", "deploy", "--resolve-image", "never", "-c", COMPOSE.name, "-c",
                                  STACK.name, name, timeout=300)
        assert deployed.returncode == 0, deployed.stderr
        wait_healthy(deploy_checkout, port, running.logs)
        yield running
    finally:
        running.docker("stack", "rm", name)
        deadline = time.monotonic() + 120
        while running.leftovers() and time.monotonic() < deadline:
            time.sleep(1)
        volumes = running.docker("volume", "ls", "-q", "--filter", f"name={name}_").stdout.split()
        if volumes:
            running.docker("volume", "rm", *volumes)
        for label in labels:
            running.docker("node", "update", "--label-rm", label, node)
        if not joined:
            run(["docker", "swarm", "leave", "--force"], deploy_checkout.root, 120)
        del deploy_checkout.env["SKIPPY_HTTPS_PORT"]


BODY = {"prompt": "Write a short story about a lighthouse keeper.", "max_tokens": 64, "temperature": 0,
        "ignore_eos": True}


@pytest.mark.slow
def test_the_swarm_stack_serves_over_https_with_the_api_key_only(swarm: Swarm) -> None:
    checkout = swarm.checkout
    prompt = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    assert https(checkout, swarm.port, "/v1/completions", None, prompt)[0] == 401
    status, answer = https(checkout, swarm.port, "/v1/completions", checkout.key(), prompt)
    assert status == 200 and answer["choices"][0]["text"].strip(), (answer, swarm.logs())
    # Swarm's secrets: each service sees every public key and its own secret key, as the container's user.
    for service in ("stage-0", "stage-1", "stage-2", "gateway"):
        own = "driver" if service == "gateway" else service
        listed = swarm.docker("exec", swarm.container(service), "sh", "-c",
                              "find /app/keys -type f -exec stat -c '%n %u %a' {} +").stdout.split("\n")
        secrets = sorted(line for line in listed if "/secret/" in line)
        assert secrets == [f"/app/keys/compose/secret/{own}.key_secret 10001 400"], (service, listed)
        assert len([line for line in listed if "/public/" in line]) == 4, (service, listed)


def _interrupted(swarm: Swarm, service: str, signum: int) -> tuple[str, str, str]:
    """A greedy completion before, then the same one streamed while `service`'s process gets `signum`
    after 8 chunks; (text before, text streamed, the container that got the signal)."""
    checkout = swarm.checkout
    status, answer = https(checkout, swarm.port, "/v1/completions", checkout.key(), BODY)
    assert status == 200, swarm.logs()
    container = swarm.container(service)
    pid = swarm.pid(container)
    chunks: list[str] = []
    for text in streamed(checkout, swarm.port, checkout.key(), BODY):
        chunks.append(text)
        if len(chunks) == 8:
            os.kill(pid, signum)
    assert len(chunks) > 8, chunks
    return answer["choices"][0]["text"], "".join(chunks), container


@pytest.mark.slow
def test_swarm_replaces_a_killed_stage_and_the_text_is_the_same(swarm: Swarm) -> None:
    before, streamed_text, old = _interrupted(swarm, "stage-1", signal.SIGKILL)
    assert streamed_text == before, swarm.logs()
    assert swarm.container("stage-1") != old  # a new task's container, not the old one restarted
    wait_healthy(swarm.checkout, swarm.port, swarm.logs, 180)


@pytest.mark.slow
def test_swarm_replaces_a_frozen_stage_and_the_text_is_the_same(swarm: Swarm) -> None:
    """SIGSTOP: the process lives but beats no more; its healthcheck fails, swarm stops the task
    (SIGKILL after the grace period) and starts another, and the gateway replays."""
    before, streamed_text, old = _interrupted(swarm, "stage-2", signal.SIGSTOP)
    assert streamed_text == before, swarm.logs()
    assert swarm.container("stage-2") != old
    state = swarm.docker("inspect", "-f", "{{.State.Status}}", old).stdout.strip()
    assert state in ("exited", "dead", ""), f"the frozen container is {state}"
    wait_healthy(swarm.checkout, swarm.port, swarm.logs, 180)


@pytest.mark.slow
def test_docker_stack_rm_leaves_nothing_behind(swarm: Swarm) -> None:
    assert swarm.docker("stack", "rm", swarm.name).returncode == 0
    deadline = time.monotonic() + 120
    while (left := swarm.leftovers()) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == []
    assert re.search(swarm.name, swarm.docker("service", "ls").stdout) is None


# ---- a swarm of two engines --------------------------------------------------------------


SUBNET = "10.87.{}.{}"  # the test's bridge: 10.87.X.1 on the host, .2 and .3 for the engines


class Engines:
    """Two more Docker engines, each in a network namespace of its own, joined by a bridge: two
    hosts, as far as a swarm can tell (their own addresses, daemons, data and images)."""

    def __init__(self, root: Any, tag: int, checkout: Checkout) -> None:
        self.tag = tag
        self.root = root
        self.checkout = checkout.root  # where the docker CLI finds the compose files
        self.bridge = f"skzbr{tag}"
        self.names = [f"skz{tag}e{i}" for i in (1, 2)]
        self.net = tag % 250
        self.address = [SUBNET.format(self.net, i + 2) for i in range(2)]
        self.sockets = [f"/run/skz{tag}e{i}.sock" for i in (1, 2)]
        self.pids: list[int] = []
        self.rule = ["DOCKER-USER", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]

    def docker(self, engine: int, *args: str, timeout: float = 120,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run(["docker", "-H", f"unix://{self.sockets[engine]}", *args], self.checkout, timeout, env)

    def start(self) -> str | None:
        """Bring up the bridge, the namespaces and both engines; why not, or None when they answer."""
        gateway = SUBNET.format(self.net, 1)
        steps = [["ip", "link", "add", self.bridge, "type", "bridge"],
                 ["ip", "addr", "add", f"{gateway}/24", "dev", self.bridge], ["ip", "link", "set", self.bridge, "up"]]
        for name, address in zip(self.names, self.address, strict=True):
            steps += [["ip", "netns", "add", name],
                      ["ip", "link", "add", f"{name}a", "type", "veth", "peer", "name", f"{name}b"],
                      ["ip", "link", "set", f"{name}b", "netns", name],
                      ["ip", "link", "set", f"{name}a", "master", self.bridge, "up"],
                      ["ip", "-n", name, "addr", "add", f"{address}/24", "dev", f"{name}b"],
                      ["ip", "-n", name, "link", "set", f"{name}b", "up"],
                      ["ip", "-n", name, "link", "set", "lo", "up"],
                      ["ip", "-n", name, "route", "add", "default", "via", gateway]]
        for step in steps:
            done = run(step, self.root, 30)
            if done.returncode != 0:
                return f"{' '.join(step)}: {done.stderr.strip()}"
        # The host engine's FORWARD policy drops bridged traffic that no rule of its own accepts.
        run(["iptables", "-I", *self.rule], self.root, 30)
        for name, sock in zip(self.names, self.sockets, strict=True):
            # nsenter, not `ip netns exec`: that remounts /sys, and dockerd then finds no cgroups.
            log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 (the daemon's log, closed by the OS at exit)
            daemon = subprocess.Popen(
                ["nsenter", f"--net=/var/run/netns/{name}", "dockerd", "--data-root", str(self.root / name),
                 "--exec-root", f"/run/{name}", "--pidfile", f"/run/{name}.pid", "-H", f"unix://{sock}"],
                stdout=log, stderr=subprocess.STDOUT)
            self.pids.append(daemon.pid)
        deadline = time.monotonic() + 60
        while not all(self.docker(i, "info", timeout=10).returncode == 0 for i in (0, 1)):
            if time.monotonic() > deadline:
                return f"the engines did not answer within 60 s (logs in {self.root})"
            time.sleep(1)
        return None

    def stop(self) -> None:
        """Everything `start` made, gone: engines (and their data), namespaces, the bridge, the rule."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in self.pids:
            deadline = time.monotonic() + 60
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                time.sleep(0.5)
        run(["iptables", "-D", *self.rule], self.root, 30)
        for name in self.names:
            run(["ip", "netns", "del", name], self.root, 30)
            run(["ip", "link", "del", f"{name}a"], self.root, 30)
            run(["rm", "-rf", str(self.root / name), f"/run/{name}"], self.root, 120)
        run(["ip", "link", "del", self.bridge], self.root, 30)


def _two_engines_ready() -> str | None:
    for tool in ("ip", "iptables", "nsenter", "dockerd"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


@pytest.mark.slow
def test_a_swarm_of_two_engines_places_stages_on_different_nodes(
        deploy_checkout: Checkout, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two engines in their own network namespaces form a swarm over their addresses; the stack
    puts stage-1 on the second node and the rest on the first, and answers over the overlay."""
    reason = _two_engines_ready()
    if reason is not None:
        pytest.skip(reason)
    engines = Engines(tmp_path_factory.mktemp("engines"), os.getpid() % 10000, deploy_checkout)
    try:
        reason = engines.start()
        if reason is not None:
            pytest.skip(f"two engines in network namespaces cannot run here: {reason}")
        image = deploy_checkout.image
        for engine in (0, 1):  # what `docker save | ssh NODE docker load` does between hosts
            saved = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
            loaded = subprocess.run(["docker", "-H", f"unix://{engines.sockets[engine]}", "load", "-q"],
                                    stdin=saved.stdout, capture_output=True, text=True, timeout=600, check=False)
            saved.wait(60)
            assert loaded.returncode == 0, loaded.stderr
        init = engines.docker(0, "swarm", "init", "--advertise-addr", engines.address[0])
        assert init.returncode == 0, init.stderr
        token = engines.docker(0, "swarm", "join-token", "-q", "worker").stdout.strip()
        joined = engines.docker(1, "swarm", "join", "--token", token, f"{engines.address[0]}:2377", timeout=180)
        assert joined.returncode == 0, joined.stderr
        manager = engines.docker(0, "info", "-f", "{{.Swarm.NodeID}}").stdout.strip()
        worker = engines.docker(1, "info", "-f", "{{.Swarm.NodeID}}").stdout.strip()
        for label in ("gateway", "stage-0", "stage-2"):
            assert engines.docker(0, "node", "update", "--label-add", f"skippy.{label}=true", manager).returncode == 0
        assert engines.docker(0, "node", "update", "--label-add", "skippy.stage-1=true", worker).returncode == 0
        port = _free_port()
        deployed = engines.docker(0, "stack", "deploy", "--resolve-image", "never", "-c", COMPOSE.name, "-c",
                                  STACK.name, "pair", timeout=300,
                                  env=deploy_checkout.env | {"SKIPPY_HTTPS_PORT": str(port)})
        assert deployed.returncode == 0, deployed.stderr

        def running(engine: int) -> list[str]:
            return sorted(name.split(".")[0] for name in engines.docker(
                engine, "ps", "--filter", "health=healthy", "--format", "{{.Names}}").stdout.split())

        deadline = time.monotonic() + 600
        while (running(0), running(1)) != (["pair_gateway", "pair_stage-0", "pair_stage-2"], ["pair_stage-1"]):
            assert time.monotonic() < deadline, (running(0), running(1), engines.docker(0, "service", "ps",
                                                                                        "pair_stage-1").stdout)
            time.sleep(2)
        # The client reaches the gateway's node at its own address (host-mode publishing there).
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        deadline = time.monotonic() + 300
        while True:
            try:
                status, answer = https(deploy_checkout, port, "/v1/completions", deploy_checkout.key(), body,
                                       timeout=60, address=engines.address[0])
            except OSError:
                status, answer = 0, None
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert status == 200 and answer["choices"][0]["text"].strip(), (status, answer)
        engines.docker(0, "stack", "rm", "pair")
    finally:
        engines.stop()

