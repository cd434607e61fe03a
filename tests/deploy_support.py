"""What the Docker tests share (tests/test_deploy.py, tests/test_swarm.py): reading the compose
files as each orchestrator merges them, and a copy of this checkout prepared as docs/DEPLOY.md
says (the base image, the image built once, keys, the API key, a certificate, secret files owned
by the containers' user)."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from skippy_zmq.config import TopologyConfig
from skippy_zmq.security.keys import keygen

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
COMPOSE_OVERRIDE = REPO / "docker-compose.override.yml"
STACK = REPO / "docker-stack.yml"
BASE_TOOL = REPO / "tools" / "build_base_image.sh"
IMAGE_UID = 10001
DEFAULT_IMAGE = "skippy-zmq:latest"


def load(path: Path) -> dict[str, Any]:
    """A compose file as YAML (anchors and `<<` merges resolved)."""
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def merged(base: dict[str, Any], extra: dict[str, Any], where: str = "") -> dict[str, Any]:
    """`extra` laid over `base` as docker-compose and `docker stack deploy` merge their files, for
    files that never set one scalar or list twice (AssertionError naming the key otherwise)."""
    out = dict(base)
    for key, value in extra.items():
        if key not in out:
            out[key] = value
        elif isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = merged(out[key], value, f"{where}{key}.")
        elif key == "version" and out[key] == value:
            continue
        else:
            raise AssertionError(f"{where}{key} is set in both files: {out[key]!r} and {value!r}")
    return out


def compose_view() -> dict[str, Any]:
    """What `docker-compose up` runs: docker-compose.yml with docker-compose.override.yml."""
    return merged(load(COMPOSE), load(COMPOSE_OVERRIDE))


def stack_view() -> dict[str, Any]:
    """What `docker stack deploy -c docker-compose.yml -c docker-stack.yml` runs."""
    return merged(load(COMPOSE), load(STACK))


def image_name(service: dict[str, Any]) -> str:
    """A service's image with ${SKIPPY_IMAGE:-default} resolved to its default."""
    return str(service["image"]).replace("${SKIPPY_IMAGE:-skippy-zmq:latest}", DEFAULT_IMAGE)


def docker_ready() -> str | None:
    """Why the Docker tests cannot run here, or None when they can. .ci/run installs and starts the
    engine where it can, and says in SKIPPY_DOCKER_SETUP what failed."""
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


def run(command: list[str], cwd: Path, timeout: float,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A command's result, its output captured (never raises for a non-zero status)."""
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          env=None if env is None else os.environ | env)


def inspect(target: str, template: str) -> str:
    """`docker inspect -f TEMPLATE TARGET`'s output."""
    done = subprocess.run(["docker", "inspect", "-f", template, target], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def dangling_images() -> set[str]:
    """Ids of the engine's untagged images."""
    listed = run(["docker", "image", "ls", "-q", "--no-trunc", "--filter", "dangling=true"], REPO, 60)
    return set(listed.stdout.split())


class Checkout:
    """A copy of this checkout with the host steps of docs/DEPLOY.md done and the image built."""

    def __init__(self, root: Path, base: str, image: str) -> None:
        self.root = root
        self.base = base
        self.image = image
        # Every service runs this build's image (${SKIPPY_IMAGE} in docker-compose.yml).
        self.env = {"SKIPPY_BASE_IMAGE": base, "SKIPPY_IMAGE": image}

    def key(self) -> str:
        """The gateway's API key."""
        return (self.root / "secrets" / "api_key").read_text().strip()

    def context(self) -> ssl.SSLContext:
        """A TLS context trusting the stack's certificate."""
        return ssl.create_default_context(cafile=str(self.root / "secrets" / "tls.crt"))


def prepare_checkout(root: Path) -> Checkout:
    """Copy the checkout to `root`, make the base image (tools/build_base_image.sh), the keys, the API
    key, a certificate for localhost, and give the secret files to uid 10001; then build the image
    with `docker-compose build` (docker-compose.override.yml's `build:`)."""
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "setup.py", "README.md", COMPOSE.name,
                 COMPOSE_OVERRIDE.name, STACK.name):
        shutil.copy(REPO / name, root / name)
    for name in ("config", "skippy_zmq"):  # not an editable install's extension: the image builds its own
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (root / "tools").mkdir()
    shutil.copy(BASE_TOOL, root / "tools" / BASE_TOOL.name)
    tool = run(["bash", f"tools/{BASE_TOOL.name}"], root, 900)
    assert tool.returncode == 0, tool.stderr[-4000:]
    base = tool.stdout.strip().splitlines()[-1].removeprefix("SKIPPY_BASE_IMAGE=")
    gateway = load(COMPOSE)["services"]["gateway"]
    topology = TopologyConfig.from_toml(root / gateway["command"][2])
    keygen(topology)
    secrets = root / "secrets"
    secrets.mkdir()
    (secrets / "api_key").write_text(os.urandom(24).hex() + "\n")
    cert = run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                "-keyout", str(secrets / "tls.key"), "-out", str(secrets / "tls.crt")], root, 60)
    assert cert.returncode == 0, cert.stderr
    owned = [*sorted((root / "keys").glob("*/secret/*.key_secret")), secrets / "api_key", secrets / "tls.key"]
    for path in owned:
        path.chmod(0o600)
        os.chown(path, IMAGE_UID, IMAGE_UID)
    checkout = Checkout(root, base, f"skippy-zmq-deploytest:{os.getpid()}")
    built = run(["docker-compose", "-p", f"skippybuild{os.getpid()}", "build", "stage-0"], root, 1800, checkout.env)
    assert built.returncode == 0, built.stderr[-4000:]
    return checkout


def remove_image(checkout: Checkout, dangling: set[str]) -> None:
    """Remove the checkout's image and the untagged build-stage images its build left."""
    run(["docker", "image", "rm", "-f", checkout.image], checkout.root, 300)
    made = sorted(dangling_images() - dangling)
    if made:
        run(["docker", "image", "rm", *made], checkout.root, 300)


def https(checkout: Checkout, port: int, path: str, key: str | None,
          body: dict[str, Any] | None = None, timeout: float = 120, address: str = "127.0.0.1") -> tuple[int, Any]:
    """Status and JSON body of a request to ADDRESS:PORT over TLS (the body None for an HTTP error); the
    certificate, made for localhost and 127.0.0.1, is checked against its CA only at another address."""
    context = checkout.context()
    context.check_hostname = address == "127.0.0.1"
    try:
        with urllib.request.urlopen(request(port, path, key, body, address), context=context,
                                    timeout=timeout) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, None


def request(port: int, path: str, key: str | None, body: dict[str, Any] | None,
            address: str = "127.0.0.1") -> urllib.request.Request:
    """An HTTPS request to ADDRESS:PORT, with the API key when given."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = None if body is None else json.dumps(body).encode()
    return urllib.request.Request(f"https://{address}:{port}{path}", data=data, headers=headers)


def streamed(checkout: Checkout, port: int, key: str, body: dict[str, Any]) -> Iterator[str]:
    """The text of each chunk of a streamed completion, as it arrives."""
    with urllib.request.urlopen(request(port, "/v1/completions", key, body | {"stream": True}),
                                context=checkout.context(), timeout=120) as answer:
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


def wait_healthy(checkout: Checkout, port: int, logs: Callable[[], str], timeout_s: float = 600) -> None:
    """Until the gateway's open /health answers 200 (it refuses connections while it starts)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if https(checkout, port, "/health", None, timeout=10)[0] == 200:
                return
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() < deadline, f"the stack did not get healthy within {timeout_s:.0f} s\n{logs()}"
        time.sleep(1)
